// 8-bit blockwise optimizer state (bitsandbytes' 8-bit blockwise Adam, Dettmers et al.
// 2022), the element code written once (design principle 1): the CPU loop
// (adamw8bit_cpu.cpp, every ISA build) and the GPU kernel (hip/adamw8bit_kernel.hip) call
// these functions, so they agree bit for bit.
//
// A state array of n floats is stored as n uint8 codes and ceil(n / 256) float32 scales:
// element i belongs to block i / 256 (blocks are contiguous; the last may be short).
//   dequantize: x = code[q] * scale            (code: a sorted 256-entry table, quant8_map.h)
//   quantize:   scale = max |x| over the block (exact and order-independent: a max of bits)
//               q = the index of the table entry nearest to y = x * (1 / scale): the
//                   reciprocal rounded once per block, then one rounded product per element,
//                   as bitsandbytes' GPU kernels normalize (a vector division costs ten
//                   times a product's throughput on the CPU). Scales below 2^-64 or from
//                   2^64 up are first multiplied, with x, by 2^64 or 2^-64 (exact, or below
//                   every code's reach), so the reciprocal neither overflows nor goes
//                   subnormal.
//                   y may exceed 1 by an ulp; it still takes the code of 1. A y exactly
//                   between two entries takes the LOWER index (bitsandbytes' CPU quantizer
//                   keeps the left neighbour on a tie, too).
// Special blocks, decided from the scale alone so every element of a block goes one way:
//   scale == 0 (all elements +-0): every code is the table's code of 0 and the scale is 0;
//     dequantize gives exactly +0.
//   a NaN or an infinity in the block: the scale is stored as NaN and every code as the code
//     of 0, so every element of that block dequantizes to NaN on the next read (0 * NaN).
//     One non-finite state element poisons its block of 256, not just itself: the price of
//     a shared scale. Nothing reads out of bounds: the quantizer only sees finite y with
//     |y| <= 1 + 2^-23 (|x| <= scale), and clamps whatever it is given to the table.
// The quantizer here is a branch-free binary search over the 255 decision thresholds (the
// GPU's; the tables live in shared memory there). The CPU loops find the same index with a
// lookup table and one comparison (quant8_map.h), or, with AVX-512 VBMI, with an arithmetic
// guess and one comparison with the threshold above it (quant8_vbmi.h); each is equal to
// the search by construction, checked when the table is built. All of them decide by
// comparisons of floats: no rounding can differ.
#pragma once

#include <cstdint>

#include "csrc/core/convert.h"
#include "csrc/core/host_device.h"
#include "csrc/core/optim/adamw_update.h"

namespace hipferry::optim::q8 {

constexpr int kBlock = 256;  // elements per scale
constexpr int kCodes = 256;  // entries of a code table
constexpr std::uint32_t kInfBits = 0x7f800000u;
constexpr std::uint32_t kNanBits = 0x7fc00000u;

// The blocks (and so the scales) of an array of n elements: ceil(n / 256).
HIPFERRY_HD constexpr std::int64_t block_count(std::int64_t n) { return (n + kBlock - 1) / kBlock; }

// |x|'s bits: ordered like |x| as unsigned integers (+inf above every finite value, NaN
// above +inf), so the block's largest magnitude is an integer max: exact, any order.
HIPFERRY_HD std::uint32_t abs_bits(float x) { return f32_as_bits(x) & 0x7fffffffu; }

HIPFERRY_HD std::uint32_t max_u32(std::uint32_t a, std::uint32_t b) { return a > b ? a : b; }

// The stored scale of a block whose largest abs_bits is `max_abs_bits`: that magnitude,
// or a NaN when it is not finite (see the header comment): +inf becomes kNanBits, a NaN
// stays a (quiet) NaN. Integer arithmetic instead of a compare and select: Clang stops
// vectorizing the max reduction that feeds a select (adding 2^23 carries into bit 31
// exactly when the magnitude is inf or NaN; bit 22 is then the quiet bit).
HIPFERRY_HD float block_scale(std::uint32_t max_abs_bits) {
  return f32_from_bits(max_abs_bits | (((max_abs_bits + 0x00800000u) >> 31) << 22));
}

// Whether the block's codes come from x / scale (a finite, nonzero scale) rather than
// all being the code of 0.
HIPFERRY_HD bool scale_divides(float scale) {
  const std::uint32_t b = f32_as_bits(scale);
  return b != 0 && b < kInfBits;
}

// The next float above a finite f (+0 and -0 go to the smallest subnormal).
HIPFERRY_HD float next_up(float f) {
  const std::uint32_t b = f32_as_bits(f);
  if ((b & 0x7fffffffu) == 0) return f32_from_bits(1u);
  return f32_from_bits(b >> 31 ? b - 1 : b + 1);
}

// The decision threshold between neighbouring table entries lo < hi: the smallest float
// strictly above their exact midpoint, so y >= threshold exactly when y is nearer to hi
// (a tie stays with lo). The midpoint is exact in double: the sum of two floats of nearby
// exponents (every pair of neighbours in the dynamic maps) needs far fewer than 53 bits.
HIPFERRY_HD float threshold_above_midpoint(float lo, float hi) {
  const double mid = (static_cast<double>(lo) + static_cast<double>(hi)) * 0.5;
  const float f = static_cast<float>(mid);
  return static_cast<double>(f) > mid ? f : next_up(f);
}

// The code of y: how many of threshold[0..254] (ascending) are <= y. Eight probes, no
// branch. 0 for NaN (never asked: y is finite).
HIPFERRY_HD int code_search(float y, const float* threshold) {
  int i = 0;
  for (int step = kCodes / 2; step > 0; step >>= 1) i += threshold[i + step - 1] <= y ? step : 0;
  return i;
}

// How a block of scale `scale` normalizes: y = (x * pre) * inverse (see the header).
struct Normalizer {
  float pre;
  float inverse;
};
HIPFERRY_HD Normalizer normalizer(float scale) {
  const float pre = scale < 0x1p-64f ? 0x1p64f : (scale >= 0x1p64f ? 0x1p-64f : 1.0f);
  return {pre, 1.0f / (scale * pre)};
}
HIPFERRY_HD float normalize(float x, Normalizer n) { return (x * n.pre) * n.inverse; }

// The code of x in a block normalized by `n` (scale_divides(scale) must hold).
HIPFERRY_HD std::uint8_t quantize_search(float x, Normalizer n, const float* threshold) {
  return static_cast<std::uint8_t>(code_search(normalize(x, n), threshold));
}

// x from its code's table entry code[q] (the caller reads the table: shared memory on the
// GPU, a gather on the CPU) and its block's scale.
HIPFERRY_HD float dequantize(float code_value, float scale) { return code_value * scale; }

// One element of the 8-bit AdamW step: dequantize the moments (m with the signed map, v
// and max_v with the unsigned one) from their codes' table entries, then the float32
// update of adamw_update.h, unchanged. The new m, v, max_v come back in float; the caller
// quantizes them against the new scales of their blocks once it knows them.
template <bool kAmsgrad>
HIPFERRY_HD void adamw8bit_element(float& param, float grad, float code_m, float scale_m, float code_v, float scale_v,
                                   float code_max, float scale_max, float& m, float& v, float& max_v,
                                   const AdamWScalars& s) {
  m = dequantize(code_m, scale_m);
  v = dequantize(code_v, scale_v);
  max_v = kAmsgrad ? dequantize(code_max, scale_max) : 0.0f;
  adamw_update<kAmsgrad>(param, grad, m, v, max_v, s);
}

}  // namespace hipferry::optim::q8
