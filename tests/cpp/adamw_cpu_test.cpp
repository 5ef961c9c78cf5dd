// The fused AdamW step on raw arrays: against a double-precision model of
// torch.optim.AdamW, in pieces vs whole, mixed precision, amsgrad, maximize.
// (The comparison with torch itself, step by step, is in tests/python.)
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "convert.h"
#include "optim/adamw_cpu.h"

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
  AdamWArrays arrays() {
    AdamWArrays a;
    a.param = p.data();
    a.grad = g.data();
    a.exp_avg = m.data();
    a.exp_avg_sq = v.data();
    a.max_exp_avg_sq = vmax.data();
    return a;
  }
};

// torch.optim.AdamW's formulas in double: what float32 must stay close to.
struct Reference {
  double p, m = 0, v = 0, vmax = 0;
  void step(double g, const AdamWHyper& h, int t) {
    if (h.maximize) g = -g;
    p *= 1 - h.lr * h.weight_decay;
    m = m + (1 - h.beta1) * (g - m);
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

TEST(AdamWCpu, AmsgradKeepsTheRunningMaximumAndNaNPropagates) {
  AdamWHyper h;
  h.amsgrad = true;
  State s(4, 1);
  s.g = {1.f, 1.f, 1.f, 1.f};
  adamw_cpu(s.arrays(), adamw_scalars(h, 1), 0, 4);
  const std::vector<float> first = s.vmax;
  s.g = {0.f, 0.f, 0.f, std::nanf("")};
  adamw_cpu(s.arrays(), adamw_scalars(h, 2), 0, 4);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(s.vmax[i], first[i]) << "v shrank, the maximum stays";
  EXPECT_TRUE(std::isnan(s.vmax[3]));
  EXPECT_TRUE(std::isnan(s.p[3]));
}

}  // namespace
}  // namespace hipferry::optim
