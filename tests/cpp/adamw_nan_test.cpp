// NaN in, one NaN out (Note [one NaN] in csrc/core/optim/adamw_update.h): with
// NaNs of both signs, quiet and signalling, with assorted payloads, and
// infinities (which make NaNs out of numbers: inf - inf, inf / inf) in every
// array the step reads, every build of the loop this CPU runs gives the
// baseline build's bits, NaNs included, and every NaN it writes is 0x7fc00000
// (param_out: that NaN rounded, bfloat16 0x7fc0, float16 0x7e00).
// The GPU kernel against the CPU loop on the same inputs: adamw_kernel_test.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "csrc/core/convert.h"
#include "csrc/core/cpu/cpu_isa.h"
#include "csrc/core/optim/adamw_cpu.h"
#include "tests/cpp/adamw_arrays.h"

namespace hipferry::optim {
namespace {

constexpr std::uint32_t kSpecialF32[] = {
    0x7fc00000, 0xffc00000, 0x7fc00001, 0xffffffff, 0x7fd23456, 0xffe00000,  // quiet NaNs
    0x7f800001, 0xff800123, 0x7fbfffff, 0xffa00000,                          // signalling NaNs
    0x7f800000, 0xff800000, 0x00000000, 0x80000000, 0x00000001};             // +-inf, +-0, a subnormal
constexpr std::uint16_t kSpecialBF16[] = {0x7fc0, 0xffc0, 0x7fc1, 0xffff, 0x7f81, 0xffa0,
                                          0x7f80, 0xff80, 0x0000, 0x8000, 0x0001};
constexpr std::uint16_t kSpecialF16[] = {0x7e00, 0xfe00, 0x7e01, 0xffff, 0x7c01, 0xfd00,
                                         0x7c00, 0xfc00, 0x0000, 0x8000, 0x0001};

template <class T, std::size_t N>
T pick(const T (&table)[N], std::mt19937& rng) {
  return table[rng() % N];
}

bool is_nan_bits(std::uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u; }

// One step's inputs and outputs: about a quarter of every input array special.
struct NanCase {
  std::size_t n;
  std::vector<float> p, m, v, vmax, p_in, m_in, v_in, vmax_in;
  std::vector<std::uint32_t> g32;
  std::vector<std::uint16_t> g16, out;

  NanCase(std::size_t size, unsigned seed, ElementType grad_type) : n(size), out(size, 0) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> d(0.f, 1.f);
    const auto value = [&](float scale) {
      float f = d(rng) * scale;
      if (rng() % 4 == 0) f = f32_from_bits(pick(kSpecialF32, rng));
      return f;
    };
    for (auto* a : {&p, &m, &v, &vmax, &p_in, &m_in, &v_in, &vmax_in}) a->resize(n);
    g32.resize(n);
    g16.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      p[i] = p_in[i] = value(1.f);
      m[i] = m_in[i] = value(1e-2f);
      v[i] = v_in[i] = std::abs(value(1e-4f));  // (abs keeps a NaN's payload, clears its sign)
      if (rng() % 8 == 0) v[i] = v_in[i] = f32_from_bits(pick(kSpecialF32, rng));  // NaNs of both signs in v too
      vmax[i] = vmax_in[i] = v[i] * 2;
      if (rng() % 8 == 0) vmax[i] = vmax_in[i] = f32_from_bits(pick(kSpecialF32, rng));
      g32[i] = f32_as_bits(value(1e-2f));
      const bool special = rng() % 4 == 0;
      g16[i] = grad_type == ElementType::kBFloat16
                   ? (special ? pick(kSpecialBF16, rng) : f32_to_bf16_rne(d(rng) * 1e-2f))
                   : (special ? pick(kSpecialF16, rng) : f32_to_f16_rne(d(rng) * 1e-2f));
    }
  }

  AdamWArrays arrays(ElementType grad_type, bool out_of_place) {
    AdamWArrays a;
    a.param = p.data();
    a.exp_avg = m.data();
    a.exp_avg_sq = v.data();
    a.max_exp_avg_sq = vmax.data();
    a.grad = grad_type == ElementType::kFloat32 ? static_cast<const void*>(g32.data()) : g16.data();
    a.grad_type = grad_type;
    if (grad_type != ElementType::kFloat32) {
      a.param_out = out.data();
      a.out_type = grad_type;
    }
    if (out_of_place) {
      a.param_in = p_in.data();
      a.exp_avg_in = m_in.data();
      a.exp_avg_sq_in = v_in.data();
      a.max_exp_avg_sq_in = vmax_in.data();
    }
    return a;
  }
};

std::vector<cpu::Isa> builds_here() {
  std::vector<cpu::Isa> out;
  for (cpu::Isa isa : {cpu::Isa::kBaseline, cpu::Isa::kAvx2, cpu::Isa::kAvx512}) {
    if (isa <= cpu::best_isa()) out.push_back(isa);
  }
  return out;
}

void expect_same_bits(const std::vector<float>& a, const std::vector<float>& b, const char* what) {
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4)) << what;
}

// Every NaN written is the canonical one; returns how many there were.
std::size_t expect_canonical_nans(const NanCase& c, ElementType out_type, bool amsgrad) {
  std::size_t nans = 0;
  for (const auto* a : {&c.p, &c.m, &c.v, &c.vmax}) {
    if (a == &c.vmax && !amsgrad) continue;
    for (float f : *a) {
      const std::uint32_t u = f32_as_bits(f);
      if (!is_nan_bits(u)) continue;
      ++nans;
      EXPECT_EQ(u, 0x7fc00000u);
    }
  }
  if (out_type != ElementType::kFloat32) {
    const std::uint16_t want = out_type == ElementType::kBFloat16 ? 0x7fc0 : 0x7e00;
    for (std::size_t i = 0; i < c.n; ++i) {
      if (is_nan_bits(f32_as_bits(c.p[i]))) {
        EXPECT_EQ(c.out[i], want) << i;
      }
    }
  }
  return nans;
}

TEST(AdamWNaN, EveryBuildWritesTheBaselineBitsAndOneCanonicalNaN) {
  constexpr std::size_t n = 4099;  // a remainder after the 8- and 16-wide bodies
  unsigned seed = 1;
  for (ElementType grad_type : {ElementType::kFloat32, ElementType::kBFloat16, ElementType::kFloat16}) {
    for (bool amsgrad : {false, true}) {
      for (bool maximize : {false, true}) {
        for (bool out_of_place : {false, true}) {
          AdamWHyper h;
          h.amsgrad = amsgrad;
          h.maximize = maximize;
          h.weight_decay = maximize ? 0.0 : 0.05;
          ++seed;
          NanCase base(n, seed, grad_type);
          adamw_cpu_isa(cpu::Isa::kBaseline, base.arrays(grad_type, out_of_place), adamw_scalars(h, 3), 0, n);
          EXPECT_GT(expect_canonical_nans(base, grad_type, amsgrad), n / 8) << "the inputs make NaNs";
          for (cpu::Isa isa : builds_here()) {
            NanCase other(n, seed, grad_type);
            adamw_cpu_isa(isa, other.arrays(grad_type, out_of_place), adamw_scalars(h, 3), 0, n);
            const std::string what = std::string(cpu::isa_name(isa)) + " " + element_type_name(grad_type) +
                                     (amsgrad ? " amsgrad" : "") + (maximize ? " maximize" : "") +
                                     (out_of_place ? " out of place" : "");
            expect_same_bits(other.p, base.p, what.c_str());
            expect_same_bits(other.m, base.m, what.c_str());
            expect_same_bits(other.v, base.v, what.c_str());
            expect_same_bits(other.vmax, base.vmax, what.c_str());
            EXPECT_EQ(other.out, base.out) << what;
            expect_canonical_nans(other, grad_type, amsgrad);
          }
        }
      }
    }
  }
}

// The case that split the builds before NaNs were canonical: v and the gradient both NaN, with
// different payloads and signs (x86 keeps one operand's payload; the builds ordered them differently).
TEST(AdamWNaN, NaNGradientMeetingNaNMomentGivesTheCanonicalNaN) {
  constexpr std::size_t n = 64;
  std::vector<float> p(n, 1.f), m(n, 0.f), v(n), vmax(n, 0.f);
  std::vector<std::uint32_t> g(n);
  for (std::size_t i = 0; i < n; ++i) {
    v[i] = f32_from_bits(0x7fc00000u | static_cast<std::uint32_t>(i * 977));
    g[i] = 0xffc00000u | static_cast<std::uint32_t>(i * 131 + 1);
  }
  for (cpu::Isa isa : builds_here()) {
    std::vector<float> pp = p, mm = m, vv = v, mx = vmax;
    const AdamWArrays a = float32_arrays(pp.data(), g.data(), mm.data(), vv.data(), mx.data());
    adamw_cpu_isa(isa, a, adamw_scalars(AdamWHyper{}, 1), 0, n);
    for (std::size_t i = 0; i < n; ++i) {
      ASSERT_EQ(f32_as_bits(pp[i]), 0x7fc00000u) << cpu::isa_name(isa) << " " << i;
      ASSERT_EQ(f32_as_bits(mm[i]), 0x7fc00000u) << cpu::isa_name(isa) << " " << i;
      ASSERT_EQ(f32_as_bits(vv[i]), 0x7fc00000u) << cpu::isa_name(isa) << " " << i;
    }
  }
}

}  // namespace
}  // namespace hipferry::optim
