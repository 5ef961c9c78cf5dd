// The fused AdamW step over one parameter's state and the speculative step's
// commit test, on stable tensors: the kernels of the ops hipferry::adamw_step_
// and hipferry::bits_equal (adamw_step.cpp: CPU; adamw_step_gpu.cpp: CUDA) and
// of their pybind fast paths (_C._adamw_step_, _C._bits_equal).
#pragma once

#include <cstdint>
#include <optional>

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
