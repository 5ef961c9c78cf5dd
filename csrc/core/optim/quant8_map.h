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
//
// For the in-register quantizer (quant8_vbmi.h) the map also keeps each table's bytes as
// four planes and the constants of estimate_code, an arithmetic guess at y's code.
#pragma once

#include <array>
#include <cmath>
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

// Regions of |y| for estimate_code: 0 below the map's smallest nonzero entry (its
// threshold with 0), 1..7 the decades of entries, 8 the entry 1.0; padded to 16 (a register).
constexpr int kRegions = 9;
constexpr int kRegionSlots = 16;
constexpr int kBinadeSlots = 32;  // |y|'s biased exponent - 103, clamped at 0 (2^-24 and below: slot 0)

struct Quant8Map {
  float code[kCodes];          // ascending: dynamic_map(is_signed)
  float threshold[kCodes];     // [i] between code[i] and code[i+1]; [255] is NaN (never <= y)
  std::int32_t lut[kLutSize];  // packed entries, see kLutCodeShift
  std::uint8_t zero_code;      // the index of 0.0 in code
  bool is_signed;
  // Byte b of code[i] and threshold[i] at [b][i]: 64-byte rows for byte-table instructions.
  alignas(64) std::uint8_t code_planes[4][kCodes];
  alignas(64) std::uint8_t threshold_planes[4][kCodes];
  // estimate_code's constants, by region (slots past kRegions repeat the last region).
  alignas(64) std::int32_t region_of_binade[kBinadeSlots];  // the region where the binade starts
  alignas(64) float region_end[kRegionSlots];               // |y| from which the next region starts
  alignas(64) float estimate_scale[kRegionSlots];
  alignas(64) float estimate_offset[kRegionSlots];
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

// A guess at code_search(y, map.threshold) from arithmetic alone: that code or the one below
// it, for every finite |y| <= 1 + 2^-23 (what a quantizer asks), so one comparison with
// threshold[guess] finishes the search. |y|'s region is a decade [0.1, 1) * 10^(d-6) of
// entries, or below them, or 1.0 and up: the region where its binade starts, and one
// comparison for the rest (a binade spans at most one region boundary). In a decade the
// entries sit at the centres of an even grid, so w = |y| * scale - offset is |y|'s place
// in entries, shifted down by half an entry: the guess errs low, never high. Negative y
// count down from the mirrored entry (the signed map is symmetric but for 1.0; the
// unsigned map's code of any y < 0 is 0). The guess is monotone in y between region
// boundaries, so checking it at every threshold and boundary, and the floats beside them,
// proves it for every y; quant8_map does that when it builds the map. The vector code
// (quant8_vbmi.cpp) does these operations lane for lane.
inline int estimate_code(float y, const Quant8Map& map) {
  const std::uint32_t bits = f32_as_bits(y);
  const std::uint32_t abs_bits = bits & 0x7fffffffu;
  const float a = f32_from_bits(abs_bits);
  std::int32_t binade = static_cast<std::int32_t>(abs_bits >> 23) - 103;
  binade = binade < 0 ? 0 : binade;
  std::int32_t r = map.region_of_binade[binade & (kBinadeSlots - 1)];
  r += a >= map.region_end[r & (kRegionSlots - 1)] ? 1 : 0;
  r &= kRegionSlots - 1;
  const float w = a * map.estimate_scale[r] - map.estimate_offset[r];
  if ((bits >> 31) == 0) return static_cast<int>(std::floor(w));
  if (!map.is_signed) return 0;
  const int mirrored = 254 - static_cast<int>(std::ceil(w));
  return mirrored < 0 ? 0 : mirrored;  // past the signed map's last negative entry
}

// code_search(y, threshold) for every y but NaN, in one table read.
inline int quantize_lut(float y, const std::int32_t* lut) {
  const std::uint32_t u = f32_as_bits(y);
  return lut_code(lut[lut_key(u)], lut_order(u));
}

}  // namespace hipferry::optim::q8
