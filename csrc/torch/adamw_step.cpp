// hipferry._C._adamw_step_: the fused AdamW step over one parameter's state
// tensors (the building block of the offloaded optimizer). CPU tensors: the
// vectorized loop on torch's thread pool; GPU tensors: ONE kernel on the
// current stream. Both run optim::adamw_update.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>

#include "csrc/core/errors.h"
#include "hip/adamw_kernel.h"
#include "csrc/core/optim/adamw_cpu.h"
#include "csrc/torch/copy_cast_checks.h"
#include "csrc/torch/current_stream.h"
#include "csrc/torch/python_errors.h"

namespace py = pybind11;

namespace hipferry {
namespace {

void check_state(const at::Tensor& t, const char* name, const at::Tensor& param, bool float32) {
  HF_CHECK_VALUE(t.layout() == at::kStrided && t.is_contiguous(), "hipferry._adamw_step_: ", name,
                 " must be a contiguous dense tensor");
  HF_CHECK_VALUE(t.numel() == param.numel(), "hipferry._adamw_step_: ", name, " has ", t.numel(),
                 " elements but param has ", param.numel(), "; expected equal sizes");
  HF_CHECK_VALUE(t.device() == param.device(), "hipferry._adamw_step_: ", name, " is on ", t.device(),
                 " but param is on ", param.device(), "; expected one device");
  const auto st = t.scalar_type();
  HF_CHECK_VALUE(float32 ? st == at::kFloat : (st == at::kFloat || st == at::kHalf || st == at::kBFloat16),
                 "hipferry._adamw_step_: ", name, " has dtype ", st, "; expected ",
                 float32 ? "float32" : "float32, float16 or bfloat16");
}

void adamw_step(at::Tensor param, const at::Tensor& grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                std::optional<at::Tensor> max_exp_avg_sq, std::optional<at::Tensor> param_out, std::int64_t step,
                double lr, double beta1, double beta2, double eps, double weight_decay, bool amsgrad,
                bool maximize) {
  HF_CHECK_VALUE(step >= 1, "hipferry._adamw_step_: step must be >= 1, got ", step);
  HF_CHECK_VALUE(param.is_cpu() || param.is_cuda(), "hipferry._adamw_step_: param is on ", param.device(),
                 "; expected the CPU or a GPU");
  check_state(param, "param", param, true);
  check_state(grad, "grad", param, false);
  check_state(exp_avg, "exp_avg", param, true);
  check_state(exp_avg_sq, "exp_avg_sq", param, true);
  HF_CHECK_VALUE(!amsgrad || max_exp_avg_sq.has_value(),
                 "hipferry._adamw_step_: amsgrad=True needs max_exp_avg_sq");
  if (amsgrad) check_state(*max_exp_avg_sq, "max_exp_avg_sq", param, true);
  if (param_out) check_state(*param_out, "param_out", param, false);

  const optim::AdamWHyper h{.lr = lr, .beta1 = beta1, .beta2 = beta2, .eps = eps, .weight_decay = weight_decay,
                           .amsgrad = amsgrad, .maximize = maximize};
  const optim::AdamWScalars s = optim::adamw_scalars(h, step);
  optim::AdamWArrays a;
  a.param = param.data_ptr<float>();
  a.grad = grad.const_data_ptr();
  a.grad_type = element_type_of(grad);
  a.exp_avg = exp_avg.data_ptr<float>();
  a.exp_avg_sq = exp_avg_sq.data_ptr<float>();
  a.max_exp_avg_sq = amsgrad ? max_exp_avg_sq->data_ptr<float>() : nullptr;
  if (param_out) {
    a.param_out = param_out->data_ptr();
    a.out_type = element_type_of(*param_out);
  }
  const std::int64_t n = param.numel();
  if (param.is_cpu()) {
    at::parallel_for(0, n, 1 << 15, [&](std::int64_t begin, std::int64_t end) { optim::adamw_cpu(a, s, begin, end); });
  } else {
    const int device = param.device().index();
    gpu::launch_adamw(a, s, n, current_torch_stream(device), device);
  }
}

}  // namespace

void bind_adamw(py::module_& m) {
  m.def("_adamw_step_",
        [](at::Tensor param, const at::Tensor& grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
           std::optional<at::Tensor> max_exp_avg_sq, std::optional<at::Tensor> param_out, std::int64_t step,
           double lr, double beta1, double beta2, double eps, double weight_decay, bool amsgrad, bool maximize) {
          translate_errors([&] {
            py::gil_scoped_release no_gil;
            adamw_step(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, param_out, step, lr, beta1, beta2, eps,
                       weight_decay, amsgrad, maximize);
          });
        },
        py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
        py::arg("max_exp_avg_sq"), py::arg("param_out"), py::arg("step"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("amsgrad"), py::arg("maximize"),
        "One fused AdamW step over one parameter's state, in place (issue 5 groundwork).");
}

}  // namespace hipferry
