// The per-element AdamW update, written once (design principle 1): the CPU
// loop (adamw_cpu.cpp) and the GPU kernel (hip/adamw_kernel.hip) both call
// adamw_update, so the CPU tests check the arithmetic the GPU runs, and the
// two agree bit for bit.
//
// It follows AdamW's definition (Loshchilov & Hutter; torch.optim.AdamW's
// docs), in the form all of torch's implementations share (bias corrections
// applied to the step size and to sqrt(v)), one IEEE float32 operation at a
// time: no fused multiply-add, and the build forbids FP contraction
// (-ffp-contract=off, nvcc --fmad=false, hipcc -ffp-contract=off). Every
// operation is correctly rounded (+ - * / sqrt), so the baseline, AVX2 and
// AVX-512 builds of the CPU loop and the GPU kernel give the same bits. It is NOT
// shaped after the FMA placement of any one ATen kernel: torch's own CPU kernels
// disagree with each other across CPU capabilities, so tests compare with torch
// within torch's tolerances and with a float64 model within a bound in ulps.
//   g       = maximize ? -grad : grad
//   param   = param * (1 - lr * weight_decay)
//   m       = beta1 * m + (1 - beta1) * g
//   v       = beta2 * v + (1 - beta2) * (g * g)
//   denom   = sqrt(amsgrad ? max(max_v, v) : v) * (1 / sqrt(1 - beta2^step)) + eps
//   param   = param - lr / (1 - beta1^step) * (m / denom)
// The step's scalars are computed in double on the host, as Python computes
// them, then rounded to float once. torch divides by sqrt(1 - beta2^step);
// multiplying by its reciprocal (rounded once, like the divisor) has the same
// error bound and saves one of the element's two divisions: in cache the CPU
// loop is bound by the divide / square-root unit, and this made it 1.14x
// (AVX2) and 1.26x (AVX-512) faster (issue 31).
//
// Note [one NaN]
// ~~~~~~~~~~~~~~
// Every result that is NaN (param, m, v, max_v; param_out is the rounded param)
// is written as the one quiet NaN 0x7fc00000 (positive, payload 0: what
// float("nan") is in float32), whatever NaNs went in. IEEE 754 leaves the
// payload of an operation on two NaNs open: x86 keeps its first operand's,
// and the compiler may order a commutative operation's operands either way
// in each build (the baseline and AVX2 loops disagreed where v and grad were
// both NaN); x86 makes a NaN out of numbers (inf - inf, 0 / 0) with the sign
// bit set, NVIDIA GPUs as 0x7fffffff. Canonical, every build and the GPU
// agree bit for bit on NaN too. A branch-free select per result (a compare
// and a blend), so the loops stay vectorized: 2-4% of the loop's time in
// cache, nothing measurable out of it (issue 31).
#pragma once

#include <cmath>
#include <cstdint>

#include "csrc/core/convert.h"
#include "csrc/core/host_device.h"

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
  float decay;  // 1 - lr * weight_decay (1 when weight_decay == 0: torch skips the multiply)
  float beta1;
  float one_minus_beta1;  // 1 - beta1, rounded once from double
  float beta2;
  float one_minus_beta2;  // 1 - beta2, rounded once from double
  float inv_bias2_sqrt;   // 1 / sqrt(1 - beta2^step)
  float eps;
  float step_size;  // lr / (1 - beta1^step)
  bool amsgrad;
  bool maximize;
  std::uint32_t grad_sign_mask;  // 0x80000000 with maximize: flips the gradient's sign bit (exactly -grad)
};

// Host only: Python's double arithmetic, then float.
inline AdamWScalars adamw_scalars(const AdamWHyper& h, std::int64_t step) {
  const double s = static_cast<double>(step);
  AdamWScalars out;
  out.decay = h.weight_decay != 0 ? static_cast<float>(1 - h.lr * h.weight_decay) : 1.0f;
  out.beta1 = static_cast<float>(h.beta1);
  out.one_minus_beta1 = static_cast<float>(1 - h.beta1);
  out.beta2 = static_cast<float>(h.beta2);
  out.one_minus_beta2 = static_cast<float>(1 - h.beta2);
  out.inv_bias2_sqrt = static_cast<float>(1 / std::sqrt(1 - std::pow(h.beta2, s)));
  out.eps = static_cast<float>(h.eps);
  out.step_size = static_cast<float>(h.lr / (1 - std::pow(h.beta1, s)));
  out.amsgrad = h.amsgrad;
  out.maximize = h.maximize;
  out.grad_sign_mask = h.maximize ? 0x80000000u : 0u;
  return out;
}

inline constexpr std::uint32_t kCanonicalNaNBits = 0x7fc00000u;

// x, or the canonical NaN when x is a NaN (Note [one NaN]).
HIPFERRY_HD float canonical_nan(float x) { return x != x ? f32_from_bits(kCanonicalNaNBits) : x; }

// One element. `max_v` is read and written only when kAmsgrad (a template
// argument, not s.amsgrad, so the loops over it have no branch and vectorize;
// callers pick the instance from s.amsgrad).
template <bool kAmsgrad>
HIPFERRY_HD void adamw_update(float& param, float grad, float& m, float& v, float& max_v, const AdamWScalars& s) {
  // The sign flip is done on bits: GCC does not vectorize a select on a
  // scalar bool next to 16-bit stores.
  const float g = f32_from_bits(f32_as_bits(grad) ^ s.grad_sign_mask);
  param = param * s.decay;
  m = s.beta1 * m + s.one_minus_beta1 * g;
  v = s.beta2 * v + s.one_minus_beta2 * (g * g);
  float second = v;
  if constexpr (kAmsgrad) {
    // torch.maximum, NaN-propagating: a NaN v wins the first select, a NaN
    // max_v the second. Two plain selects, so the loop stays branch-free.
    const float larger = max_v > v ? max_v : v;
    max_v = max_v != max_v ? max_v : larger;
    second = max_v;
    max_v = canonical_nan(max_v);
  }
  const float denom = sqrtf(second) * s.inv_bias2_sqrt + s.eps;
  param = canonical_nan(param - s.step_size * (m / denom));
  m = canonical_nan(m);
  v = canonical_nan(v);
}

// Note [a write the master does not see]: a bf16/fp16 parameter stepped where it lives holds its
// rounded master after every step (param_out), so an element whose bits differ from the rounded
// master at the next step was written by the user (`p.data.copy_`, numpy, a storage copy: writes
// no version counter shows). Its value becomes the master before the step, as torch.optim.AdamW
// would continue from it. Compared on bits: a NaN the step left (the one NaN) stays the master's.
template <class Out>
HIPFERRY_HD float adopt_written(float master, typename Out::storage written) {
  const typename Out::storage rounded = from_f32<Out>(master);
  bool same;
  if constexpr (sizeof(rounded) == 4) {
    same = f32_as_bits(rounded) == f32_as_bits(written);
  } else {
    same = rounded == written;
  }
  return same ? master : to_f32<Out>(written);
}

}  // namespace hipferry::optim
