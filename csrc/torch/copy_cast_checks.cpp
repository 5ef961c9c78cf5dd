#include "csrc/torch/copy_cast_checks.h"

#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include "hip/runtime.h"

// These checks run in the copy_cast_ op kernels, so they stay c10 errors (see
// pool_empty in pinned_pool.cpp); LayerCopier, AdamW and the transfer engine
// call them under translate_errors, which maps c10 errors too.

namespace hipferry {
namespace {

bool is_convertible_float(c10::ScalarType t) {
  return t == c10::kFloat || t == c10::kHalf || t == c10::kBFloat16;
}

}  // namespace

// Device-visible address of a tensor's data. Host tensors must be page-locked
// and mapped; the address is always asked of the runtime, never assumed.
void* copy_cast_device_address(const at::Tensor& t, const char* name, int device) {
  if (!t.is_cpu()) return t.data_ptr();
  void* base = t.storage().mutable_data();
  void* mapped = nullptr;
  try {
    mapped = rt::host_device_pointer(base);
  } catch (const rt::Error& e) {
    TORCH_CHECK(false, "hipferry.copy_cast_: ", name,
                " is pageable host memory (not page-locked and mapped into device ", device,
                "); expected pinned memory: use hipferry's pool, tensor.pin_memory(), or a plain "
                ".to() for pageable tensors. Runtime said: ", e.what());
  }
  const auto offset = static_cast<char*>(t.data_ptr()) - static_cast<char*>(base);
  return static_cast<char*>(mapped) + offset;
}

void check_copy_cast_args(const at::Tensor& dst, const at::Tensor& src) {
  TORCH_CHECK(dst.layout() == c10::kStrided, "hipferry.copy_cast_: dst must be a strided (dense) tensor, got layout ",
              dst.layout());
  TORCH_CHECK(src.layout() == c10::kStrided, "hipferry.copy_cast_: src must be a strided (dense) tensor, got layout ",
              src.layout());
  TORCH_CHECK(dst.sizes() == src.sizes(), "hipferry.copy_cast_: dst has shape ", dst.sizes(),
              " but src has shape ", src.sizes(), "; expected equal shapes");
  const auto dt = dst.scalar_type();
  const auto st = src.scalar_type();
  TORCH_CHECK(dt == st || (is_convertible_float(dt) && is_convertible_float(st)),
              "hipferry.copy_cast_: cannot convert src dtype ", st, " to dst dtype ", dt,
              "; expected float32, float16 or bfloat16 on both sides, or equal dtypes");
  TORCH_CHECK(dst.is_contiguous(), "hipferry.copy_cast_: dst must be contiguous (strides ",
              dst.strides(), " for shape ", dst.sizes(), "); pass a contiguous tensor");
  TORCH_CHECK(src.is_contiguous(), "hipferry.copy_cast_: src must be contiguous (strides ",
              src.strides(), " for shape ", src.sizes(), "); call src.contiguous() first");
  if (dst.device() == src.device() && dst.numel() > 0 && !copy_cast_is_noop(dst, src)) {
    TORCH_CHECK(at::get_overlap_status(dst, src) == at::MemOverlapStatus::No,
                "hipferry.copy_cast_: dst and src share memory; expected separate tensors");
  }
}

bool copy_cast_is_noop(const at::Tensor& dst, const at::Tensor& src) {
  return dst.device() == src.device() && dst.scalar_type() == src.scalar_type() &&
         dst.data_ptr() == src.data_ptr();
}

ElementType element_type_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case c10::kFloat: return ElementType::kFloat32;
    case c10::kHalf: return ElementType::kFloat16;
    case c10::kBFloat16: return ElementType::kBFloat16;
    default: TORCH_CHECK(false, "hipferry: internal error, no element type for ", t.scalar_type());
  }
}

}  // namespace hipferry
