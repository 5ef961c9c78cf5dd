// The fused AdamW step on raw arrays: against a double-precision model of
// AdamW (a bound in ulps per step, and a trajectory), in pieces vs whole,
// mixed precision, amsgrad, maximize, the HIPFERRY_CPU_ISA parser.
// (The comparison with torch itself, within torch's tolerances, is in tests/python.)
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

#include "csrc/core/convert.h"
#include "csrc/core/cpu/cpu_isa.h"
#include "csrc/core/optim/adamw_cpu.h"
#include "tests/cpp/adamw_arrays.h"

namespace hipferry::optim {
namespace {

struct State {
  std::vector<float> p, g, m, v, vmax;
  explicit State(std::size_t n, unsigned seed) : p(n), g(n), m(n, 0.f), v(n, 0.f), vmax(n, 0.f) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> d(0.f, 1.f);
    for (std::size_t i = 0; i < n; ++i) {
      p[i] = d(rng);
      g[i] = d(rng) * 1e-2f;
    }
  }
  AdamWArrays arrays() { return float32_arrays(p.data(), g.data(), m.data(), v.data(), vmax.data()); }
};

// AdamW's formulas in double: what a float32 trajectory must stay close to.
struct Reference {
  double p, m = 0, v = 0, vmax = 0;
  void step(double g, const AdamWHyper& h, int t) {
    if (h.maximize) g = -g;
    p *= 1 - h.lr * h.weight_decay;
    m = h.beta1 * m + (1 - h.beta1) * g;
    v = h.beta2 * v + (1 - h.beta2) * g * g;
    vmax = std::max(vmax, v);
    const double second = h.amsgrad ? vmax : v;
    const double denom = std::sqrt(second) / std::sqrt(1 - std::pow(h.beta2, t)) + h.eps;
    p -= h.lr / (1 - std::pow(h.beta1, t)) * m / denom;
  }
};

void expect_close_to_reference(const AdamWHyper& h) {
  constexpr std::size_t n = 1000;
  State s(n, 7);
  std::vector<Reference> ref;
  for (float p : s.p) ref.push_back(Reference{p});
  for (int t = 1; t <= 50; ++t) {
    adamw_cpu(s.arrays(), adamw_scalars(h, t), 0, n);
    for (std::size_t i = 0; i < n; ++i) ref[i].step(s.g[i], h, t);
  }
  // float32 rounding over 50 steps of a few operations each: a few 1e-6
  // relative. A wrong formula is off by far more (1e-3 and up).
  for (std::size_t i = 0; i < n; ++i) {
    ASSERT_NEAR(s.p[i], ref[i].p, 2e-5 * std::abs(ref[i].p) + 1e-6) << "element " << i;
    ASSERT_NEAR(s.m[i], ref[i].m, 1e-5 * std::abs(ref[i].m) + 1e-9) << "element " << i;
    ASSERT_NEAR(s.v[i], ref[i].v, 1e-5 * std::abs(ref[i].v) + 1e-12) << "element " << i;
  }
}

// float32 ulps of `scale`: the unit of the per-step bounds below.
double ulps(double err, double scale) {
  if (scale == 0) return err == 0 ? 0 : INFINITY;
  int e;
  std::frexp(scale, &e);                 // scale = f * 2^e, f in [0.5, 1)
  return err / std::ldexp(1.0, e - 24);  // float32's ulp at scale
}

// One step from the SAME float32 state, against the double model evaluated
// on those float32 values with the exact (double) hyperparameters. Each
// result's error is bounded in ulps of the sum of the magnitudes of its terms
// (the textbook bound of a few correctly rounded operations; cancellation
// cannot hide behind it), so the bound holds per step, on every machine.
void expect_step_within_ulps(const AdamWHyper& h, int t) {
  constexpr std::size_t n = 4096;
  State s(n, 21 + t);
  std::mt19937 rng(5 + t);
  std::normal_distribution<float> d(0.f, 1.f);
  for (std::size_t i = 0; i < n; ++i) {  // a state in the middle of training: moments of mixed size and sign
    s.m[i] = d(rng) * 1e-2f;
    s.v[i] = std::abs(d(rng)) * 1e-4f + (i % 7 == 0 ? 0.f : 1e-6f);
    s.vmax[i] = s.v[i] * (i % 3 == 0 ? 2.f : 0.5f);
  }
  const State before = s;
  adamw_cpu(s.arrays(), adamw_scalars(h, t), 0, n);
  double worst_p = 0, worst_m = 0, worst_v = 0;
  for (std::size_t i = 0; i < n; ++i) {
    double g = before.g[i];
    if (h.maximize) g = -g;
    const double p0 = before.p[i], m0 = before.m[i], v0 = before.v[i];
    const double m = h.beta1 * m0 + (1 - h.beta1) * g;
    const double v = h.beta2 * v0 + (1 - h.beta2) * g * g;
    // The moments this step really produced feed the parameter's model, so
    // the parameter's bound covers its own operations only.
    const double mf = s.m[i], vf = s.v[i];
    const double second = h.amsgrad ? std::max<double>(before.vmax[i], vf) : vf;
    const double decayed = p0 * (1 - h.lr * h.weight_decay);
    const double update =
        h.lr / (1 - std::pow(h.beta1, t)) * mf / (std::sqrt(second) / std::sqrt(1 - std::pow(h.beta2, t)) + h.eps);
    const double p = decayed - update;
    worst_m = std::max(worst_m, ulps(std::abs(s.m[i] - m), std::abs(h.beta1 * m0) + std::abs((1 - h.beta1) * g)));
    worst_v = std::max(worst_v, ulps(std::abs(s.v[i] - v), std::abs(h.beta2 * v0) + (1 - h.beta2) * g * g));
    worst_p = std::max(worst_p, ulps(std::abs(s.p[i] - p), std::abs(decayed) + std::abs(update)));
  }
  // m and v: two products, one sum and the rounding of two scalars: <= 2 ulps.
  // The parameter: the decay product, sqrt, two divisions, two sums and the
  // rounded step scalars: <= 4 ulps. A wrong formula misses by millions.
  EXPECT_LE(worst_m, 2.0) << "step " << t;
  EXPECT_LE(worst_v, 2.0) << "step " << t;
  EXPECT_LE(worst_p, 4.0) << "step " << t;
}

TEST(AdamWCpu, EveryStepIsWithinFewUlpsOfTheDoubleModel) {
  AdamWHyper h;
  h.weight_decay = 0.05;
  for (int t : {1, 2, 10, 1000}) expect_step_within_ulps(h, t);
  h.amsgrad = true;
  h.maximize = true;
  h.lr = 3e-2;
  for (int t : {1, 7, 500}) expect_step_within_ulps(h, t);
  h.weight_decay = 0;
  h.beta1 = 0.5;
  h.beta2 = 0.99;
  for (int t : {1, 3}) expect_step_within_ulps(h, t);
}

// Every build this CPU runs, in order (baseline, AVX2, AVX-512).
std::vector<cpu::Isa> builds_here() {
  std::vector<cpu::Isa> out;
  for (cpu::Isa isa : {cpu::Isa::kBaseline, cpu::Isa::kAvx2, cpu::Isa::kAvx512}) {
    if (isa <= cpu::best_isa()) out.push_back(isa);
  }
  return out;
}

// The AVX2 and AVX-512 builds agree with the baseline build bit for bit (no
// FMA, only correctly rounded operations), over every instance: grad/out
// types, amsgrad. (With NaNs and infinities in every array: adamw_nan_test.cpp.)
TEST(AdamWCpu, EveryBuildGivesTheBaselineBits) {
  if (cpu::best_isa() == cpu::Isa::kBaseline) GTEST_SKIP() << "this CPU (or build) has only the baseline loops";
  constexpr std::size_t n = 1003;  // a remainder after the 8- and 16-wide bodies
  for (cpu::Isa isa : builds_here()) {
    for (bool amsgrad : {false, true}) {
      for (ElementType grad_type : {ElementType::kFloat32, ElementType::kBFloat16, ElementType::kFloat16}) {
        AdamWHyper h;
        h.amsgrad = amsgrad;
        h.maximize = amsgrad;
        State wide(n, 9), base(n, 9);
        std::vector<std::uint16_t> g16(n), out_wide(n), out_base(n);
        for (std::size_t i = 0; i < n; ++i) g16[i] = f32_to_bf16_rne(wide.g[i]);
        AdamWArrays a = wide.arrays(), b = base.arrays();
        if (grad_type != ElementType::kFloat32) {
          a.grad = b.grad = g16.data();
          a.grad_type = b.grad_type = grad_type;
          a.param_out = out_wide.data();
          b.param_out = out_base.data();
          a.out_type = b.out_type = grad_type;
        }
        for (int t = 1; t <= 5; ++t) {
          adamw_cpu_isa(isa, a, adamw_scalars(h, t), 0, n);
          adamw_cpu_isa(cpu::Isa::kBaseline, b, adamw_scalars(h, t), 0, n);
        }
        EXPECT_EQ(0, std::memcmp(wide.p.data(), base.p.data(), n * 4))
            << cpu::isa_name(isa) << " " << element_type_name(grad_type);
        EXPECT_EQ(0, std::memcmp(wide.m.data(), base.m.data(), n * 4));
        EXPECT_EQ(0, std::memcmp(wide.v.data(), base.v.data(), n * 4));
        EXPECT_EQ(0, std::memcmp(wide.vmax.data(), base.vmax.data(), n * 4));
        EXPECT_EQ(out_wide, out_base);
      }
    }
  }
}

TEST(CpuIsa, ParsesTheVariableAndRejectsWhatCannotRun) {
  EXPECT_EQ(cpu::parse_isa("", cpu::Isa::kAvx2), cpu::Isa::kAvx2);
  EXPECT_EQ(cpu::parse_isa("auto", cpu::Isa::kBaseline), cpu::Isa::kBaseline);
  EXPECT_EQ(cpu::parse_isa("baseline", cpu::Isa::kAvx2), cpu::Isa::kBaseline);
  EXPECT_EQ(cpu::parse_isa("avx2", cpu::Isa::kAvx2), cpu::Isa::kAvx2);
  EXPECT_EQ(cpu::parse_isa("avx2", cpu::Isa::kAvx512), cpu::Isa::kAvx2);
  EXPECT_EQ(cpu::parse_isa("avx512", cpu::Isa::kAvx512), cpu::Isa::kAvx512);
  EXPECT_EQ(cpu::parse_isa("", cpu::Isa::kAvx512), cpu::Isa::kAvx512);
  EXPECT_THROW(cpu::parse_isa("avx2", cpu::Isa::kBaseline), std::invalid_argument);
  EXPECT_THROW(cpu::parse_isa("avx512", cpu::Isa::kAvx2), std::invalid_argument);
  EXPECT_THROW(cpu::parse_isa("AVX512", cpu::Isa::kAvx512), std::invalid_argument);
  EXPECT_STREQ(cpu::isa_name(cpu::Isa::kBaseline), "baseline");
  EXPECT_STREQ(cpu::isa_name(cpu::Isa::kAvx2), "avx2");
  EXPECT_STREQ(cpu::isa_name(cpu::Isa::kAvx512), "avx512");
}

TEST(AdamWCpu, MatchesTheDoubleModelOverFiftySteps) { expect_close_to_reference(AdamWHyper{}); }

TEST(AdamWCpu, AmsgradMaximizeAndNoWeightDecayMatchTheModel) {
  AdamWHyper h;
  h.amsgrad = true;
  expect_close_to_reference(h);
  h.amsgrad = false;
  h.maximize = true;
  expect_close_to_reference(h);
  h.weight_decay = 0;
  h.lr = 3e-2;
  expect_close_to_reference(h);
}

TEST(AdamWCpu, FirstStepMovesEachParameterByAboutLrAgainstItsGradient) {
  AdamWHyper h;
  h.weight_decay = 0;
  State s(64, 3);
  const std::vector<float> before = s.p;
  adamw_cpu(s.arrays(), adamw_scalars(h, 1), 0, 64);
  for (std::size_t i = 0; i < 64; ++i) {
    const double expected = before[i] - h.lr * (s.g[i] > 0 ? 1 : -1);  // m/(1-b1) / sqrt(v/(1-b2)) = sign(g)
    EXPECT_NEAR(s.p[i], expected, 1e-6) << i;
  }
}

TEST(AdamWCpu, PiecesGiveExactlyTheWholeRange) {
  constexpr std::size_t n = 777;
  State whole(n, 11), pieces(n, 11);
  const AdamWScalars sc = adamw_scalars(AdamWHyper{}, 3);
  adamw_cpu(whole.arrays(), sc, 0, n);
  for (std::int64_t b = 0; b < static_cast<std::int64_t>(n); b += 100) {
    adamw_cpu(pieces.arrays(), sc, b, std::min<std::int64_t>(b + 100, n));
  }
  EXPECT_EQ(whole.p, pieces.p);
  EXPECT_EQ(whole.m, pieces.m);
  EXPECT_EQ(whole.v, pieces.v);
}

TEST(AdamWCpu, MixedPrecisionReadsLowPrecisionGradsAndWritesTheRoundedParam) {
  constexpr std::size_t n = 300;
  State f32(n, 5), mixed(n, 5);
  std::vector<std::uint16_t> g16(n), out(n, 0);
  for (std::size_t i = 0; i < n; ++i) {
    g16[i] = f32_to_bf16_rne(f32.g[i]);
    f32.g[i] = bf16_to_f32(g16[i]);  // the same gradient values, in float32
  }
  AdamWArrays a = mixed.arrays();
  a.grad = g16.data();
  a.grad_type = ElementType::kBFloat16;
  a.param_out = out.data();
  a.out_type = ElementType::kBFloat16;
  const AdamWScalars sc = adamw_scalars(AdamWHyper{}, 1);
  adamw_cpu(a, sc, 0, n);
  adamw_cpu(f32.arrays(), sc, 0, n);
  EXPECT_EQ(mixed.p, f32.p);  // the master copy: exactly the float32 run
  for (std::size_t i = 0; i < n; ++i) EXPECT_EQ(out[i], f32_to_bf16_rne(mixed.p[i])) << i;
}

TEST(AdamWCpu, AmsgradKeepsTheRunningMaximumAndNaNPropagatesAsTheCanonicalNaN) {
  AdamWHyper h;
  h.amsgrad = true;
  State s(4, 1);
  s.g = {1.f, 1.f, 1.f, 1.f};
  adamw_cpu(s.arrays(), adamw_scalars(h, 1), 0, 4);
  const std::vector<float> first = s.vmax;
  s.g = {0.f, 0.f, 0.f, std::nanf("")};
  adamw_cpu(s.arrays(), adamw_scalars(h, 2), 0, 4);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(s.vmax[i], first[i]) << "v shrank, the maximum stays";
  EXPECT_EQ(f32_as_bits(s.vmax[3]), 0x7fc00000u);
  EXPECT_EQ(f32_as_bits(s.p[3]), 0x7fc00000u);
}

// Out of place (the speculative step): reading the *_in arrays and writing the others gives the
// in-place step's bits, on every build this CPU runs, and leaves the inputs as they were.
TEST(AdamWCpu, OutOfPlaceGivesTheInPlaceBitsAndLeavesItsInputs) {
  constexpr std::size_t n = 517;
  for (bool amsgrad : {false, true}) {
    for (cpu::Isa isa : builds_here()) {
      AdamWHyper h;
      h.amsgrad = amsgrad;
      State in_place(n, 9), source(n, 9), dest(n, 1);
      for (int t = 1; t <= 2; ++t) {  // step 2: nonzero moments to read
        adamw_cpu_isa(isa, in_place.arrays(), adamw_scalars(h, t), 0, n);
      }
      adamw_cpu_isa(isa, source.arrays(), adamw_scalars(h, 1), 0, n);
      const State before = source;
      std::vector<std::uint16_t> out(n, 0), out_ref(n, 0);
      AdamWArrays a = dest.arrays();
      a.grad = source.g.data();  // (step 2's gradient: the same as step 1's here)
      a.param_in = source.p.data();
      a.exp_avg_in = source.m.data();
      a.exp_avg_sq_in = source.v.data();
      a.max_exp_avg_sq_in = source.vmax.data();
      a.param_out = out.data();
      a.out_type = ElementType::kBFloat16;
      adamw_cpu_isa(isa, a, adamw_scalars(h, 2), 0, n);
      EXPECT_EQ(dest.p, in_place.p) << "amsgrad " << amsgrad;
      EXPECT_EQ(dest.m, in_place.m);
      EXPECT_EQ(dest.v, in_place.v);
      if (amsgrad) EXPECT_EQ(dest.vmax, in_place.vmax);
      for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(out[i], f32_to_bf16_rne(in_place.p[i])) << i;
      EXPECT_EQ(source.p, before.p);
      EXPECT_EQ(source.m, before.m);
      EXPECT_EQ(source.v, before.v);
      EXPECT_EQ(source.vmax, before.vmax);
    }
  }
}

}  // namespace
}  // namespace hipferry::optim
