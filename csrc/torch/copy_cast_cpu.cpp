// copy_cast_ on the CPU (both tensors in host memory). The fake (Meta) kernel
// used by torch.compile is in python/hipferry/ops.py: it must handle symbolic
// shapes, which the checks here (numel, strides) cannot.
#include <torch/csrc/stable/library.h>

#include <cstring>

#include "csrc/core/copy_cast_cpu.h"
#include "csrc/core/errors.h"
#include "csrc/torch/copy_cast_checks.h"
#include "hip/trace_session.h"

namespace hipferry {
namespace {

// Elements per task: big enough that thread start-up is amortised, small
// enough that a few MiB already use every core.
constexpr int64_t kGrainElements = 1 << 16;

void copy_cast_cpu_run(Tensor& dst, const Tensor& src);

void copy_cast_cpu_kernel(Tensor dst, Tensor src) {
  check_copy_cast_args(dst, src);
  HF_CHECK(dst.is_cpu() && src.is_cpu(), "hipferry.copy_cast_: CPU kernel called with dst on ",
           device_name(dst.device()), " and src on ", device_name(src.device()));
  if (dst.numel() == 0 || copy_cast_is_noop(dst, src)) return;
  const std::int64_t t0 = tracing::now_ns();
  copy_cast_cpu_run(dst, src);
  tracing::add_host_span("copy_cast_", "kernel", "caller thread", t0, tracing::now_ns(), nbytes_of(dst));
}

void copy_cast_cpu_run(Tensor& dst, const Tensor& src) {
  if (dst.scalar_type() == src.scalar_type()) {
    // Any dtype: a parallel byte copy.
    auto* d = static_cast<char*>(dst.data_ptr());
    const auto* s = static_cast<const char*>(src.const_data_ptr());
    const int64_t bytes = static_cast<int64_t>(nbytes_of(dst));
    torch::stable::parallel_for(0, bytes, kGrainElements * 4,
                                [&](int64_t begin, int64_t end) { std::memcpy(d + begin, s + begin, end - begin); });
    return;
  }
  const ElementType st = element_type_of(src);
  const ElementType dt = element_type_of(dst);
  const void* s = src.const_data_ptr();
  void* d = dst.data_ptr();
  torch::stable::parallel_for(0, dst.numel(), kGrainElements,
                              [&](int64_t begin, int64_t end) { copy_cast_cpu(s, st, d, dt, begin, end); });
}

}  // namespace

}  // namespace hipferry

STABLE_TORCH_LIBRARY_IMPL(hipferry, CPU, m) { m.impl("copy_cast_", TORCH_BOX(&hipferry::copy_cast_cpu_kernel)); }
