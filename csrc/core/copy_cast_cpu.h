// CPU kernel of copy_cast: raw pointers, no torch. The ATen layer splits the
// range over torch's thread pool; tests call it directly.
#pragma once

#include <cstdint>

#include "csrc/core/element_type.h"

namespace hipferry {

// dst[i] = convert(src[i]) for i in [begin, end). `src` and `dst` point at
// element 0 of arrays of `src_type` / `dst_type`; they must not overlap.
void copy_cast_cpu(const void* src, ElementType src_type, void* dst, ElementType dst_type, std::int64_t begin,
                   std::int64_t end);

}  // namespace hipferry

namespace hipferry {
// True when the float16 conversions use the CPU's F16C instructions (x86-64).
bool copy_cast_cpu_uses_f16c();
}  // namespace hipferry
