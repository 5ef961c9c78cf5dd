// Turns a runtime (source, destination) element-type pair into a call of a
// generic functor with the matching tag types. Host-side only: the CPU loop and
// the kernel launcher both pick their template instance through it.
#pragma once

#include "csrc/core/convert.h"
#include "csrc/core/element_type.h"

namespace hipferry {

template <class Fn>
decltype(auto) dispatch_element_type(ElementType t, Fn&& fn) {
  switch (t) {
    case ElementType::kFloat32: return fn(Float32{});
    case ElementType::kFloat16: return fn(Float16{});
    case ElementType::kBFloat16: break;
  }
  return fn(BFloat16{});
}

template <class Fn>
decltype(auto) dispatch_element_pair(ElementType from, ElementType to, Fn&& fn) {
  return dispatch_element_type(from, [&](auto from_tag) -> decltype(auto) {
    return dispatch_element_type(to, [&](auto to_tag) -> decltype(auto) { return fn(from_tag, to_tag); });
  });
}

}  // namespace hipferry
