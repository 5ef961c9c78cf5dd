// What every build of the 8-bit AdamW loop (adamw8bit_cpu.cpp) does to one block of 256:
// the element code's update over the block, with its new largest magnitudes, and the
// prefetches ahead of it. Internal to that file.
#pragma once

#include <cstdint>

#include "csrc/core/optim/adamw8bit_cpu.h"
#include "csrc/core/optim/quant8.h"

namespace hipferry::optim::adamw8bit_detail {

using q8::kBlock;
// What a loop does with param_out (kWriteOut), as in adamw_cpu.cpp.
constexpr int kNoOut = 0, kWrite = 1, kAdoptAndWrite = 2;

// One block's moments: the table entries of the old codes, then the new values, and the
// new values' largest magnitudes.
struct BlockMoments {
  alignas(64) float m[kBlock];
  alignas(64) float v[kBlock];
  alignas(64) float max_v[kBlock];
  std::uint32_t max_bits_m = 0, max_bits_v = 0, max_bits_max_v = 0;
};

// kFrom: out of place (the *_in arrays are read, apart from every array written).
// `moments` holds the old codes' table entries on entry and the new moments on return.
template <class Grad, class Out, bool kAmsgrad, int kWriteOut, bool kFrom>
[[gnu::always_inline]] inline void update_block(const AdamW8bitArrays& a, const AdamWScalars& s, std::int64_t block,
                                                int count, BlockMoments& moments) {
  const std::int64_t first = block * kBlock;
  float* __restrict param = a.param;
  const float* __restrict param_in = a.param_in;
  const auto* __restrict grad = static_cast<const typename Grad::storage*>(a.grad);
  auto* __restrict out = static_cast<typename Out::storage*>(a.param_out);
  const float scale_m = (kFrom ? a.exp_avg_in.absmax : a.exp_avg.absmax)[block];
  const float scale_v = (kFrom ? a.exp_avg_sq_in.absmax : a.exp_avg_sq.absmax)[block];
  const float scale_x = kAmsgrad ? (kFrom ? a.max_exp_avg_sq_in.absmax : a.max_exp_avg_sq.absmax)[block] : 0.0f;
  float* __restrict m_buf = moments.m;
  float* __restrict v_buf = moments.v;
  float* __restrict x_buf = moments.max_v;
  const AdamWScalars sc = s;  // a local copy: stores cannot alias it (adamw_cpu.cpp)
  std::uint32_t bm = 0, bv = 0, bx = 0;
#pragma omp simd reduction(max : bm, bv, bx)
  for (int j = 0; j < count; ++j) {
    const std::int64_t i = first + j;
    float p = kFrom ? param_in[i] : param[i];
    if constexpr (kWriteOut == kAdoptAndWrite) p = adopt_written<Out>(p, out[i]);
    float m, v, x;
    q8::adamw8bit_element<kAmsgrad>(p, to_f32<Grad>(grad[i]), m_buf[j], scale_m, v_buf[j], scale_v,
                                    kAmsgrad ? x_buf[j] : 0.0f, scale_x, m, v, x, sc);
    param[i] = p;
    if constexpr (kWriteOut) out[i] = from_f32<Out>(p);
    m_buf[j] = m;
    v_buf[j] = v;
    bm = q8::max_u32(bm, q8::abs_bits(m));
    bv = q8::max_u32(bv, q8::abs_bits(v));
    if constexpr (kAmsgrad) {
      x_buf[j] = x;
      bx = q8::max_u32(bx, q8::abs_bits(x));
    }
  }
  moments.max_bits_m = bm;
  moments.max_bits_v = bv;
  moments.max_bits_max_v = bx;
}

// The codes a step reads: the *_in arrays out of place (kFrom), else the arrays it writes.
struct InputCodes {
  const std::uint8_t* m;
  const std::uint8_t* v;
  const std::uint8_t* max_v;
};

template <bool kFrom>
[[gnu::always_inline]] inline InputCodes input_codes(const AdamW8bitArrays& a) {
  if constexpr (kFrom) return {a.exp_avg_in.codes, a.exp_avg_sq_in.codes, a.max_exp_avg_sq_in.codes};
  return {a.exp_avg.codes, a.exp_avg_sq.codes, a.max_exp_avg_sq.codes};
}

// Blocks ahead whose inputs are asked for before they are needed: a block's loops take
// their streams (codes, then param and grad) in turns, with gaps the hardware prefetcher
// does not bridge; asking 4 blocks ahead took the step from 3.1 to 2.8 ns an element here.
constexpr std::int64_t kPrefetchAhead = 4;

template <class Grad, bool kAmsgrad, bool kFrom>
[[gnu::always_inline]] inline void prefetch_block(const AdamW8bitArrays& a, std::int64_t first, std::int64_t end) {
  if (first >= end) return;
  constexpr auto kGradBytes = static_cast<std::int64_t>(sizeof(typename Grad::storage));
  const char* grad = static_cast<const char*>(a.grad) + first * kGradBytes;
  const char* param = reinterpret_cast<const char*>((kFrom ? a.param_in : a.param) + first);
  const InputCodes in = input_codes<kFrom>(a);
  const std::uint8_t* qm = in.m + first;
  const std::uint8_t* qv = in.v + first;
  const std::uint8_t* qx = kAmsgrad ? in.max_v + first : nullptr;
  for (int line = 0; line < kBlock * 4; line += 64) {
    __builtin_prefetch(param + line);
    if (line < kBlock * kGradBytes) __builtin_prefetch(grad + line);
  }
  for (int line = 0; line < kBlock; line += 64) {
    __builtin_prefetch(qm + line);
    __builtin_prefetch(qv + line);
    if constexpr (kAmsgrad) __builtin_prefetch(qx + line);
  }
}

}  // namespace hipferry::optim::adamw8bit_detail
