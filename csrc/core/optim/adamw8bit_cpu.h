// The AdamW step with 8-bit blockwise moments (quant8.h) on the CPU over raw pointers
// (torch-free; the torch layer splits a tensor over threads at block boundaries,
// GoogleTest calls it directly), and the plain blockwise quantizer and dequantizer (state
// conversion, tests).
//
// One fused pass per block of 256: dequantize m, v (and max_v) with the block's old
// scales, run adamw_update on each element (the float32 step's arithmetic), write the
// float32 parameter (and param_out), take the new scales (the largest |m|, |v|, |max_v| of
// the block) and quantize the new moments against them. The parameter sees the moments
// before they are rounded to 8 bits, as in bitsandbytes.
#pragma once

#include <cstdint>

#include "csrc/core/cpu/cpu_isa.h"
#include "csrc/core/element_type.h"
#include "csrc/core/optim/adamw_update.h"
#include "csrc/core/optim/quant8.h"

namespace hipferry::optim {

// One 8-bit state array: n codes and ceil(n / 256) scales (block b covers elements
// [256 b, 256 b + 256)).
struct Quant8Array {
  std::uint8_t* codes = nullptr;
  float* absmax = nullptr;
};
struct Quant8Input {
  const std::uint8_t* codes = nullptr;
  const float* absmax = nullptr;
};

// One parameter's flat state, element 0 of each array.
struct AdamW8bitArrays {
  float* param = nullptr;      // float32 parameter or master copy
  const void* grad = nullptr;  // the gradient, in grad_type
  ElementType grad_type = ElementType::kFloat32;
  Quant8Array exp_avg;         // m: the signed dynamic map
  Quant8Array exp_avg_sq;      // v: the unsigned dynamic map
  Quant8Array max_exp_avg_sq;  // amsgrad only (unsigned map), else unused
  void* param_out = nullptr;   // also write the updated value here in out_type (nullptr: don't)
  ElementType out_type = ElementType::kBFloat16;
  bool adopt_out = false;  // param_out is the parameter itself: AdamWArrays::adopt_out
  // Out of place (AdamWArrays' *_in, the speculative step): read these, write the arrays
  // above, leave these untouched. All null: in place. Set: param_in, exp_avg_in and
  // exp_avg_sq_in (and max_exp_avg_sq_in with amsgrad), none overlapping an array written.
  const float* param_in = nullptr;
  Quant8Input exp_avg_in;
  Quant8Input exp_avg_sq_in;
  Quant8Input max_exp_avg_sq_in;
};

// Updates elements [begin, end): `begin` a multiple of 256 (q8::kBlock), `end` one too or
// the array's end (the last block's scale is taken over [begin of block, end) only, so a
// short end is only right for the array's last block). Throws std::invalid_argument for a
// misaligned begin. The AVX2 build runs where the CPU has it unless HIPFERRY_CPU_ISA says
// otherwise.
void adamw8bit_cpu(const AdamW8bitArrays& a, const AdamWScalars& s, std::int64_t begin, std::int64_t end);

// The same with the build chosen by the caller (<= cpu::best_isa()); every build gives the
// same bits.
void adamw8bit_cpu_isa(cpu::Isa isa, const AdamW8bitArrays& a, const AdamWScalars& s, std::int64_t begin,
                       std::int64_t end);

// x[begin, end) -> codes and scales (same block rules as above), with the signed or the
// unsigned map. The inverse: out = code[q] * scale.
void quantize_blockwise8(cpu::Isa isa, const float* x, bool is_signed, std::uint8_t* codes, float* absmax,
                         std::int64_t begin, std::int64_t end);
void dequantize_blockwise8(cpu::Isa isa, const std::uint8_t* codes, const float* absmax, bool is_signed, float* out,
                           std::int64_t begin, std::int64_t end);

}  // namespace hipferry::optim
