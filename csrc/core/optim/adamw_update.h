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
  float beta2;
  float one_minus_beta2;
  float bias2_sqrt;       // sqrt(1 - beta2^step)
  float eps;
  float neg_step_size;    // -lr / (1 - beta1^step)
  bool amsgrad;
  bool maximize;
};

// Host only: Python's double arithmetic, then float.
inline AdamWScalars adamw_scalars(const AdamWHyper& h, std::int64_t step) {
  const double s = static_cast<double>(step);
  AdamWScalars out;
  out.decay = h.weight_decay != 0 ? static_cast<float>(1 - h.lr * h.weight_decay) : 1.0f;
  out.lerp_weight = static_cast<float>(1 - h.beta1);
  out.beta2 = static_cast<float>(h.beta2);
  out.one_minus_beta2 = static_cast<float>(1 - h.beta2);
  out.bias2_sqrt = static_cast<float>(std::pow(1 - std::pow(h.beta2, s), 0.5));
  out.eps = static_cast<float>(h.eps);
  out.neg_step_size = static_cast<float>(-(h.lr / (1 - std::pow(h.beta1, s))));
  out.amsgrad = h.amsgrad;
  out.maximize = h.maximize;
  return out;
}

// One element. `max_v` is read and written only when s.amsgrad.
HIPFERRY_HD void adamw_update(float& param, float grad, float& m, float& v, float& max_v, const AdamWScalars& s) {
  const float g = s.maximize ? -grad : grad;
  param = param * s.decay;
  // ATen's vectorized lerp: fma(weight or weight - 1, end - self, self or end),
  // by whether |weight| < 0.5.
  const float w = s.lerp_weight;
  const bool small = w < 0.5f && w > -0.5f;
  m = fmaf(small ? w : w - 1.0f, g - m, small ? m : g);
  v = v * s.beta2;
  v = fmaf(s.one_minus_beta2 * g, g, v);  // addcmul: self + value * t1 * t2, fused as ATen's vector loop is
  float second = v;
  if (s.amsgrad) {
    max_v = (max_v > v || max_v != max_v) ? max_v : v;  // torch.maximum, NaN-propagating
    second = max_v;
  }
  const float denom = sqrtf(second) / s.bias2_sqrt + s.eps;
  param = param + s.neg_step_size * m / denom;  // addcdiv: self + value * t1 / t2
}

}  // namespace hipferry::optim
