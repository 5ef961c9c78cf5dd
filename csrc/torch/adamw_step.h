// The fused AdamW step over one parameter's state and the speculative step's
// commit test, on stable tensors: the kernels of the ops hipferry::adamw_step_
// and hipferry::bits_equal (adamw_step.cpp: CPU; adamw_step_gpu.cpp: CUDA) and
// of their pybind fast paths (_C._adamw_step_, _C._bits_equal).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "csrc/core/optim/adamw_update.h"

#include "csrc/torch/stable.h"

namespace hipferry {

// Checks every argument (ValueError naming it) before anything is written, then
// steps: CPU tensors with the vectorized loop on torch's thread pool, GPU
// tensors with ONE kernel on the current stream. Undefined tensors stand for
// None; param_in undefined: in place.
void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                const Tensor& max_exp_avg_sq, const Tensor& param_out, std::int64_t step, double lr, double beta1,
                double beta2, double eps, double weight_decay, bool amsgrad, bool maximize, const Tensor& param_in,
                const Tensor& exp_avg_in, const Tensor& exp_avg_sq_in, const Tensor& max_exp_avg_sq_in,
                bool adopt_out = false);

// One parameter's in-place step in adamw_step_many (undefined max_exp_avg_sq / param_out: None).
struct AdamWItem {
  Tensor param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, param_out;
  std::int64_t step = 1;
  optim::AdamWHyper hyper;
  bool adopt_out = false;
};

// adamw_step in place over many parameters, one after the other (as many calls
// would): every item is checked (the same checks, the message naming the
// item) before any is stepped. OffloadAdamW's CPU engine steps all of a
// step's parameters with one call (_C._adamw_step_many_).
void adamw_step_many(const std::vector<AdamWItem>& items);

// Whether two dense CPU tensors of as many bytes hold the same bytes.
bool bits_equal(const Tensor& a, const Tensor& b);

// The op kernels (schemas in ops.cpp): the functions above, their errors tagged (op_errors.h).
void adamw_step_op(Tensor param, Tensor grad, Tensor exp_avg, Tensor exp_avg_sq, std::optional<Tensor> max_exp_avg_sq,
                   std::optional<Tensor> param_out, std::int64_t step, double lr, double beta1, double beta2,
                   double eps, double weight_decay, bool amsgrad, bool maximize, std::optional<Tensor> param_in,
                   std::optional<Tensor> exp_avg_in, std::optional<Tensor> exp_avg_sq_in,
                   std::optional<Tensor> max_exp_avg_sq_in, bool adopt_out);
bool bits_equal_op(Tensor a, Tensor b);

}  // namespace hipferry
