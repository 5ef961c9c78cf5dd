// The code tables of the 8-bit optimizer state (quant8.h) and the CPU's fast quantizer.
//
// dynamic_map(is_signed) is bitsandbytes' create_dynamic_map(signed=is_signed) (defaults
// max_exponent_bits=7, total_bits=8), the "dynamic tree" data type of Dettmers (2016):
// for each decade k = 0..6 the midpoints of an evenly spaced grid over [0.1, 1] scaled by
// 10^(k-6), (negated too when signed), plus 0 and 1, sorted. Signed: 127 negative
// entries, 0 (index 127), 127 positive entries and 1.0; the unsigned map has 0 at index 0.
// The same float32 operations as bitsandbytes' Python, so the tables are bit-identical:
//   torch.linspace(0.1, 1, n)  -- as torch computes it on every AVX2 CPU: start + step * i
//                                 (end - step * (n - 1 - i) for the upper half) with ONE
//                                 rounding (its vectorized kernel fuses the multiply-add;
//                                 done here exactly in double). With ATEN_CPU_CAPABILITY
//                                 =default torch rounds twice and bitsandbytes' own tables
//                                 differ from these in the last bit of some entries.
//   (b[:-1] + b[1:]) / 2, then float(10^(k-6)) * mean, all in float32.
//
// Quant8Map adds the decision thresholds (quant8.h's threshold_above_midpoint) and, for
// the CPU loops, a lookup table indexed by the top 16 bits of y (sign, exponent, 7 mantissa
// bits: a bucket). A bucket holds at most one threshold, and a threshold has its bucket's
// top 16 bits, so an entry packs the code below the bucket with the low 16 bits of that
// threshold: one table read and one integer comparison give y's code. Both facts are
// checked when the map is built, which makes quantize_lut(y) == code_search(y) for every y
// but NaN (never asked: see quant8.h).
#pragma once

#include <array>
#include <cstdint>

#include "csrc/core/optim/quant8.h"

namespace hipferry::optim::q8 {

// bitsandbytes' create_dynamic_map(signed=is_signed), entry for entry.
std::array<float, kCodes> dynamic_map(bool is_signed);

// Buckets of |y| in [2^-24, 2): 8 exponent and the top 7 mantissa bits; magnitudes below
// 2^-24 share bucket 0 (every map rounds them to its code of 0: its smallest threshold is
// above 1e-7), and 1.0 and up share the last.
constexpr std::int32_t kLutFirst = 103 << 7;  // (biased exponent of 2^-24) << 7
constexpr std::int32_t kLutSpan = 24 << 7;    // buckets above bucket 0, per sign
constexpr std::int32_t kLutSize = 2 * (kLutSpan + 1);
// A lookup entry: (code below the bucket) << kLutCodeShift | (the low 16 bits of its
// threshold, in y's order: lut_order), or kLutNoThreshold in the low bits.
constexpr int kLutCodeShift = 17;
constexpr std::uint32_t kLutNoThreshold = 0x10000u;  // above every 16-bit order value

struct Quant8Map {
  float code[kCodes];          // ascending: dynamic_map(is_signed)
  float threshold[kCodes];     // [i] between code[i] and code[i+1]; [255] is NaN (never <= y)
  std::int32_t lut[kLutSize];  // packed entries, see kLutCodeShift
  std::uint8_t zero_code;      // the index of 0.0 in code
  bool is_signed;
};

// Built on first use and checked (std::logic_error if the lookup could disagree with the search).
const Quant8Map& quant8_map(bool is_signed);

// y's bucket, ascending in y: negative y below positive, -0 just below +0. Branch-free.
inline std::int32_t lut_key(std::uint32_t y_bits) {
  const std::int32_t e = static_cast<std::int32_t>((y_bits & 0x7fffffffu) >> 16) - kLutFirst;
  const std::int32_t b = e < 0 ? 0 : (e > kLutSpan ? kLutSpan : e);
  return (y_bits >> 31) != 0 ? kLutSpan - b : kLutSpan + 1 + b;
}

// The low 16 bits of y, ascending in y among floats of one bucket (a negative float's
// magnitude bits run the other way).
inline std::uint32_t lut_order(std::uint32_t y_bits) { return (y_bits ^ (0u - (y_bits >> 31))) & 0xffffu; }

// y's code from its bucket's entry and lut_order(y's bits).
inline int lut_code(std::int32_t entry, std::uint32_t order) {
  const auto e = static_cast<std::uint32_t>(entry);
  return static_cast<int>((e >> kLutCodeShift) + (order >= (e & ((1u << kLutCodeShift) - 1)) ? 1u : 0u));
}

// code_search(y, threshold) for every y but NaN, in one table read.
inline int quantize_lut(float y, const std::int32_t* lut) {
  const std::uint32_t u = f32_as_bits(y);
  return lut_code(lut[lut_key(u)], lut_order(u));
}

}  // namespace hipferry::optim::q8
