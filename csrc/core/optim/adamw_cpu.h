// The AdamW step on the CPU over raw pointers (torch-free; the ATen layer
// splits a tensor's elements over threads, GoogleTest calls it directly).
#pragma once

#include <cstdint>

#include "csrc/core/cpu/cpu_isa.h"
#include "csrc/core/element_type.h"
#include "csrc/core/optim/adamw_update.h"

namespace hipferry::optim {

// One parameter's flat state, element 0 of each array.
struct AdamWArrays {
  float* param = nullptr;      // float32 parameter or master copy, updated in place
  const void* grad = nullptr;  // the gradient, in grad_type
  ElementType grad_type = ElementType::kFloat32;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  float* max_exp_avg_sq = nullptr;  // amsgrad only (else unused, may be nullptr)
  void* param_out = nullptr;        // also write the updated value here in out_type (nullptr: don't)
  ElementType out_type = ElementType::kBFloat16;
  // param_out is the parameter itself (in place only): an element the user wrote since the last step
  // becomes the master first (adopt_written, Note [a write the master does not see]).
  bool adopt_out = false;
  // Out of place (the speculative step of OffloadAdamW(overlap="backward")): read the parameter
  // and the state from these and write the arrays above, leaving these untouched. All null: in
  // place. Set: all of param_in, exp_avg_in, exp_avg_sq_in (and max_exp_avg_sq_in with amsgrad),
  // none overlapping an array written.
  const float* param_in = nullptr;
  const float* exp_avg_in = nullptr;
  const float* exp_avg_sq_in = nullptr;
  const float* max_exp_avg_sq_in = nullptr;
};

// Updates elements [begin, end). Vectorized; the AVX2 build runs where the
// CPU has it, unless HIPFERRY_CPU_ISA says otherwise (cpu::active_isa()).
void adamw_cpu(const AdamWArrays& a, const AdamWScalars& s, std::int64_t begin, std::int64_t end);

// The same with the build chosen by the caller (`isa` must be one this CPU
// runs: <= cpu::best_isa()). Both builds give the same bits; tests prove it.
void adamw_cpu_isa(cpu::Isa isa, const AdamWArrays& a, const AdamWScalars& s, std::int64_t begin, std::int64_t end);

}  // namespace hipferry::optim
