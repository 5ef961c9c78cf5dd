// The 8-bit code tables and quantizer (csrc/core/optim/quant8.h, quant8_map.h): the tables'
// shape and bits (frozen from bitsandbytes 0.50.2's create_dynamic_map under an AVX2 torch;
// tests/python/optim/test_adamw8bit_step.py compares with the live package), the thresholds
// against exact distances, the CPU's lookup table against the binary search, nearest-code
// rounding with ties to the lower code, the round-trip bound, zero, saturated and
// non-finite blocks, a short last block.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "csrc/core/optim/adamw8bit_cpu.h"
#include "csrc/core/optim/quant8_map.h"

namespace hipferry::optim::q8 {
namespace {

std::uint64_t fnv1a(const float* code) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (int i = 0; i < kCodes; ++i) {
    h ^= f32_as_bits(code[i]);
    h *= 0x100000001b3ull;
  }
  return h;
}

TEST(Quant8Map, TablesAreBitsandbytesDynamicMaps) {
  const Quant8Map& s = quant8_map(true);
  const Quant8Map& u = quant8_map(false);
  EXPECT_EQ(fnv1a(s.code), 0x690ca6ad558a2475ull);
  EXPECT_EQ(fnv1a(u.code), 0xa9aaf4b4f33a51e3ull);
  EXPECT_EQ(f32_as_bits(s.code[0]), 0xbf7e3333u);    // -0.99296875: no -1 in the signed map
  EXPECT_EQ(f32_as_bits(s.code[128]), 0x3513a3b7u);  // 5.5e-7, the smallest positive
  EXPECT_EQ(f32_as_bits(u.code[1]), 0x34ae7baau);    // 3.25e-7
  EXPECT_EQ(s.zero_code, 127);
  EXPECT_EQ(u.zero_code, 0);
  for (const Quant8Map* m : {&s, &u}) {
    EXPECT_EQ(m->code[kCodes - 1], 1.0f);
    for (int i = 0; i + 1 < kCodes; ++i) ASSERT_LT(m->code[i], m->code[i + 1]) << i;
  }
  for (int i = 0; i < 127; ++i) EXPECT_EQ(s.code[i], -s.code[254 - i]) << i;  // symmetric but for 1.0
  EXPECT_EQ(u.code[0], 0.0f);
}

// threshold[i] is the first float nearer to code[i+1] than to code[i] (exact distances in
// long double: differences of nearby floats are exact in its 64-bit significand).
TEST(Quant8Map, ThresholdsSplitNeighboursAtTheMidpointWithTiesDown) {
  for (bool is_signed : {true, false}) {
    const Quant8Map& m = quant8_map(is_signed);
    for (int i = 0; i + 1 < kCodes; ++i) {
      const long double lo = m.code[i], hi = m.code[i + 1], t = m.threshold[i];
      const long double below = std::nextafter(m.threshold[i], -INFINITY);
      EXPECT_LT(hi - t, t - lo) << i;          // t: strictly nearer to hi
      EXPECT_LE(below - lo, hi - below) << i;  // the float below: nearer to lo, or a tie
    }
    EXPECT_TRUE(std::isnan(m.threshold[kCodes - 1]));
  }
}

// The index of the nearest entry, ties to the lower index, by exhaustive comparison.
int nearest(const float* code, float y) {
  int best = 0;
  for (int k = 1; k < kCodes; ++k) {
    if (std::fabs(static_cast<long double>(y) - code[k]) < std::fabs(static_cast<long double>(y) - code[best])) {
      best = k;
    }
  }
  return best;
}

std::vector<float> probe_values(const Quant8Map& m) {
  std::vector<float> ys = {0.0f, -0.0f, 1.0f, -1.0f, 1e-30f, -1e-30f, 1e-45f, -1e-45f};
  for (int i = 0; i + 1 < kCodes; ++i) {  // each threshold, its neighbours, each code, each tie
    const float t = m.threshold[i];
    ys.insert(ys.end(), {t, std::nextafter(t, -INFINITY), std::nextafter(t, INFINITY), m.code[i]});
    const double mid = (static_cast<double>(m.code[i]) + m.code[i + 1]) / 2;
    if (static_cast<double>(static_cast<float>(mid)) == mid) ys.push_back(static_cast<float>(mid));
  }
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  std::uniform_real_distribution<float> expo(-27.0f, 0.0f);
  for (int k = 0; k < 20000; ++k) {
    ys.push_back(uni(rng));
    ys.push_back((k % 2 ? -1.0f : 1.0f) * std::exp2(expo(rng)));
  }
  return ys;
}

TEST(Quant8Map, SearchAndLookupTableFindTheNearestCodeTiesDown) {
  for (bool is_signed : {true, false}) {
    const Quant8Map& m = quant8_map(is_signed);
    int ties = 0;
    for (float y : probe_values(m)) {
      const int want = nearest(m.code, y);
      ASSERT_EQ(code_search(y, m.threshold), want) << y;
      ASSERT_EQ(quantize_lut(y, m.lut), want) << y;
      const int k = want + 1;
      if (k < kCodes && static_cast<long double>(y) - m.code[want] == m.code[k] - static_cast<long double>(y)) ++ties;
    }
    EXPECT_GT(ties, 10) << "exact ties were probed and went down";
  }
}

// Every 4099th bit pattern of [-1, 1] (about a million floats): the lookup table and the
// binary search agree everywhere (the build check makes that true; this watches it).
TEST(Quant8Map, LookupTableEqualsSearchOverASweepOfFloats) {
  for (bool is_signed : {true, false}) {
    const Quant8Map& m = quant8_map(is_signed);
    for (std::uint32_t bits = 0; bits <= 0x3f800000u; bits += 4099) {
      for (float y : {f32_from_bits(bits), -f32_from_bits(bits)}) {
        ASSERT_EQ(quantize_lut(y, m.lut), code_search(y, m.threshold)) << y;
      }
    }
  }
}

struct Quantized {
  std::vector<std::uint8_t> codes;
  std::vector<float> absmax, back;
};

Quantized round_trip(const std::vector<float>& x, bool is_signed, cpu::Isa isa = cpu::Isa::kBaseline) {
  const std::int64_t n = static_cast<std::int64_t>(x.size());
  Quantized q{std::vector<std::uint8_t>(x.size(), 0xAA), std::vector<float>((x.size() + 255) / 256, -1.0f),
              std::vector<float>(x.size(), -1.0f)};
  quantize_blockwise8(isa, x.data(), is_signed, q.codes.data(), q.absmax.data(), 0, n);
  dequantize_blockwise8(isa, q.codes.data(), q.absmax.data(), is_signed, q.back.data(), 0, n);
  return q;
}

// Each element comes back as the table entry nearest to x / scale times the scale: within
// half the gap between the two entries around x / scale, times the scale (one rounding of
// the product and one of the division on top).
TEST(Quant8Blockwise, RoundTripIsWithinHalfACodeStep) {
  std::mt19937 rng(11);
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (bool is_signed : {true, false}) {
    const Quant8Map& m = quant8_map(is_signed);
    std::vector<float> x(5000);
    for (std::size_t i = 0; i < x.size(); ++i) {
      const float mag = std::exp2(static_cast<float>(i % 40) - 30.0f) * d(rng);  // several decades per block
      x[i] = is_signed ? mag : std::fabs(mag);
    }
    const Quantized q = round_trip(x, is_signed);
    for (std::size_t i = 0; i < x.size(); ++i) {
      const float scale = q.absmax[i / 256];
      const double y = static_cast<double>(x[i]) / scale;
      const int k = q.codes[i];
      const double gap_lo = k > 0 ? m.code[k] - m.code[k - 1] : 0.0;
      const double gap_hi = k + 1 < kCodes ? m.code[k + 1] - m.code[k] : 0.0;
      ASSERT_LE(std::fabs(y - m.code[k]), std::max(gap_lo, gap_hi) / 2 * (1 + 1e-6) + 1e-7 * std::fabs(y)) << i;
      ASSERT_LE(std::fabs(q.back[i] - x[i]), (std::max(gap_lo, gap_hi) / 2 + 1e-6) * scale) << i;
    }
  }
}

TEST(Quant8Blockwise, AllZeroBlockStoresTheCodeOfZeroAndScaleZero) {
  std::vector<float> x(600, 0.0f);
  for (std::size_t i = 0; i < 256; i += 2) x[i] = -0.0f;
  x[300] = 0.5f;  // the second block is not all zero
  for (bool is_signed : {true, false}) {
    const Quantized q = round_trip(x, is_signed);
    EXPECT_EQ(q.absmax[0], 0.0f);
    EXPECT_EQ(q.absmax[2], 0.0f);
    for (int i : {0, 1, 255, 512, 599}) {
      EXPECT_EQ(q.codes[i], quant8_map(is_signed).zero_code) << i;
      EXPECT_EQ(f32_as_bits(q.back[i]), 0u) << "exactly +0 at " << i;
    }
    EXPECT_EQ(q.back[300], 0.5f);  // the block's largest value is its scale: code 1.0, exact
  }
}

TEST(Quant8Blockwise, OneHugeValueSaturatesTheScaleAndFlushesTheRest) {
  std::vector<float> x(256, 1e-3f);
  x[7] = -3e30f;
  const Quantized q = round_trip(x, true);
  EXPECT_EQ(q.absmax[0], 3e30f);
  EXPECT_EQ(q.codes[7], 0);  // nearest to -1: -0.99296875
  EXPECT_EQ(q.back[7], quant8_map(true).code[0] * 3e30f);
  for (int i : {0, 8, 255}) EXPECT_EQ(q.back[i], 0.0f) << "1e-3 / 3e30 is below every code but 0";
}

TEST(Quant8Blockwise, ANonFiniteValueTurnsItsWholeBlockIntoNan) {
  for (float bad : {NAN, INFINITY, -INFINITY}) {
    std::vector<float> x(700, 0.25f);
    x[300] = bad;
    const Quantized q = round_trip(x, true, cpu::best_isa());
    EXPECT_EQ(f32_as_bits(q.absmax[1]), kNanBits);
    for (int i = 256; i < 512; ++i) {
      ASSERT_EQ(q.codes[i], quant8_map(true).zero_code) << i;
      ASSERT_TRUE(std::isnan(q.back[i])) << i;
    }
    EXPECT_EQ(q.back[0], 0.25f);  // the other blocks keep their values
    EXPECT_EQ(q.back[699], 0.25f);
  }
}

// Subnormal and huge scales: 1 / scale would overflow or go subnormal; the normalizer
// rescales first (quant8.h), so the codes are the nearest as for any other scale, and the
// search (the GPU's) agrees with the CPU's lookup.
TEST(Quant8Blockwise, TinyAndHugeScalesQuantizeLikeAnyOther) {
  const Quant8Map& m = quant8_map(true);
  for (float scale : {1e-44f, 0x1p-70f, 3e-30f, 3e38f, 0x1p100f, 1.0f}) {
    std::vector<float> x;
    for (float f : {1.0f, -1.0f, 0.5f, -0.25f, 0.9f, 0.05f, -0.003f, 0.0f}) x.push_back(scale * f);
    x.resize(64 + x.size(), 0.0f);  // a whole vector of 64 and a tail, for the VBMI build
    for (int i = 0; i < 8; ++i) x[64 + i] = x[i];
    const Quantized q = round_trip(x, true, cpu::best_isa());
    ASSERT_EQ(q.absmax[0], scale);
    for (std::size_t i = 0; i < x.size(); ++i) {
      const float y = static_cast<float>(static_cast<long double>(x[i]) / scale);
      EXPECT_EQ(q.codes[i], nearest(m.code, y)) << scale << " " << x[i];
      EXPECT_EQ(q.codes[i], quantize_search(x[i], normalizer(scale), m.threshold)) << scale << " " << x[i];
    }
    EXPECT_EQ(q.codes[0], 255);
    EXPECT_EQ(q.codes[1], 0);
    EXPECT_EQ(q.codes[7], m.zero_code);
    EXPECT_EQ(q.codes[64], 255);
  }
}

TEST(Quant8Blockwise, ShortLastBlockTakesItsScaleOverItsOwnElements) {
  std::vector<float> x(256 * 3 + 5, 1.0f);
  for (std::size_t i = 768; i < x.size(); ++i) x[i] = 0.125f * static_cast<float>(i - 767);
  const Quantized q = round_trip(x, false);
  ASSERT_EQ(q.absmax.size(), 4u);
  EXPECT_EQ(q.absmax[3], 0.625f);
  EXPECT_EQ(q.back[772], 0.625f);
}

// The AVX-512 build reads and quantizes in registers where the CPU has VBMI (quant8_vbmi.h).
TEST(Quant8Blockwise, EveryBuildGivesTheBaselineBits) {
  if (cpu::best_isa() == cpu::Isa::kBaseline) GTEST_SKIP() << "this CPU has no AVX2";
  std::mt19937 rng(5);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> x(10001);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = d(rng) * std::exp2(static_cast<float>(i % 30) - 20.0f);
  x[600] = NAN;  // a poisoned block, and a saturated one
  x[900] = -3e30f;
  for (cpu::Isa isa : {cpu::Isa::kAvx2, cpu::Isa::kAvx512}) {
    if (isa > cpu::best_isa()) continue;
    for (bool is_signed : {true, false}) {
      const Quantized a = round_trip(x, is_signed, cpu::Isa::kBaseline);
      const Quantized b = round_trip(x, is_signed, isa);
      EXPECT_EQ(a.codes, b.codes) << cpu::isa_name(isa);
      EXPECT_EQ(std::memcmp(a.absmax.data(), b.absmax.data(), a.absmax.size() * 4), 0) << cpu::isa_name(isa);
      EXPECT_EQ(std::memcmp(a.back.data(), b.back.data(), a.back.size() * 4), 0) << cpu::isa_name(isa);
    }
  }
}

TEST(Quant8Blockwise, MisalignedBeginIsRejected) {
  std::vector<float> x(512, 1.0f);
  std::vector<std::uint8_t> codes(512);
  std::vector<float> absmax(2);
  EXPECT_THROW(quantize_blockwise8(cpu::Isa::kBaseline, x.data(), true, codes.data(), absmax.data(), 100, 512),
               std::invalid_argument);
}

}  // namespace
}  // namespace hipferry::optim::q8
