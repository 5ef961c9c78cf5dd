#include "csrc/torch/copy_cast_checks.h"

#include "csrc/core/errors.h"
#include "hip/runtime.h"

// These checks run in the copy_cast_ op kernels: plain std::runtime_error,
// which torch's dispatcher raises as RuntimeError (as for its own copy checks).
// LayerCopier, AdamW and the transfer engine call them under translate_errors.

namespace hipferry {

// Device-visible address of a tensor's data. Host tensors must be page-locked
// and mapped; the address is always asked of the runtime, never assumed.
void* copy_cast_device_address(const Tensor& t, const char* name, int device) {
  if (!t.is_cpu()) return t.data_ptr();
  char* base = storage_start(t);  // the runtime maps whole allocations
  const std::ptrdiff_t offset = static_cast<const char*>(t.const_data_ptr()) - base;
  void* mapped = nullptr;
  try {
    mapped = rt::host_device_pointer(base);
  } catch (const rt::Error& e) {
    HF_CHECK(false, "hipferry.copy_cast_: ", name, " is pageable host memory (not page-locked and mapped into device ",
             device,
             "); expected pinned memory: use hipferry's pool, tensor.pin_memory(), or a plain "
             ".to() for pageable tensors. Runtime said: ",
             e.what());
  }
  return static_cast<char*>(mapped) + offset;
}

void check_copy_cast_args(const Tensor& dst, const Tensor& src) {
  HF_CHECK(dst.layout() == torch::headeronly::Layout::Strided,
           "hipferry.copy_cast_: dst must be a strided (dense) tensor, got a sparse or other non-strided layout");
  HF_CHECK(src.layout() == torch::headeronly::Layout::Strided,
           "hipferry.copy_cast_: src must be a strided (dense) tensor, got a sparse or other non-strided layout");
  const Shape ds = shape_of(dst), ss = shape_of(src);
  HF_CHECK(ds == ss, "hipferry.copy_cast_: dst has shape ", shape_str(ds), " but src has shape ", shape_str(ss),
           "; expected equal shapes");
  const auto dt = dst.scalar_type();
  const auto st = src.scalar_type();
  HF_CHECK(dt == st || (is_float_convertible(dt) && is_float_convertible(st)),
           "hipferry.copy_cast_: cannot convert src dtype ", dtype_name(st), " to dst dtype ", dtype_name(dt),
           "; expected float32, float16 or bfloat16 on both sides, or equal dtypes");
  HF_CHECK(dst.is_contiguous(), "hipferry.copy_cast_: dst must be contiguous (strides ", shape_str(strides_of(dst)),
           " for shape ", shape_str(ds), "); pass a contiguous tensor");
  HF_CHECK(src.is_contiguous(), "hipferry.copy_cast_: src must be contiguous (strides ", shape_str(strides_of(src)),
           " for shape ", shape_str(ss), "); call src.contiguous() first");
  if (dst.device() == src.device() && dst.numel() > 0 && !copy_cast_is_noop(dst, src)) {
    // Both are contiguous: they share memory exactly when their byte ranges meet.
    HF_CHECK(!bytes_overlap(dst, src), "hipferry.copy_cast_: dst and src share memory; expected separate tensors");
  }
}

bool copy_cast_is_noop(const Tensor& dst, const Tensor& src) {
  return dst.device() == src.device() && dst.scalar_type() == src.scalar_type() &&
         dst.const_data_ptr() == src.const_data_ptr();
}

}  // namespace hipferry
