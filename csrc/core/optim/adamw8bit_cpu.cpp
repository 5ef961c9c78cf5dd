#include "csrc/core/optim/adamw8bit_cpu.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "csrc/core/dispatch.h"
#include "csrc/core/optim/adamw8bit_block.h"
#include "csrc/core/optim/quant8_map.h"
#include "csrc/core/optim/quant8_vbmi.h"

// Baseline and AVX2 builds of one always-inline body, and a VBMI build, picked at run time
// as in adamw_cpu.cpp (same reasons). A block of 256 goes through short loops over local
// buffers, table reads apart from the vectorized arithmetic (quant8.h's element code):
// read the codes' table entries; dequantize + update + the new scales
// (adamw8bit_block.h); the lookup keys of the new values; the lookup; the codes. Each loop
// sits in its own function, so the codes a block reads first and writes last (in place)
// are never reached through two __restrict pointers in one scope. The VBMI build
// (kVbmi) reads the tables and quantizes in registers instead; the AVX-512 CPUs without
// VBMI run the AVX2 build. Every build gives the same bits: table reads are
// reads, and both quantizers find code_search's code.

namespace hipferry::optim {
namespace {

using adamw8bit_detail::BlockMoments;
using adamw8bit_detail::InputCodes;
using adamw8bit_detail::kAdoptAndWrite;
using adamw8bit_detail::kNoOut;
using adamw8bit_detail::kWrite;
using q8::kBlock;

// out[k][j] = table[k][index[k][j]] for j < count, k < kTables, interleaved so that more
// reads are in flight. A plain scalar loop in both builds: on the Zen 4 this was measured
// on, scalar loads took 0.28 ns an element, AVX2 gathers 0.37 ns and GCC's vectorized
// form of a table read (eight extracts and inserts) 0.42 ns; and kept out of the
// arithmetic's loops, the reads let those run 8 wide (GCC ran them 4 wide around them).
template <int kTables, class T, class I>
[[gnu::always_inline]] inline void lookup(const T* const (&table)[kTables], const I* const (&index)[kTables],
                                          T* const (&out)[kTables], int count) {
  for (int j = 0; j < count; ++j) {
    for (int k = 0; k < kTables; ++k) out[k][j] = table[k][index[k][j]];
  }
}

template <int kStates>
[[gnu::always_inline]] inline void lookup_keys(const float* const (&x)[kStates], const q8::Normalizer (&n)[kStates],
                                               int count, std::int32_t (&key)[kStates][kBlock],
                                               std::uint32_t (&order)[kStates][kBlock]) {
#pragma omp simd
  for (int j = 0; j < count; ++j) {
    for (int k = 0; k < kStates; ++k) {
      const std::uint32_t u = f32_as_bits(q8::normalize(x[k][j], n[k]));
      key[k][j] = q8::lut_key(u);
      order[k][j] = q8::lut_order(u);
    }
  }
}

template <int kStates>
[[gnu::always_inline]] inline void codes_from_entries(const std::int32_t (&entry)[kStates][kBlock],
                                                      const std::uint32_t (&order)[kStates][kBlock], int count,
                                                      std::uint8_t* const (&codes)[kStates]) {
#pragma omp simd
  for (int j = 0; j < count; ++j) {
    for (int k = 0; k < kStates; ++k) codes[k][j] = static_cast<std::uint8_t>(q8::lut_code(entry[k][j], order[k][j]));
  }
}

// The codes of kStates blocks through the lookup table of quant8_map.h, one element at a time.
template <int kStates>
[[gnu::always_inline]] inline void lookup_quantize(const float* const (&x)[kStates], const q8::Normalizer (&n)[kStates],
                                                   const q8::Quant8Map* const (&map)[kStates], int count,
                                                   std::uint8_t* const (&codes)[kStates]) {
  alignas(64) std::int32_t key[kStates][kBlock];
  alignas(64) std::uint32_t order[kStates][kBlock];
  alignas(64) std::int32_t entry[kStates][kBlock];
  lookup_keys<kStates>(x, n, count, key, order);
  const std::int32_t* luts[kStates];
  const std::int32_t* keys[kStates];
  std::int32_t* entries[kStates];
  for (int k = 0; k < kStates; ++k) {
    luts[k] = map[k]->lut;
    keys[k] = key[k];
    entries[k] = entry[k];
  }
  lookup<kStates>(luts, keys, entries, count);
  codes_from_entries<kStates>(entry, order, count, codes);
}

// Quantizes kStates blocks of `count` values at once (m, v and max_v of one block: their
// loops interleave, which keeps more table reads in flight), x[k] with largest abs_bits
// max_bits[k]; returns the scales in scale[k] (quant8.h's rules for zero and non-finite
// blocks: their codes are computed like any other, from a y that is NaN or infinite and
// still finds a table entry, then overwritten with the code of 0).
template <int kStates, bool kVbmi>
[[gnu::always_inline]] inline void quantize_blocks(const float* const (&x)[kStates],
                                                   const std::uint32_t (&max_bits)[kStates],
                                                   const q8::Quant8Map* const (&map)[kStates], int count,
                                                   std::uint8_t* const (&codes)[kStates], float (&scale)[kStates]) {
  q8::Normalizer n[kStates];
  for (int k = 0; k < kStates; ++k) {
    scale[k] = q8::block_scale(max_bits[k]);
    n[k] = q8::normalizer(scale[k]);
  }
  if constexpr (kVbmi && kStates == 1) {
    q8::quantize_vbmi(*map[0], x[0], n[0], codes[0], count);
  } else if constexpr (kVbmi) {  // a block's moments: m, v (and max_v), the maps in that order
    const float* xs[3] = {};
    q8::Normalizer ns[3] = {};
    std::uint8_t* out[3] = {};
    for (int k = 0; k < kStates; ++k) {
      xs[k] = x[k];
      ns[k] = n[k];
      out[k] = codes[k];
    }
    q8::quantize_moments_vbmi(xs, ns, out, kStates, count);
  } else {
    lookup_quantize<kStates>(x, n, map, count, codes);
  }
  for (int k = 0; k < kStates; ++k) {
    if (!q8::scale_divides(scale[k])) std::fill(codes[k], codes[k] + count, map[k]->zero_code);
  }
}

// kVbmi: the VBMI build, whose table reads and quantizer run in registers, one call a block
// each (quant8_vbmi.h). Measured and left out (one thread, the loop alone): the vector
// pieces inlined here, 1.58 against 1.61 ns an element at 10 M, but compiled once per
// element type (the sanitizer build took 3.7 minutes over this file); two blocks at once,
// the update of one between the quantizer's pieces of the other, 1.54 against 1.42 ns an
// element in cache: the loop is bound by the instructions it issues, not by the divider.
template <class Grad, class Out, bool kAmsgrad, int kWriteOut, bool kFrom, bool kVbmi>
[[gnu::always_inline]] inline void adamw8bit_body(const AdamW8bitArrays& a, const AdamWScalars& s, std::int64_t begin,
                                                  std::int64_t end) {
  const q8::Quant8Map& map_m = q8::quant8_map(true);
  const q8::Quant8Map& map_v = q8::quant8_map(false);
  const InputCodes in = adamw8bit_detail::input_codes<kFrom>(a);
  BlockMoments moments;
  for (std::int64_t first = begin; first < end; first += kBlock) {
    const std::int64_t block = first / kBlock;
    const int count = static_cast<int>(std::min<std::int64_t>(kBlock, end - first));
    adamw8bit_detail::prefetch_block<Grad, kAmsgrad, kFrom>(a, first + adamw8bit_detail::kPrefetchAhead * kBlock, end);
    if constexpr (kVbmi) {
      q8::read_moments_vbmi({in.m + first, in.v + first, kAmsgrad ? in.max_v + first : nullptr},
                            {moments.m, moments.v, moments.max_v}, kAmsgrad ? 3 : 2, count);
    } else if constexpr (kAmsgrad) {
      lookup<3>({map_m.code, map_v.code, map_v.code}, {in.m + first, in.v + first, in.max_v + first},
                {moments.m, moments.v, moments.max_v}, count);
    } else {
      lookup<2>({map_m.code, map_v.code}, {in.m + first, in.v + first}, {moments.m, moments.v}, count);
    }
    adamw8bit_detail::update_block<Grad, Out, kAmsgrad, kWriteOut, kFrom>(a, s, block, count, moments);
    if constexpr (kAmsgrad) {
      float scale[3];
      quantize_blocks<3, kVbmi>(
          {moments.m, moments.v, moments.max_v}, {moments.max_bits_m, moments.max_bits_v, moments.max_bits_max_v},
          {&map_m, &map_v, &map_v}, count,
          {a.exp_avg.codes + first, a.exp_avg_sq.codes + first, a.max_exp_avg_sq.codes + first}, scale);
      a.max_exp_avg_sq.absmax[block] = scale[2];
      a.exp_avg.absmax[block] = scale[0];
      a.exp_avg_sq.absmax[block] = scale[1];
    } else {
      float scale[2];
      quantize_blocks<2, kVbmi>({moments.m, moments.v}, {moments.max_bits_m, moments.max_bits_v}, {&map_m, &map_v},
                                count, {a.exp_avg.codes + first, a.exp_avg_sq.codes + first}, scale);
      a.exp_avg.absmax[block] = scale[0];
      a.exp_avg_sq.absmax[block] = scale[1];
    }
  }
}

#ifdef HIPFERRY_HAVE_AVX2_BUILD
template <class Grad, class Out, bool kAmsgrad, int kWriteOut, bool kFrom>
HIPFERRY_AVX2_TARGET void adamw8bit_loop_avx2(const AdamW8bitArrays& a, const AdamWScalars& s, std::int64_t begin,
                                              std::int64_t end) {
  adamw8bit_body<Grad, Out, kAmsgrad, kWriteOut, kFrom, false>(a, s, begin, end);
}
template <class Grad, class Out, bool kAmsgrad, int kWriteOut, bool kFrom>
HIPFERRY_AVX512_TARGET void adamw8bit_loop_vbmi(const AdamW8bitArrays& a, const AdamWScalars& s, std::int64_t begin,
                                                std::int64_t end) {
  adamw8bit_body<Grad, Out, kAmsgrad, kWriteOut, kFrom, true>(a, s, begin, end);
}
#endif

template <class Grad, class Out, bool kAmsgrad, int kWriteOut, bool kFrom>
void adamw8bit_loop(cpu::Isa isa, const AdamW8bitArrays& a, const AdamWScalars& s, std::int64_t begin,
                    std::int64_t end) {
#ifdef HIPFERRY_HAVE_AVX2_BUILD
  // An AVX-512 CPU without VBMI (Skylake-X, Cascade Lake) runs the AVX2 build: with its table
  // reads one at a time, an AVX-512 build measured 1.9x slower on a Zen 4.
  if (isa >= cpu::Isa::kAvx512 && q8::vbmi_available()) {
    return adamw8bit_loop_vbmi<Grad, Out, kAmsgrad, kWriteOut, kFrom>(a, s, begin, end);
  }
  if (isa >= cpu::Isa::kAvx2) return adamw8bit_loop_avx2<Grad, Out, kAmsgrad, kWriteOut, kFrom>(a, s, begin, end);
#endif
  (void)isa;
  adamw8bit_body<Grad, Out, kAmsgrad, kWriteOut, kFrom, false>(a, s, begin, end);
}

template <class Grad, class Out, bool kFrom>
void adamw8bit_pick_from(cpu::Isa isa, const AdamW8bitArrays& a, const AdamWScalars& s, std::int64_t begin,
                         std::int64_t end) {
  const int out = a.param_out == nullptr ? kNoOut : (!kFrom && a.adopt_out) ? kAdoptAndWrite : kWrite;
  if (s.amsgrad) {
    out == kWrite   ? adamw8bit_loop<Grad, Out, true, kWrite, kFrom>(isa, a, s, begin, end)
    : out == kNoOut ? adamw8bit_loop<Grad, Out, true, kNoOut, kFrom>(isa, a, s, begin, end)
                    : adamw8bit_loop<Grad, Out, true, kFrom ? kWrite : kAdoptAndWrite, kFrom>(isa, a, s, begin, end);
  } else {
    out == kWrite   ? adamw8bit_loop<Grad, Out, false, kWrite, kFrom>(isa, a, s, begin, end)
    : out == kNoOut ? adamw8bit_loop<Grad, Out, false, kNoOut, kFrom>(isa, a, s, begin, end)
                    : adamw8bit_loop<Grad, Out, false, kFrom ? kWrite : kAdoptAndWrite, kFrom>(isa, a, s, begin, end);
  }
}

// The standalone quantizer and dequantizer, block by block, each a pass that run_pass runs
// in the build the CPU and `isa` allow.
struct QuantizePass {
  const float* x;
  const q8::Quant8Map& map;
  std::uint8_t* codes;
  float* absmax;

  template <bool kVbmi>
  [[gnu::always_inline]] void run(std::int64_t begin, std::int64_t end) const {
    for (std::int64_t first = begin; first < end; first += kBlock) {
      const int count = static_cast<int>(std::min<std::int64_t>(kBlock, end - first));
      const float* __restrict xb = x + first;
      std::uint32_t bits = 0;
#pragma omp simd reduction(max : bits)
      for (int j = 0; j < count; ++j) bits = q8::max_u32(bits, q8::abs_bits(xb[j]));
      float scale[1];
      quantize_blocks<1, kVbmi>({xb}, {bits}, {&map}, count, {codes + first}, scale);
      absmax[first / kBlock] = scale[0];
    }
  }
};

struct DequantizePass {
  const std::uint8_t* codes;
  const float* absmax;
  const q8::Quant8Map& map;
  float* out;

  template <bool kVbmi>
  [[gnu::always_inline]] void run(std::int64_t begin, std::int64_t end) const {
    for (std::int64_t first = begin; first < end; first += kBlock) {
      const int count = static_cast<int>(std::min<std::int64_t>(kBlock, end - first));
      float* __restrict values = out + first;
      if constexpr (kVbmi) {
        q8::read_codes_vbmi(map, codes + first, values, count);
      } else {
        lookup<1>({map.code}, {codes + first}, {values}, count);
      }
      const float scale = absmax[first / kBlock];
#pragma omp simd
      for (int j = 0; j < count; ++j) values[j] = q8::dequantize(values[j], scale);
    }
  }
};

#ifdef HIPFERRY_HAVE_AVX2_BUILD
template <class Pass>
HIPFERRY_AVX2_TARGET void run_avx2(const Pass& pass, std::int64_t begin, std::int64_t end) {
  pass.template run<false>(begin, end);
}
template <class Pass>
HIPFERRY_AVX512_TARGET void run_vbmi(const Pass& pass, std::int64_t begin, std::int64_t end) {
  pass.template run<true>(begin, end);
}
#endif

template <class Pass>
void run_pass(cpu::Isa isa, const Pass& pass, std::int64_t begin, std::int64_t end) {
#ifdef HIPFERRY_HAVE_AVX2_BUILD
  if (isa >= cpu::Isa::kAvx512 && q8::vbmi_available()) return run_vbmi(pass, begin, end);
  if (isa >= cpu::Isa::kAvx2) return run_avx2(pass, begin, end);
#endif
  (void)isa;
  pass.template run<false>(begin, end);
}

void check_block_start(const char* what, std::int64_t begin) {
  if (begin % kBlock != 0) {
    throw std::invalid_argument(std::string("hipferry: ") + what + " begins at element " + std::to_string(begin) +
                                ", not a multiple of the block size 256");
  }
}

}  // namespace

void adamw8bit_cpu_isa(cpu::Isa isa, const AdamW8bitArrays& a, const AdamWScalars& s, std::int64_t begin,
                       std::int64_t end) {
  check_block_start("adamw8bit_cpu", begin);
  if (begin >= end) return;
  dispatch_element_pair(a.grad_type, a.out_type, [&](auto grad_tag, auto out_tag) {
    using G = decltype(grad_tag);
    using O = decltype(out_tag);
    a.param_in != nullptr ? adamw8bit_pick_from<G, O, true>(isa, a, s, begin, end)
                          : adamw8bit_pick_from<G, O, false>(isa, a, s, begin, end);
  });
}

void adamw8bit_cpu(const AdamW8bitArrays& a, const AdamWScalars& s, std::int64_t begin, std::int64_t end) {
  adamw8bit_cpu_isa(cpu::active_isa(), a, s, begin, end);
}

void quantize_blockwise8(cpu::Isa isa, const float* x, bool is_signed, std::uint8_t* codes, float* absmax,
                         std::int64_t begin, std::int64_t end) {
  check_block_start("quantize_blockwise8", begin);
  run_pass(isa, QuantizePass{x, q8::quant8_map(is_signed), codes, absmax}, begin, end);
}

void dequantize_blockwise8(cpu::Isa isa, const std::uint8_t* codes, const float* absmax, bool is_signed, float* out,
                           std::int64_t begin, std::int64_t end) {
  check_block_start("dequantize_blockwise8", begin);
  run_pass(isa, DequantizePass{codes, absmax, q8::quant8_map(is_signed), out}, begin, end);
}

}  // namespace hipferry::optim
