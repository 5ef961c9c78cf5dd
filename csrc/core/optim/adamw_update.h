// The per-element AdamW update, written once (design principle 1): the CPU
// loop (adamw_cpu.cpp) and the GPU kernel (hip/adamw_kernel.hip) both call
// adamw_update, so the CPU tests check the arithmetic the GPU runs.
//
// It follows torch.optim.AdamW (single-tensor path) operation by operation,
// in float32, with the step's scalars computed in double on the host as
// Python computes them, then rounded to float as ATen does when it applies a
// Python scalar to a float32 tensor:
//   param.mul_(1 - lr * weight_decay)
//   exp_avg.lerp_(grad, 1 - beta1)                  (ATen computes it with one fma)
//   exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
//   denom = (max(max_exp_avg_sq, exp_avg_sq) if amsgrad else exp_avg_sq).sqrt() / sqrt(1 - beta2^step) + eps
//   param.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1^step))
#pragma once

#include <cmath>
#include <cstdint>

#include "convert.h"
#include "host_device.h"

namespace hipferry::optim {

struct AdamWHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  bool amsgrad = false;
  bool maximize = false;
};

// The float scalars of one step (`step` counts from 1).
struct AdamWScalars {
  float decay;            // 1 - lr * weight_decay (1 when weight_decay == 0: torch skips the multiply)
  float lerp_weight;      // 1 - beta1
  // ATen's vectorized lerp computes fma(weight or weight - 1, end - self, self or end),
  // by whether |weight| < 0.5; decided here once, not per element.
  float lerp_coef;        // lerp_weight or lerp_weight - 1
  bool lerp_from_self;    // |lerp_weight| < 0.5: start from exp_avg (else from the gradient)
  std::uint32_t lerp_self_mask;  // all ones when lerp_from_self (a bit select: see adamw_update)
  float beta2;
  float one_minus_beta2;
  float bias2_sqrt;       // sqrt(1 - beta2^step)
  float eps;
  float neg_step_size;    // -lr / (1 - beta1^step)
  bool amsgrad;
  bool maximize;
  std::uint32_t grad_sign_mask;  // 0x80000000 with maximize: flips the gradient's sign bit (exactly -grad)
};

// Host only: Python's double arithmetic, then float.
inline AdamWScalars adamw_scalars(const AdamWHyper& h, std::int64_t step) {
  const double s = static_cast<double>(step);
  AdamWScalars out;
  out.decay = h.weight_decay != 0 ? static_cast<float>(1 - h.lr * h.weight_decay) : 1.0f;
  out.lerp_weight = static_cast<float>(1 - h.beta1);
  out.lerp_from_self = out.lerp_weight < 0.5f && out.lerp_weight > -0.5f;
  out.lerp_coef = out.lerp_from_self ? out.lerp_weight : out.lerp_weight - 1.0f;
  out.lerp_self_mask = out.lerp_from_self ? 0xffffffffu : 0u;
  out.beta2 = static_cast<float>(h.beta2);
  out.one_minus_beta2 = static_cast<float>(1 - h.beta2);
  out.bias2_sqrt = static_cast<float>(std::pow(1 - std::pow(h.beta2, s), 0.5));
  out.eps = static_cast<float>(h.eps);
  out.neg_step_size = static_cast<float>(-(h.lr / (1 - std::pow(h.beta1, s))));
  out.amsgrad = h.amsgrad;
  out.maximize = h.maximize;
  out.grad_sign_mask = h.maximize ? 0x80000000u : 0u;
  return out;
}

// One element. `max_v` is read and written only when kAmsgrad (a template
// argument, not s.amsgrad, so the loops over it have no branch and vectorize;
// callers pick the instance from s.amsgrad).
template <bool kAmsgrad>
HIPFERRY_HD void adamw_update(float& param, float grad, float& m, float& v, float& max_v, const AdamWScalars& s) {
  // Selects on scalar flags are done on bits (here and for the lerp below):
  // GCC does not vectorize a select on a scalar bool next to 16-bit stores.
  const float g = f32_from_bits(f32_as_bits(grad) ^ s.grad_sign_mask);
  param = param * s.decay;
  const float from = f32_from_bits((f32_as_bits(m) & s.lerp_self_mask) | (f32_as_bits(g) & ~s.lerp_self_mask));
  m = fmaf(s.lerp_coef, g - m, from);  // ATen's vectorized lerp
  v = v * s.beta2;
  v = fmaf(s.one_minus_beta2 * g, g, v);  // addcmul: self + value * t1 * t2, fused as ATen's vector loop is
  float second = v;
  if constexpr (kAmsgrad) {
    // torch.maximum, NaN-propagating: a NaN v wins the first select, a NaN
    // max_v the second. Two plain selects, so the loop stays branch-free.
    const float larger = max_v > v ? max_v : v;
    max_v = max_v != max_v ? max_v : larger;
    second = max_v;
  }
  const float denom = sqrtf(second) / s.bias2_sqrt + s.eps;
  param = param + s.neg_step_size * m / denom;  // addcdiv: self + value * t1 / t2
}

}  // namespace hipferry::optim
