// copy_cast_ when either tensor is on the GPU: ONE kernel on the current torch
// stream that reads the source where it lies (device memory, or pinned host
// memory mapped into the device) and writes the converted value where dst lies.
// Equal dtypes use one async copy on the same stream (the copy engine).
//
// Like a non_blocking copy, the work is ordered on the current stream: the
// caller keeps both tensors alive until the stream has passed it, and
// synchronizes before reading a host dst.
#include <torch/csrc/stable/library.h>

#include <string>

#include "csrc/core/errors.h"
#include "csrc/torch/copy_cast_checks.h"
#include "csrc/torch/current_stream.h"
#include "csrc/torch/pinned_pool.h"
#include "hip/copy_cast_kernel.h"
#include "hip/runtime.h"
#include "hip/trace_session.h"

namespace hipferry {
namespace {

void copy_cast_gpu_kernel(Tensor dst, Tensor src) {
  check_copy_cast_args(dst, src);
  HF_CHECK(dst.is_cuda() || dst.is_cpu(), "hipferry.copy_cast_: dst must be on the CPU or a GPU, got ",
           device_name(dst.device()));
  HF_CHECK(src.is_cuda() || src.is_cpu(), "hipferry.copy_cast_: src must be on the CPU or a GPU, got ",
           device_name(src.device()));
  const int device = current_torch_device();
  const auto check_on_current_device = [device](const Tensor& t, const char* name) {
    HF_CHECK(!t.is_cuda() || t.get_device_index() == device, "hipferry.copy_cast_: ", name, " is on ",
             device_name(t.device()), " but the current device is cuda:", device,
             "; expected tensors on the current device (use torch.cuda.device(...) or "
             "torch.cuda.set_device)");
  };
  check_on_current_device(dst, "dst");
  check_on_current_device(src, "src");
  if (dst.numel() == 0 || copy_cast_is_noop(dst, src)) return;

  // Resolve both addresses before launching, so a rejected host tensor leaves dst untouched.
  void* d = copy_cast_device_address(dst, "dst", device);
  const void* s = copy_cast_device_address(src, "src", device);
  const rt::StreamHandle stream = current_torch_stream(device);
  try {
    rt::DeviceGuard guard(device);
    tracing::StreamSpan span(device, stream, "gpu:" + std::to_string(device) + " current stream", "copy_cast_",
                             dst.scalar_type() == src.scalar_type() ? "copy" : "kernel", nbytes_of(dst));
    if (dst.scalar_type() == src.scalar_type()) {
      rt::memcpy_async(d, s, nbytes_of(dst), stream);
    } else {
      gpu::launch_copy_cast(s, element_type_of(src), d, element_type_of(dst), dst.numel(), stream, device);
    }
    span.end();
    // Pool blocks this copy reads or writes go back only after it has run.
    record_pool_use(dst, device, stream);
    record_pool_use(src, device, stream);
  } catch (const std::exception& e) {
    HF_CHECK(false, e.what());
  }
}

}  // namespace

}  // namespace hipferry

STABLE_TORCH_LIBRARY_IMPL(hipferry, CUDA, m) { m.impl("copy_cast_", TORCH_BOX(&hipferry::copy_cast_gpu_kernel)); }
