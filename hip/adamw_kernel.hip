// platform.h first: it defines __host__/__device__ for the core headers.
#include "hip/platform.h"

#include <algorithm>

#include "csrc/core/convert.h"
#include "csrc/core/dispatch.h"
#include "hip/adamw_kernel.h"
#include "hip/check.h"

namespace hipferry::gpu {
namespace {

constexpr int kThreads = 256;
constexpr std::int64_t kMaxBlocks = 65535;

template <class Grad, class Out, bool kAmsgrad, bool kWriteOut>
__global__ void adamw_kernel(optim::AdamWArrays a, optim::AdamWScalars s, std::int64_t n) {
  const auto* grad = static_cast<const typename Grad::storage*>(a.grad);
  auto* out = static_cast<typename Out::storage*>(a.param_out);
  // Out of place when AdamWArrays' *_in arrays are set (see adamw_cpu.h), else in place.
  const bool from = a.param_in != nullptr;
  const float* param_in = from ? a.param_in : a.param;
  const float* m_in = from ? a.exp_avg_in : a.exp_avg;
  const float* v_in = from ? a.exp_avg_sq_in : a.exp_avg_sq;
  const float* max_in = from ? a.max_exp_avg_sq_in : a.max_exp_avg_sq;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    float p = param_in[i], m = m_in[i], v = v_in[i];
    if (kWriteOut && a.adopt_out) p = optim::adopt_written<Out>(p, out[i]);  // (in place only: the binding)
    float mx = kAmsgrad ? max_in[i] : 0.0f;
    optim::adamw_update<kAmsgrad>(p, to_f32<Grad>(grad[i]), m, v, mx, s);
    a.param[i] = p;
    a.exp_avg[i] = m;
    a.exp_avg_sq[i] = v;
    if (kAmsgrad) a.max_exp_avg_sq[i] = mx;
    if (kWriteOut) out[i] = from_f32<Out>(p);
  }
}

template <class Grad, class Out, bool kAmsgrad, bool kWriteOut>
void launch(const optim::AdamWArrays& a, const optim::AdamWScalars& s, std::int64_t n, hipStream_t stream) {
  const std::int64_t blocks = std::min<std::int64_t>((n + kThreads - 1) / kThreads, kMaxBlocks);
  adamw_kernel<Grad, Out, kAmsgrad, kWriteOut><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a, s, n);
}

}  // namespace

void launch_adamw(const optim::AdamWArrays& a, const optim::AdamWScalars& s, std::int64_t n, rt::StreamHandle stream,
                  int device) {
  if (n <= 0) return;
  rt::DeviceGuard guard(device);
  const auto native = static_cast<hipStream_t>(stream);
  dispatch_element_pair(a.grad_type, a.out_type, [&](auto grad_tag, auto out_tag) {
    using G = decltype(grad_tag);
    using O = decltype(out_tag);
    const bool out = a.param_out != nullptr;
    if (s.amsgrad) {
      out ? launch<G, O, true, true>(a, s, n, native) : launch<G, O, true, false>(a, s, n, native);
    } else {
      out ? launch<G, O, false, true>(a, s, n, native) : launch<G, O, false, false>(a, s, n, native);
    }
  });
  HIPFERRY_CHECK_ON(device, hipGetLastError());
}

}  // namespace hipferry::gpu
