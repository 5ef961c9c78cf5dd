// The body of the 8-bit AdamW loop's VBMI build (adamw8bit_cpu.cpp picks it where the CPU
// has AVX-512 VBMI): the table reads and the quantizer of quant8_vbmi.h, in registers,
// around the element code's update. Internal to adamw8bit_cpu.cpp.
#pragma once

#include <algorithm>
#include <cstdint>

#include "csrc/core/optim/adamw8bit_block.h"
#include "csrc/core/optim/quant8_vbmi.h"

namespace hipferry::optim::adamw8bit_detail {

#ifdef HIPFERRY_HAVE_AVX512_BUILD
// The tables the VBMI build keeps at hand.
struct VbmiTables {
  q8::vbmi::Reader read_m, read_v;
  q8::vbmi::Quantizer quantize_m, quantize_v;
};

// The codes of the block's new moments, m, v (and max_v) taken in turns 64 elements at a
// time (in turns they ran faster than one state after the other), the rest of a short last
// block through the out-of-line quantizer; zero and non-finite blocks take the code of 0.
template <bool kAmsgrad>
HIPFERRY_VBMI_INLINE inline void quantize_block_vbmi(const VbmiTables& t, const BlockMoments& moments,
                                                     const q8::Normalizer (&n)[3], std::uint8_t* const (&codes)[3],
                                                     int count) {
  constexpr int kStates = kAmsgrad ? 3 : 2;
  const float* x[3] = {moments.m, moments.v, moments.max_v};
  int j = 0;
  for (; j + q8::vbmi::kVector <= count; j += q8::vbmi::kVector) {
    q8::vbmi::quantize64<true>(t.quantize_m, x[0] + j, n[0], codes[0] + j);
    q8::vbmi::quantize64<false>(t.quantize_v, x[1] + j, n[1], codes[1] + j);
    if constexpr (kAmsgrad) q8::vbmi::quantize64<false>(t.quantize_v, x[2] + j, n[2], codes[2] + j);
  }
  if (j == count) return;  // (a call here costs the spills of every live register)
  for (int k = 0; k < kStates; ++k) q8::quantize_vbmi(q8::quant8_map(k == 0), x[k] + j, n[k], codes[k] + j, count - j);
}

// The body of the VBMI build: the table reads and the quantizer inlined around the
// element code's update (inlined, they measured faster than calls per block; run two
// blocks at once, the update of one between the quantizer's pieces of the other, it was
// slower still: the loop is bound by how many instructions it issues, not by the divider).
template <class Grad, class Out, bool kAmsgrad, int kWriteOut, bool kFrom>
HIPFERRY_VBMI_INLINE inline void adamw8bit_body_vbmi(const AdamW8bitArrays& a, const AdamWScalars& s,
                                                     std::int64_t begin, std::int64_t end) {
  constexpr int kVector = q8::vbmi::kVector;
  const q8::Quant8Map& map_m = q8::quant8_map(true);
  const q8::Quant8Map& map_v = q8::quant8_map(false);
  const VbmiTables t{q8::vbmi::reader(map_m), q8::vbmi::reader(map_v), q8::vbmi::quantizer(map_m),
                     q8::vbmi::quantizer(map_v)};
  const InputCodes in = input_codes<kFrom>(a);
  BlockMoments moments;
  for (std::int64_t first = begin; first < end; first += kBlock) {
    const std::int64_t block = first / kBlock;
    const int count = static_cast<int>(std::min<std::int64_t>(kBlock, end - first));
    prefetch_block<Grad, kAmsgrad, kFrom>(a, first + kPrefetchAhead * kBlock, end);
    int j = 0;
    for (; j + kVector <= count; j += kVector) {
      q8::vbmi::read64(t.read_m, in.m + first + j, moments.m + j);
      q8::vbmi::read64(t.read_v, in.v + first + j, moments.v + j);
      if constexpr (kAmsgrad) q8::vbmi::read64(t.read_v, in.max_v + first + j, moments.max_v + j);
    }
    if (j < count) {  // a short last block's tail
      q8::read_codes_vbmi(map_m, in.m + first + j, moments.m + j, count - j);
      q8::read_codes_vbmi(map_v, in.v + first + j, moments.v + j, count - j);
      if constexpr (kAmsgrad) q8::read_codes_vbmi(map_v, in.max_v + first + j, moments.max_v + j, count - j);
    }
    moments.max_bits_m = moments.max_bits_v = moments.max_bits_max_v = 0;
    update_range<Grad, Out, kAmsgrad, kWriteOut, kFrom>(a, s, block, 0, count, moments);
    const Quant8Array* arrays[3] = {&a.exp_avg, &a.exp_avg_sq, &a.max_exp_avg_sq};
    const std::uint32_t max_bits[3] = {moments.max_bits_m, moments.max_bits_v, moments.max_bits_max_v};
    float scale[3];
    q8::Normalizer n[3];
    std::uint8_t* codes[3];
    for (int k = 0; k < (kAmsgrad ? 3 : 2); ++k) {
      scale[k] = q8::block_scale(max_bits[k]);
      n[k] = q8::normalizer(scale[k]);
      codes[k] = arrays[k]->codes + first;
    }
    quantize_block_vbmi<kAmsgrad>(t, moments, n, codes, count);
    for (int k = 0; k < (kAmsgrad ? 3 : 2); ++k) {
      if (!q8::scale_divides(scale[k])) std::fill(codes[k], codes[k] + count, q8::quant8_map(k == 0).zero_code);
      arrays[k]->absmax[block] = scale[k];  // only now: the update read the old scale
    }
  }
}
#endif

}  // namespace hipferry::optim::adamw8bit_detail
