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
// The body of the VBMI build: per block, one call reads the codes' table entries, the
// element code's update runs in this build (AVX-512), one call quantizes the new moments.
// Inlining the vector pieces here instead measured about the same (1.60 against 1.80 ns an
// element at 10 M, 1.42 against 1.38 in cache) and compiled once per element type: minutes
// in the sanitizer build. Running two blocks at once, the update of one between the
// quantizer's pieces of the other, was slower (1.54 ns in cache): the loop is bound by the
// instructions it issues, not by the divider.
template <class Grad, class Out, bool kAmsgrad, int kWriteOut, bool kFrom>
[[gnu::always_inline]] inline void adamw8bit_body_vbmi(const AdamW8bitArrays& a, const AdamWScalars& s,
                                                       std::int64_t begin, std::int64_t end) {
  constexpr int kStates = kAmsgrad ? 3 : 2;
  const InputCodes in = input_codes<kFrom>(a);
  const Quant8Array* arrays[3] = {&a.exp_avg, &a.exp_avg_sq, &a.max_exp_avg_sq};
  BlockMoments moments;
  for (std::int64_t first = begin; first < end; first += kBlock) {
    const std::int64_t block = first / kBlock;
    const int count = static_cast<int>(std::min<std::int64_t>(kBlock, end - first));
    prefetch_block<Grad, kAmsgrad, kFrom>(a, first + kPrefetchAhead * kBlock, end);
    q8::read_moments_vbmi({in.m + first, in.v + first, kAmsgrad ? in.max_v + first : nullptr},
                          {moments.m, moments.v, moments.max_v}, kStates, count);
    moments.max_bits_m = moments.max_bits_v = moments.max_bits_max_v = 0;
    update_range<Grad, Out, kAmsgrad, kWriteOut, kFrom>(a, s, block, 0, count, moments);
    const std::uint32_t max_bits[3] = {moments.max_bits_m, moments.max_bits_v, moments.max_bits_max_v};
    float scale[3] = {};
    q8::Normalizer n[3] = {};
    std::uint8_t* codes[3] = {};
    for (int k = 0; k < kStates; ++k) {
      scale[k] = q8::block_scale(max_bits[k]);
      n[k] = q8::normalizer(scale[k]);
      codes[k] = arrays[k]->codes + first;
    }
    q8::quantize_moments_vbmi({moments.m, moments.v, moments.max_v}, n, codes, kStates, count);
    for (int k = 0; k < kStates; ++k) {
      if (!q8::scale_divides(scale[k])) std::fill(codes[k], codes[k] + count, q8::quant8_map(k == 0).zero_code);
      arrays[k]->absmax[block] = scale[k];  // only now: the update read the old scale
    }
  }
}
#endif

}  // namespace hipferry::optim::adamw8bit_detail
