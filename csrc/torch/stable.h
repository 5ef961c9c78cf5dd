// hipferry's view of LibTorch's stable ABI (torch/csrc/stable): the one header
// the torch layer includes for tensors, so no file spells an ATen or c10 type.
// The module is built with TORCH_TARGET_VERSION = the oldest torch it supports
// (cmake/torch.cmake): the stable headers then offer only what that release's
// libtorch exports, and one binary loads under it and every newer release.
#pragma once

#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "csrc/core/element_type.h"

namespace hipferry {

using Tensor = torch::stable::Tensor;
using ScalarType = torch::headeronly::ScalarType;
using Device = torch::stable::Device;
using DeviceType = torch::headeronly::DeviceType;
using Shape = std::vector<std::int64_t>;

// GPU `index` as torch names it ("cuda:N"; ROCm builds of torch call their GPUs cuda too).
inline Device cuda_device(int index) {
  return Device(DeviceType::CUDA, static_cast<torch::stable::DeviceIndex>(index));
}

// Where `t`'s storage starts: its data less the storage offset. The runtime
// maps, and a pool hands out, whole allocations; a view's data may begin
// inside one. const_data_ptr: asking must not materialize a copy-on-write storage.
inline char* storage_start(const Tensor& t) {
  return static_cast<char*>(const_cast<void*>(t.const_data_ptr())) -
         t.storage_offset() * static_cast<std::int64_t>(t.element_size());
}

inline Shape shape_of(const Tensor& t) {
  const auto s = t.sizes();
  return Shape(s.begin(), s.end());
}
inline Shape strides_of(const Tensor& t) {
  const auto s = t.strides();
  return Shape(s.begin(), s.end());
}
// "[2, 3]", as torch prints a size.
std::string shape_str(const Shape& s);
// "torch.float16", as Python users spell a dtype.
std::string dtype_name(ScalarType t);
// "cpu", "cuda:0", as torch.device prints.
std::string device_name(const Device& d);
// A device from its Python spelling: "cpu", "cuda", "cuda:N" (str(torch.device)).
// Throws ValueError naming `what` for anything else.
Device parse_device(const std::string& text, const char* what);
// A dtype from its Python spelling ("torch.float16" or "float16"). Throws
// ValueError naming `what` for anything else.
ScalarType parse_dtype(const std::string& text, const char* what);

inline bool is_float_convertible(ScalarType t) {
  return t == ScalarType::Float || t == ScalarType::Half || t == ScalarType::BFloat16;
}
inline bool is_quantized(ScalarType t) {
  return t == ScalarType::QInt8 || t == ScalarType::QUInt8 || t == ScalarType::QInt32 || t == ScalarType::QUInt4x2 ||
         t == ScalarType::QUInt2x4;
}
std::size_t element_size_of(ScalarType t);
// Every dtype dtype_name, parse_dtype and element_size_of know (tested against torch.dtype).
std::vector<ScalarType> known_dtypes();
inline std::size_t nbytes_of(const Tensor& t) { return static_cast<std::size_t>(t.numel()) * t.element_size(); }
// Whether the bytes of contiguous `a` and `b` meet (for contiguous tensors: whether they share memory).
inline bool bytes_overlap(const Tensor& a, const Tensor& b) {
  const char* pa = static_cast<const char*>(a.const_data_ptr());
  const char* pb = static_cast<const char*>(b.const_data_ptr());
  return pa < pb + nbytes_of(b) && pb < pa + nbytes_of(a);
}

// The core's name for a float dtype (float32, float16, bfloat16); throws otherwise.
ElementType element_type_of(const Tensor& t);

// Throws std::runtime_error with torch's message (no backtrace) when a stable
// C shim call returned an error. Unlike torch's STABLE_TORCH_ERROR_CODE_CHECK
// it writes nothing to stderr: some of these errors are an expected fallback
// (held_source in transfer_engine.cpp), the rest are raised to the caller.
void check_shim(AOTITorchError code, const char* call);

// An ATen op through the dispatcher, for ops the stable headers do not wrap:
// `args` converted with torch::stable::detail::from; returns the first result.
template <class... Args>
Tensor call_aten(const char* name, const char* overload, const Args&... args) {
  constexpr std::size_t n = sizeof...(Args) > 0 ? sizeof...(Args) : 1;
  std::array<StableIValue, n> stack{torch::stable::detail::from(args)...};
  check_shim(torch_call_dispatcher(name, overload, stack.data(), TORCH_ABI_VERSION), name);
  return torch::stable::detail::to<Tensor>(stack[0]);
}

}  // namespace hipferry
