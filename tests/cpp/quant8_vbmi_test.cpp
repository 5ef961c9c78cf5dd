// The in-register quantizer and table reads (csrc/core/optim/quant8_vbmi.h) and the
// arithmetic guess they start from (quant8_map.h's estimate_code): the guess is the code or
// the one below it, and the vector quantizer gives code_search's code, for thresholds,
// their neighbours, exact ties, every scale's normalizer, odd counts and non-finite input.
// The builds of the whole step are compared in adamw8bit_test; Quant8Exhaustive runs every
// float of [-1, 1] through the vector quantizer (label `exhaustive`).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "csrc/core/optim/quant8_vbmi.h"

namespace hipferry::optim::q8 {
namespace {

std::vector<float> probes(const Quant8Map& m) {
  std::vector<float> ys = {0.0f,   -0.0f,   1.0f,   -1.0f,  std::nextafter(1.0f, 2.0f), -std::nextafter(1.0f, 2.0f),
                           1e-45f, -1e-45f, 1e-30f, -1e-30f};
  for (int i = 0; i + 1 < kCodes; ++i) {
    for (float t : {m.threshold[i], m.code[i]}) {
      ys.insert(ys.end(), {t, std::nextafter(t, -INFINITY), std::nextafter(t, INFINITY), -t});
    }
  }
  for (int r = 0; r < kRegions; ++r) {
    const float e = m.region_end[r];
    if (std::isfinite(e)) ys.insert(ys.end(), {e, std::nextafter(e, 0.0f), -e, -std::nextafter(e, 0.0f)});
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f), expo(-27.0f, 0.0f);
  for (int k = 0; k < 20000; ++k) {
    ys.push_back(uni(rng));
    ys.push_back((k % 2 ? -1.0f : 1.0f) * std::exp2(expo(rng)));
  }
  return ys;
}

void expect_guess(const Quant8Map& m, float y) {
  const int guess = estimate_code(y, m), code = code_search(y, m.threshold);
  ASSERT_TRUE(guess == code || guess == code - 1) << y << ": guess " << guess << ", code " << code;
}

TEST(Quant8Estimate, GuessIsTheCodeOrOneBelow) {
  for (bool is_signed : {true, false}) {
    const Quant8Map& m = quant8_map(is_signed);
    for (float y : probes(m)) expect_guess(m, y);
    for (std::uint32_t bits = 0; bits <= 0x3f800001u; bits += 4099) {
      expect_guess(m, f32_from_bits(bits));
      expect_guess(m, -f32_from_bits(bits));
    }
  }
}

// The guess alone is wrong about half the time on the signed map's negative side (it errs
// low by design); the threshold comparison is what makes the code exact.
TEST(Quant8Estimate, GuessNeedsTheComparison) {
  const Quant8Map& m = quant8_map(true);
  int low = 0;
  for (float y : probes(m)) low += estimate_code(y, m) != code_search(y, m.threshold);
  EXPECT_GT(low, 1000);
}

class Quant8Vbmi : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!vbmi_available()) GTEST_SKIP() << "this CPU (or build) has no AVX-512 VBMI";
  }
};

TEST_F(Quant8Vbmi, ReadsEveryEntryBitForBit) {
  std::mt19937 rng(1);
  for (bool is_signed : {true, false}) {
    const Quant8Map& m = quant8_map(is_signed);
    for (int count : {0, 1, 63, 64, 65, 256, 256 + 37}) {
      std::vector<std::uint8_t> codes(static_cast<std::size_t>(count));
      for (int j = 0; j < count; ++j) codes[j] = static_cast<std::uint8_t>(j < 256 ? 255 - j : rng());
      std::vector<float> out(codes.size() + 1, -7.0f);
      read_codes_vbmi(m, codes.data(), out.data(), count);
      for (int j = 0; j < count; ++j) ASSERT_EQ(f32_as_bits(out[j]), f32_as_bits(m.code[codes[j]])) << j;
      EXPECT_EQ(out[codes.size()], -7.0f) << "nothing written past count";
    }
  }
}

void expect_quantize(const Quant8Map& m, const std::vector<float>& x, Normalizer n) {
  const int count = static_cast<int>(x.size());
  std::vector<std::uint8_t> codes(x.size() + 1, 0xEE);
  quantize_vbmi(m, x.data(), n, codes.data(), count);
  for (int j = 0; j < count; ++j) {
    ASSERT_EQ(codes[j], code_search(normalize(x[j], n), m.threshold)) << x[j] << " * " << n.pre << " * " << n.inverse;
  }
  EXPECT_EQ(codes[x.size()], 0xEE) << "nothing written past count";
}

TEST_F(Quant8Vbmi, QuantizesLikeTheSearch) {
  for (bool is_signed : {true, false}) {
    const Quant8Map& m = quant8_map(is_signed);
    std::vector<float> y = probes(m);
    y.resize(y.size() / 64 * 64 + 29);  // a tail the vector loop leaves to the lookup table
    expect_quantize(m, y, normalizer(1.0f));
    // Scales whose normalizer rescales first (quant8.h): x = y * scale.
    for (float scale : {1e-44f, 0x1p-70f, 3e-30f, 0.37f, 3e38f, 0x1p100f}) {
      std::vector<float> x(y.size());
      for (std::size_t i = 0; i < y.size(); ++i) x[i] = static_cast<float>(static_cast<double>(y[i]) * scale);
      expect_quantize(m, x, normalizer(scale));
    }
  }
}

// A block with a NaN or an infinity is quantized like any other and its codes replaced
// (quant8.h): the vector code must only stay within its tables (the sanitizer build checks).
TEST_F(Quant8Vbmi, NonFiniteInputGivesSomeCode) {
  std::vector<float> x(128, 0.5f);
  x[3] = NAN;
  x[70] = INFINITY;
  x[71] = -INFINITY;
  x[72] = 3e38f;
  std::vector<std::uint8_t> codes(x.size());
  quantize_vbmi(quant8_map(true), x.data(), normalizer(1.0f), codes.data(), 128);
  EXPECT_EQ(codes[0], code_search(0.5f, quant8_map(true).threshold));
}

// Every float of [-(1 + 2^-23), 1 + 2^-23], through the vector quantizer, 64 at a time.
TEST(Quant8Exhaustive, VbmiQuantizesEveryFloatLikeTheLookupTable) {
  if (!vbmi_available()) GTEST_SKIP() << "this CPU (or build) has no AVX-512 VBMI";
  constexpr std::uint32_t kTop = 0x3f800001u, kBatch = 1u << 16;
  std::vector<float> x(kBatch);
  std::vector<std::uint8_t> codes(kBatch);
  for (bool is_signed : {true, false}) {
    const Quant8Map& m = quant8_map(is_signed);
    for (std::uint32_t sign : {0u, 0x80000000u}) {
      for (std::uint32_t first = 0; first <= kTop; first += kBatch) {
        const std::uint32_t count = std::min(kBatch, kTop + 1 - first);
        for (std::uint32_t j = 0; j < count; ++j) x[j] = f32_from_bits((first + j) | sign);
        quantize_vbmi(m, x.data(), normalizer(1.0f), codes.data(), static_cast<int>(count));
        for (std::uint32_t j = 0; j < count; ++j) {
          ASSERT_EQ(codes[j], quantize_lut(x[j], m.lut)) << x[j];
        }
      }
    }
  }
}

}  // namespace
}  // namespace hipferry::optim::q8
