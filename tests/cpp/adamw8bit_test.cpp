// The fused 8-bit AdamW step on raw arrays (csrc/core/optim/adamw8bit_cpu.h): bit for bit
// the composition dequantize -> float32 step (adamw_cpu) -> quantize, over every instance;
// the baseline and AVX2 builds, thread splits at block boundaries, out of place; a NaN
// gradient; and the trajectory against the float32 step and a float64 model.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

#include "csrc/core/convert.h"
#include "csrc/core/optim/adamw8bit_cpu.h"
#include "csrc/core/optim/adamw_cpu.h"
#include "csrc/core/optim/quant8_map.h"
#include "tests/cpp/adamw_arrays.h"

namespace hipferry::optim {
namespace {

using Bytes = std::vector<std::uint8_t>;
using Floats = std::vector<float>;

// One parameter with 8-bit moments: m (signed map), v and max_v (unsigned).
struct State8 {
  std::size_t n;
  Floats p, g32, am, av, ax;
  std::vector<std::uint16_t> g16, out;
  Bytes qm, qv, qx;
  State8(std::size_t size, unsigned seed, bool fresh = false)
      : n(size),
        p(size),
        g32(size),
        am(blocks()),
        av(blocks()),
        ax(blocks()),
        g16(size),
        out(size, 0),
        qm(size),
        qv(size),
        qx(size) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> d(0.f, 1.f);
    Floats m(n), v(n), x(n);
    for (std::size_t i = 0; i < n; ++i) {
      p[i] = d(rng);
      g32[i] = d(rng) * 1e-2f;
      g16[i] = f32_to_bf16_rne(g32[i]);
      m[i] = fresh ? 0.f : d(rng) * 1e-3f;
      v[i] = fresh ? 0.f : std::fabs(d(rng)) * 1e-5f * (i % 5 == 0 ? 1e-3f : 1.f);
      x[i] = v[i] * (i % 3 == 0 ? 2.f : 1.f);
    }
    set_moments(m, v, x);
  }
  std::size_t blocks() const { return (n + 255) / 256; }
  void set_moments(const Floats& m, const Floats& v, const Floats& x) {
    const auto isa = cpu::Isa::kBaseline;
    const auto len = static_cast<std::int64_t>(n);
    quantize_blockwise8(isa, m.data(), true, qm.data(), am.data(), 0, len);
    quantize_blockwise8(isa, v.data(), false, qv.data(), av.data(), 0, len);
    quantize_blockwise8(isa, x.data(), false, qx.data(), ax.data(), 0, len);
  }
  Floats moment(int which) const {  // 0: m, 1: v, 2: max_v, dequantized
    Floats out_values(n);
    const Bytes& q = which == 0 ? qm : which == 1 ? qv : qx;
    const Floats& s = which == 0 ? am : which == 1 ? av : ax;
    dequantize_blockwise8(cpu::Isa::kBaseline, q.data(), s.data(), which == 0, out_values.data(), 0,
                          static_cast<std::int64_t>(n));
    return out_values;
  }
  AdamW8bitArrays arrays(ElementType grad_type, bool with_out) {
    AdamW8bitArrays a;
    a.param = p.data();
    a.grad = grad_type == ElementType::kFloat32 ? static_cast<const void*>(g32.data()) : g16.data();
    a.grad_type = grad_type;
    a.exp_avg = {qm.data(), am.data()};
    a.exp_avg_sq = {qv.data(), av.data()};
    a.max_exp_avg_sq = {qx.data(), ax.data()};
    a.param_out = with_out ? out.data() : nullptr;
    a.out_type = ElementType::kBFloat16;
    return a;
  }
  void read_from(AdamW8bitArrays& a, const State8& src) const {
    a.param_in = src.p.data();
    a.exp_avg_in = {src.qm.data(), src.am.data()};
    a.exp_avg_sq_in = {src.qv.data(), src.av.data()};
    a.max_exp_avg_sq_in = {src.qx.data(), src.ax.data()};
  }
};

bool same_bits(const Floats& a, const Floats& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

void expect_same(const State8& a, const State8& b, const char* what) {
  EXPECT_TRUE(same_bits(a.p, b.p)) << what << ": param";
  EXPECT_EQ(a.out, b.out) << what << ": param_out";
  EXPECT_EQ(a.qm, b.qm) << what << ": m codes";
  EXPECT_EQ(a.qv, b.qv) << what << ": v codes";
  EXPECT_TRUE(same_bits(a.am, b.am) && same_bits(a.av, b.av)) << what << ": scales";
}

AdamWScalars scalars(bool amsgrad, bool maximize, int step) {
  AdamWHyper h;
  h.lr = 1e-2;
  h.weight_decay = 0.05;
  h.amsgrad = amsgrad;
  h.maximize = maximize;
  return adamw_scalars(h, step);
}

// The fused step IS dequantize, the float32 step, quantize: one pass computing the same bits.
TEST(AdamW8bitCpu, FusedStepEqualsDequantizeFloat32StepQuantize) {
  constexpr std::size_t n = 1000;  // a short last block of 232
  for (bool amsgrad : {false, true}) {
    for (ElementType grad_type : {ElementType::kFloat32, ElementType::kBFloat16}) {
      State8 fused(n, 7), composed(n, 7);
      fused.p[5] = 0.f;
      composed.p[5] = 0.f;
      const AdamWScalars s = scalars(amsgrad, amsgrad, 3);
      adamw8bit_cpu(fused.arrays(grad_type, true), s, 0, n);
      Floats m = composed.moment(0), v = composed.moment(1), x = composed.moment(2);
      AdamWArrays f;
      f.param = composed.p.data();
      f.grad = grad_type == ElementType::kFloat32 ? static_cast<const void*>(composed.g32.data()) : composed.g16.data();
      f.grad_type = grad_type;
      f.exp_avg = m.data();
      f.exp_avg_sq = v.data();
      f.max_exp_avg_sq = x.data();
      f.param_out = composed.out.data();
      adamw_cpu(f, s, 0, n);
      composed.set_moments(m, v, x);
      expect_same(fused, composed, amsgrad ? "amsgrad" : "plain");
      if (amsgrad) EXPECT_EQ(fused.qx, composed.qx);
    }
  }
}

// From the all-zero state (what torch.zeros gives: codes 0, scales 0, dequantized exactly
// 0) the first step's parameter is the float32 step's, bit for bit.
TEST(AdamW8bitCpu, FirstStepFromZeroStateMatchesTheFloat32Step) {
  constexpr std::size_t n = 777;
  State8 q(n, 3, true);
  std::fill(q.qm.begin(), q.qm.end(), 0);  // not the code of 0, but scale 0 makes any code 0
  Floats p = q.p, m(n, 0.f), v(n, 0.f), x(n, 0.f);
  adamw8bit_cpu(q.arrays(ElementType::kFloat32, false), scalars(false, false, 1), 0, n);
  adamw_cpu(float32_arrays(p.data(), q.g32.data(), m.data(), v.data(), x.data()), scalars(false, false, 1), 0, n);
  EXPECT_TRUE(same_bits(q.p, p));
}

TEST(AdamW8bitCpu, EveryBuildGivesTheBaselineBits) {
  if (cpu::best_isa() == cpu::Isa::kBaseline) GTEST_SKIP() << "this CPU has no AVX2";
  constexpr std::size_t n = 2000;
  for (cpu::Isa isa : {cpu::Isa::kAvx2, cpu::Isa::kAvx512}) {
    if (isa > cpu::best_isa()) continue;
    for (bool amsgrad : {false, true}) {
      for (ElementType grad_type : {ElementType::kFloat32, ElementType::kBFloat16, ElementType::kFloat16}) {
        for (bool with_out : {false, true}) {
          State8 base(n, 9), wide(n, 9);
          for (int t = 1; t <= 4; ++t) {
            const AdamWScalars s = scalars(amsgrad, !amsgrad, t);
            adamw8bit_cpu_isa(cpu::Isa::kBaseline, base.arrays(grad_type, with_out), s, 0, n);
            adamw8bit_cpu_isa(isa, wide.arrays(grad_type, with_out), s, 0, n);
          }
          expect_same(base, wide, cpu::isa_name(isa));
          EXPECT_EQ(base.qx, wide.qx);
        }
      }
    }
  }
}

TEST(AdamW8bitCpu, PiecesAtBlockBoundariesGiveTheSameBitsAsOneCall) {
  constexpr std::size_t n = 256 * 5 + 77;
  State8 whole(n, 13), pieces(n, 13);
  for (int t = 1; t <= 3; ++t) {
    const AdamWScalars s = scalars(true, false, t);
    adamw8bit_cpu(whole.arrays(ElementType::kFloat32, true), s, 0, n);
    const std::int64_t cuts[] = {0, 256, 768, 1024, static_cast<std::int64_t>(n)};
    for (int k = 0; k + 1 < 5; ++k) adamw8bit_cpu(pieces.arrays(ElementType::kFloat32, true), s, cuts[k], cuts[k + 1]);
  }
  expect_same(whole, pieces, "pieces");
  EXPECT_THROW(adamw8bit_cpu(whole.arrays(ElementType::kFloat32, false), scalars(false, false, 1), 100, 512),
               std::invalid_argument);
}

TEST(AdamW8bitCpu, OutOfPlaceEqualsInPlaceAndLeavesItsInputs) {
  constexpr std::size_t n = 1500;
  for (bool amsgrad : {false, true}) {
    State8 in_place(n, 21), source(n, 21), target(n, 99);
    const State8 before = source;
    const AdamWScalars s = scalars(amsgrad, false, 2);
    adamw8bit_cpu(in_place.arrays(ElementType::kBFloat16, true), s, 0, n);
    AdamW8bitArrays a = target.arrays(ElementType::kBFloat16, true);
    a.grad = source.g16.data();
    target.read_from(a, source);
    adamw8bit_cpu(a, s, 0, n);
    expect_same(in_place, target, "out of place");
    if (amsgrad) EXPECT_EQ(in_place.qx, target.qx);
    expect_same(source, before, "the inputs");
  }
}

// The 8-bit moments against the float32 step's, from the zero state with the same gradients:
// both see the same g, so the difference is only the roundings to 8 bits, each at most half
// the table's widest gap times its block's scale, decaying by beta each step:
//   E_t <= beta * E_(t-1) + h * scale_t   (h: 0.00703 signed, 0.00352 unsigned).
// That bound is checked per block and step (plus float32 rounding slack).
TEST(AdamW8bitCpu, MomentsStayWithinTheDecayedRoundingsOfTheFloat32Step) {
  constexpr std::size_t n = 2000;
  State8 q(n, 17, true);
  Floats p = q.p, m(n, 0.f), v(n, 0.f), x(n, 0.f);
  auto half_gap = [](const float* code) {
    double widest = 0;
    for (int i = 0; i + 1 < q8::kCodes; ++i) widest = std::max(widest, static_cast<double>(code[i + 1] - code[i]));
    return widest / 2;
  };
  const double h_m = half_gap(q8::quant8_map(true).code), h_v = half_gap(q8::quant8_map(false).code);
  EXPECT_NEAR(h_m, 0.00703, 1e-5);
  EXPECT_NEAR(h_v, 0.00352, 1e-5);
  std::vector<double> bound_m(q.blocks(), 0.0), bound_v(q.blocks(), 0.0);
  std::mt19937 rng(8);
  std::normal_distribution<float> d(0.f, 1.f);
  for (int t = 1; t <= 20; ++t) {
    for (std::size_t i = 0; i < n; ++i) q.g32[i] = d(rng) * static_cast<float>(1 + i % 13);
    const AdamWScalars s = scalars(false, false, t);
    adamw8bit_cpu(q.arrays(ElementType::kFloat32, false), s, 0, n);
    adamw_cpu(float32_arrays(p.data(), q.g32.data(), m.data(), v.data(), x.data()), s, 0, n);
    const Floats m8 = q.moment(0), v8 = q.moment(1);
    for (std::size_t b = 0; b < q.blocks(); ++b) {
      bound_m[b] = 0.9 * bound_m[b] + h_m * q.am[b];
      bound_v[b] = 0.999 * bound_v[b] + h_v * q.av[b];
      for (std::size_t i = b * 256; i < std::min(n, b * 256 + 256); ++i) {
        ASSERT_LE(std::fabs(m8[i] - m[i]), bound_m[b] * (1 + 1e-5) + 1e-6 * std::fabs(m[i])) << t << " " << i;
        ASSERT_LE(std::fabs(v8[i] - v[i]), bound_v[b] * (1 + 1e-5) + 1e-6 * std::fabs(v[i])) << t << " " << i;
      }
    }
  }
}

// A NaN gradient makes its element's parameter NaN (as the float32 step does) and, through
// the shared scale, every moment of its block (quant8.h); other blocks are untouched.
TEST(AdamW8bitCpu, NanGradientPoisonsOnlyItsBlock) {
  constexpr std::size_t n = 768;
  State8 q(n, 4), clean(n, 4);
  q.g32[300] = NAN;
  adamw8bit_cpu(q.arrays(ElementType::kFloat32, false), scalars(false, false, 1), 0, n);
  adamw8bit_cpu(clean.arrays(ElementType::kFloat32, false), scalars(false, false, 1), 0, n);
  EXPECT_TRUE(std::isnan(q.p[300]));
  EXPECT_TRUE(std::isnan(q.am[1]) && std::isnan(q.av[1]));
  const Floats m = q.moment(0);
  for (std::size_t i = 256; i < 512; ++i) ASSERT_TRUE(std::isnan(m[i])) << i;
  for (std::size_t i : {0, 255, 512, 767}) {
    EXPECT_EQ(q.p[i], clean.p[i]) << i;
    EXPECT_EQ(q.qm[i], clean.qm[i]) << i;
  }
}

}  // namespace
}  // namespace hipferry::optim
