// The ops hipferry::adamw_step_ (the fused AdamW step over one parameter's
// state tensors, the building block of the offloaded optimizer) and
// hipferry::bits_equal (the commit test of a speculative step, Note
// [speculative step] in hipferry/optim/speculation.py): their checks, their CPU
// kernels, and the pybind fast paths _C._adamw_step_ / _C._bits_equal (and
// _C._adamw_step_many_, the step of many parameters in one call) that call
// the same functions without the dispatcher (Note [adamw_step_ fast path]).
// CPU tensors: the vectorized loop on torch's thread pool; GPU tensors: ONE
// kernel on the current stream (registered in adamw_step_gpu.cpp). Both run
// optim::adamw_update.
#include "csrc/torch/adamw_step.h"

#include <pybind11/pybind11.h>
#include <torch/csrc/stable/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "csrc/core/errors.h"
#include "csrc/core/optim/adamw_cpu.h"
#include "csrc/torch/current_stream.h"
#include "csrc/torch/op_errors.h"
#include "csrc/torch/python_errors.h"
#include "csrc/torch/tensor_bridge.h"
#include "hip/adamw_kernel.h"

namespace py = pybind11;

namespace hipferry {
namespace {

// `where`: the message's start, "hipferry.adamw_step_: " or "hipferry.adamw_step_many_: item 3: ".
void check_state(const Tensor& t, std::string_view where, const char* name, const Tensor& param, bool float32) {
  HF_CHECK_VALUE(t.layout() == torch::headeronly::Layout::Strided && t.is_contiguous(), where, name,
                 " must be a contiguous dense tensor");
  HF_CHECK_VALUE(t.numel() == param.numel(), where, name, " has ", t.numel(), " elements but param has ", param.numel(),
                 "; expected equal sizes");
  HF_CHECK_VALUE(t.device() == param.device(), where, name, " is on ", device_name(t.device()), " but param is on ",
                 device_name(param.device()), "; expected one device");
  const ScalarType st = t.scalar_type();
  HF_CHECK_VALUE(float32 ? st == ScalarType::Float : is_float_convertible(st), where, name, " has dtype ",
                 dtype_name(st), "; expected ", float32 ? "float32" : "float32, float16 or bfloat16");
}

// The inputs of an out-of-place step (AdamWArrays' *_in): given together, like the state, and
// apart from every array the step writes.
void check_inputs(const std::array<const Tensor*, 4>& in, const std::array<const Tensor*, 5>& written,
                  const Tensor& param, bool amsgrad) {
  static constexpr const char* kNames[] = {"param_in", "exp_avg_in", "exp_avg_sq_in", "max_exp_avg_sq_in"};
  constexpr std::string_view where = "hipferry.adamw_step_: ";
  for (int i = 0; i < 4; ++i) {
    const bool wanted = i < 3 || amsgrad;
    HF_CHECK_VALUE(in[i]->defined() == wanted, where, kNames[i],
                   wanted ? " is missing: param_in, exp_avg_in and exp_avg_sq_in (and max_exp_avg_sq_in with "
                            "amsgrad) come together"
                          : " is given without amsgrad");
    if (!wanted) continue;
    check_state(*in[i], where, kNames[i], param, true);
    for (const Tensor* w : written) {
      HF_CHECK_VALUE(!w->defined() || !bytes_overlap(*in[i], *w), where, kNames[i],
                     " overlaps an array the step writes; expected separate memory");
    }
  }
}

// The checks of an in-place step's arguments (the first ones of adamw_step, in its order).
void check_in_place(std::string_view where, const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                    const Tensor& exp_avg_sq, const Tensor& max_exp_avg_sq, const Tensor& param_out, std::int64_t step,
                    bool amsgrad) {
  HF_CHECK_VALUE(step >= 1, where, "step must be >= 1, got ", step);
  HF_CHECK_VALUE(param.is_cpu() || param.is_cuda(), where, "param is on ", device_name(param.device()),
                 "; expected the CPU or a GPU");
  check_state(param, where, "param", param, true);
  check_state(grad, where, "grad", param, false);
  check_state(exp_avg, where, "exp_avg", param, true);
  check_state(exp_avg_sq, where, "exp_avg_sq", param, true);
  HF_CHECK_VALUE(!amsgrad || max_exp_avg_sq.defined(), where, "amsgrad=True needs max_exp_avg_sq");
  if (amsgrad) check_state(max_exp_avg_sq, where, "max_exp_avg_sq", param, true);
  if (param_out.defined()) check_state(param_out, where, "param_out", param, false);
}

// The step itself, its arguments checked.
void run_adamw(const Tensor& param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
               const Tensor& max_exp_avg_sq, const Tensor& param_out, std::int64_t step, const optim::AdamWHyper& h,
               const Tensor& param_in, const Tensor& exp_avg_in, const Tensor& exp_avg_sq_in,
               const Tensor& max_exp_avg_sq_in, bool adopt_out) {
  const optim::AdamWScalars s = optim::adamw_scalars(h, step);
  optim::AdamWArrays a;
  a.param = param.mutable_data_ptr<float>();
  a.grad = grad.const_data_ptr();
  a.grad_type = element_type_of(grad);
  a.exp_avg = exp_avg.mutable_data_ptr<float>();
  a.exp_avg_sq = exp_avg_sq.mutable_data_ptr<float>();
  a.max_exp_avg_sq = h.amsgrad ? max_exp_avg_sq.mutable_data_ptr<float>() : nullptr;
  if (param_out.defined()) {
    a.param_out = param_out.mutable_data_ptr();
    a.out_type = element_type_of(param_out);
    a.adopt_out = adopt_out;
  }
  if (param_in.defined()) {
    a.param_in = param_in.const_data_ptr<float>();
    a.exp_avg_in = exp_avg_in.const_data_ptr<float>();
    a.exp_avg_sq_in = exp_avg_sq_in.const_data_ptr<float>();
    a.max_exp_avg_sq_in = h.amsgrad ? max_exp_avg_sq_in.const_data_ptr<float>() : nullptr;
  }
  const std::int64_t n = param.numel();
  if (param.is_cpu()) {
    torch::stable::parallel_for(0, n, 1 << 15,
                                [&](std::int64_t begin, std::int64_t end) { optim::adamw_cpu(a, s, begin, end); });
  } else {
    const int device = param.get_device_index();
    gpu::launch_adamw(a, s, n, current_torch_stream(device), device);
  }
}

}  // namespace

void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                const Tensor& max_exp_avg_sq, const Tensor& param_out, std::int64_t step, double lr, double beta1,
                double beta2, double eps, double weight_decay, bool amsgrad, bool maximize, const Tensor& param_in,
                const Tensor& exp_avg_in, const Tensor& exp_avg_sq_in, const Tensor& max_exp_avg_sq_in,
                bool adopt_out) {
  check_in_place("hipferry.adamw_step_: ", param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, param_out, step, amsgrad);
  const bool from =
      param_in.defined() || exp_avg_in.defined() || exp_avg_sq_in.defined() || max_exp_avg_sq_in.defined();
  HF_CHECK_VALUE(!adopt_out || (param_out.defined() && !from),
                 "hipferry.adamw_step_: adopt_out=True needs "
                 "param_out (the parameter itself) and an in-place step (no param_in)");
  if (from) {
    check_inputs({&param_in, &exp_avg_in, &exp_avg_sq_in, &max_exp_avg_sq_in},
                 {&param, &exp_avg, &exp_avg_sq, &max_exp_avg_sq, &param_out}, param, amsgrad);
  }
  const optim::AdamWHyper h{lr, beta1, beta2, eps, weight_decay, amsgrad, maximize};
  run_adamw(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, param_out, step, h, param_in, exp_avg_in, exp_avg_sq_in,
            max_exp_avg_sq_in, adopt_out);
}

void adamw_step_many(const std::vector<AdamWItem>& items) {
  for (std::size_t i = 0; i < items.size(); ++i) {  // every item checked before any is stepped
    const AdamWItem& it = items[i];
    const std::string where = "hipferry.adamw_step_many_: item " + std::to_string(i) + ": ";
    check_in_place(where, it.param, it.grad, it.exp_avg, it.exp_avg_sq, it.max_exp_avg_sq, it.param_out, it.step,
                   it.hyper.amsgrad);
    HF_CHECK_VALUE(!it.adopt_out || it.param_out.defined(), where,
                   "adopt_out=True needs param_out (the parameter itself)");
  }
  const Tensor none;
  for (const AdamWItem& it : items) {
    run_adamw(it.param, it.grad, it.exp_avg, it.exp_avg_sq, it.max_exp_avg_sq, it.param_out, it.step, it.hyper, none,
              none, none, none, it.adopt_out);
  }
}

// torch.equal compares values at about half the memory bandwidth; this splits memcmp over torch's
// thread pool and stops early once a piece differs (the speculative step's commit compares every
// gradient at step()).
bool bits_equal(const Tensor& a, const Tensor& b) {
  for (const Tensor* t : {&a, &b}) {
    HF_CHECK_VALUE(t->is_cpu() && t->layout() == torch::headeronly::Layout::Strided && t->is_contiguous(),
                   "hipferry.bits_equal: ", t == &a ? "a" : "b", " must be a contiguous dense CPU tensor");
  }
  const std::size_t bytes = nbytes_of(a);
  HF_CHECK_VALUE(bytes == nbytes_of(b), "hipferry.bits_equal: a has ", bytes, " bytes and b ", nbytes_of(b),
                 "; expected as many");
  const char* pa = static_cast<const char*>(a.const_data_ptr());
  const char* pb = static_cast<const char*>(b.const_data_ptr());
  constexpr std::int64_t kPiece = 1 << 16;  // bytes compared between looks at `differ`
  std::atomic<bool> differ{false};
  torch::stable::parallel_for(0, static_cast<std::int64_t>(bytes), 1 << 20, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end && !differ.load(std::memory_order_relaxed); i += kPiece) {
      if (std::memcmp(pa + i, pb + i, static_cast<std::size_t>(std::min(kPiece, end - i))) != 0) {
        differ.store(true, std::memory_order_relaxed);
      }
    }
  });
  return !differ.load();
}

namespace {

Tensor or_undefined(const std::optional<Tensor>& t) { return t.has_value() ? *t : Tensor(); }

}  // namespace

void adamw_step_op(Tensor param, Tensor grad, Tensor exp_avg, Tensor exp_avg_sq, std::optional<Tensor> max_exp_avg_sq,
                   std::optional<Tensor> param_out, std::int64_t step, double lr, double beta1, double beta2,
                   double eps, double weight_decay, bool amsgrad, bool maximize, std::optional<Tensor> param_in,
                   std::optional<Tensor> exp_avg_in, std::optional<Tensor> exp_avg_sq_in,
                   std::optional<Tensor> max_exp_avg_sq_in, bool adopt_out) {
  tag_op_errors([&] {
    adamw_step(param, grad, exp_avg, exp_avg_sq, or_undefined(max_exp_avg_sq), or_undefined(param_out), step, lr, beta1,
               beta2, eps, weight_decay, amsgrad, maximize, or_undefined(param_in), or_undefined(exp_avg_in),
               or_undefined(exp_avg_sq_in), or_undefined(max_exp_avg_sq_in), adopt_out);
  });
}

bool bits_equal_op(Tensor a, Tensor b) {
  return tag_op_errors([&] { return bits_equal(a, b); });
}

namespace {

// Note [adamw_step_ fast path]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// _C._adamw_step_ and _C._bits_equal call the op kernels' functions without the
// dispatcher: about 1.6 us a call against 4.4 us through
// torch.ops.hipferry.adamw_step_ (a 16-element tensor, best of many, AMD EPYC).
// hipferry.ops.adamw_step_ / bits_equal take them for eager calls; tracing and
// dispatch modes take the op. _C._adamw_step_many_ (hipferry.ops.adamw_step_many_)
// steps a list of parameters in one crossing: OffloadAdamW's CPU engine steps all
// of a step's in-place parameters with it, so no Python runs between them (after a
// parameter has streamed its state through the caches, that Python ran cold: issue 31).
// Both paths give the same results and the same errors: torch's negative (and,
// for bits_equal, conjugate) bit, which the stable ABI cannot see, is asked of
// the Python object here and refused, as the op's Negative / Conjugate kernels
// in hipferry/ops.py refuse it.
// obj.<method>() as a bool, through CPython's vectorcall (a pybind11 attribute call costs ~0.15 us).
bool call_bool_method(py::handle obj, PyObject* method) {
  PyObject* self = obj.ptr();
  PyObject* r = PyObject_VectorcallMethod(method, &self, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
  if (r == nullptr) throw py::error_already_set();
  Py_DECREF(r);
  return r == Py_True;
}

// `what`: "hipferry.<op>: <argument>".
Tensor plain_tensor_from_python(py::handle obj, const char* what, bool allow_none, bool conj) {
  static PyObject* const is_neg = PyUnicode_InternFromString("is_neg");
  static PyObject* const is_conj = PyUnicode_InternFromString("is_conj");
  const Tensor t = tensor_from_python(obj, what, allow_none);
  if (!t.defined()) return t;
  HF_CHECK_VALUE(!call_bool_method(obj, is_neg), what,
                 " has torch's negative bit set (a lazy view); expected a tensor without it (resolve_neg() makes one)");
  HF_CHECK_VALUE(!conj || !call_bool_method(obj, is_conj), what,
                 " has torch's conjugate bit set (a lazy view); expected a tensor without it (resolve_conj() makes "
                 "one)");
  return t;
}

// The hyperparameters of _adamw_step_many_'s item `i`: a dict with the keys of
// hipferry.ops.adamw_step_'s (what OffloadAdamW's group_hyper makes).
optim::AdamWHyper hyper_from_python(py::handle obj, std::size_t i) {
  const std::string what = "hipferry.adamw_step_many_: hypers[" + std::to_string(i) + "]";
  HF_CHECK_TYPE(PyDict_Check(obj.ptr()), what, " is a ", Py_TYPE(obj.ptr())->tp_name,
                "; expected a dict with lr, beta1, beta2, eps, weight_decay, amsgrad and maximize");
  const auto get = [&](const char* key) {
    PyObject* v = PyDict_GetItemString(obj.ptr(), key);  // borrowed
    HF_CHECK_VALUE(v != nullptr, what, " has no '", key, "'");
    return py::handle(v);
  };
  const auto number = [&](const char* key) {
    const py::handle v = get(key);
    HF_CHECK_TYPE(PyFloat_Check(v.ptr()) || (PyLong_Check(v.ptr()) && !PyBool_Check(v.ptr())), what, "['", key,
                  "'] is a ", Py_TYPE(v.ptr())->tp_name, "; expected a float");
    return PyFloat_AsDouble(v.ptr());
  };
  const auto flag = [&](const char* key) {
    const py::handle v = get(key);
    HF_CHECK_TYPE(PyBool_Check(v.ptr()), what, "['", key, "'] is a ", Py_TYPE(v.ptr())->tp_name,
                  "; expected True or False");
    return v.ptr() == Py_True;
  };
  return optim::AdamWHyper{.lr = number("lr"),
                           .beta1 = number("beta1"),
                           .beta2 = number("beta2"),
                           .eps = number("eps"),
                           .weight_decay = number("weight_decay"),
                           .amsgrad = flag("amsgrad"),
                           .maximize = flag("maximize")};
}

// _adamw_step_many_'s lists as items, each argument's length checked against params'.
std::vector<AdamWItem> items_from_python(const std::array<py::handle, 9>& lists) {
  static constexpr const char* kNames[] = {"params",     "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs",
                                           "param_outs", "steps", "hypers",   "adopt_outs"};
  for (int k = 0; k < 9; ++k) {
    HF_CHECK_TYPE(PyList_Check(lists[k].ptr()), "hipferry.adamw_step_many_: ", kNames[k], " is a ",
                  Py_TYPE(lists[k].ptr())->tp_name, "; expected a list");
  }
  const std::size_t n = PyList_GET_SIZE(lists[0].ptr());
  for (int k = 1; k < 9; ++k) {
    const std::size_t got = PyList_GET_SIZE(lists[k].ptr());
    HF_CHECK_VALUE(got == n, "hipferry.adamw_step_many_: ", kNames[k], " has ", got, " entries but params has ", n,
                   "; expected one per parameter");
  }
  std::vector<AdamWItem> items(n);
  PyObject* last_hyper = nullptr;  // the items of a group share its dict: read once
  for (std::size_t i = 0; i < n; ++i) {
    AdamWItem& it = items[i];
    const auto at = [&](int k) { return py::handle(PyList_GET_ITEM(lists[k].ptr(), i)); };
    Tensor* tensors[] = {&it.param, &it.grad, &it.exp_avg, &it.exp_avg_sq, &it.max_exp_avg_sq, &it.param_out};
    for (int k = 0; k < 6; ++k) {
      const std::string what = std::string("hipferry.adamw_step_many_: ") + kNames[k] + "[" + std::to_string(i) + "]";
      *tensors[k] = plain_tensor_from_python(at(k), what.c_str(), k >= 4, false);
    }
    const py::handle step = at(6);
    HF_CHECK_TYPE(PyLong_Check(step.ptr()) && !PyBool_Check(step.ptr()), "hipferry.adamw_step_many_: steps[", i,
                  "] is a ", Py_TYPE(step.ptr())->tp_name, "; expected an int");
    it.step = PyLong_AsLongLong(step.ptr());
    if (it.step == -1 && PyErr_Occurred()) throw py::error_already_set();
    if (at(7).ptr() == last_hyper) {
      it.hyper = items[i - 1].hyper;
    } else {
      it.hyper = hyper_from_python(at(7), i);
      last_hyper = at(7).ptr();
    }
    HF_CHECK_TYPE(PyBool_Check(at(8).ptr()), "hipferry.adamw_step_many_: adopt_outs[", i, "] is a ",
                  Py_TYPE(at(8).ptr())->tp_name, "; expected True or False");
    it.adopt_out = at(8).ptr() == Py_True;
  }
  return items;
}

}  // namespace

void bind_adamw(py::module_& m) {
  m.def(
      "_bits_equal",
      [](py::object a, py::object b) {
        return translate_errors([&] {
          const Tensor ta = plain_tensor_from_python(a, "hipferry.bits_equal: a", false, true);
          const Tensor tb = plain_tensor_from_python(b, "hipferry.bits_equal: b", false, true);
          py::gil_scoped_release no_gil;
          return bits_equal(ta, tb);
        });
      },
      py::arg("a"), py::arg("b"), "hipferry.ops.bits_equal without the dispatcher (Note [adamw_step_ fast path]).");
  m.def(
      "_adamw_step_",
      [](py::object param, py::object grad, py::object exp_avg, py::object exp_avg_sq, py::object max_exp_avg_sq,
         py::object param_out, std::int64_t step, double lr, double beta1, double beta2, double eps,
         double weight_decay, bool amsgrad, bool maximize, py::object param_in, py::object exp_avg_in,
         py::object exp_avg_sq_in, py::object max_exp_avg_sq_in, bool adopt_out) {
        translate_errors([&] {
          const auto in = [](py::handle obj, const char* what, bool allow_none = true) {
            return plain_tensor_from_python(obj, what, allow_none, false);
          };
          // Converted with the GIL; the tensors die after it is taken back (declared before no_gil).
          const Tensor p = in(param, "hipferry.adamw_step_: param", false);
          const Tensor g = in(grad, "hipferry.adamw_step_: grad", false);
          const Tensor m1 = in(exp_avg, "hipferry.adamw_step_: exp_avg", false);
          const Tensor m2 = in(exp_avg_sq, "hipferry.adamw_step_: exp_avg_sq", false);
          const Tensor mx = in(max_exp_avg_sq, "hipferry.adamw_step_: max_exp_avg_sq");
          const Tensor out = in(param_out, "hipferry.adamw_step_: param_out");
          const Tensor p_in = in(param_in, "hipferry.adamw_step_: param_in");
          const Tensor m1_in = in(exp_avg_in, "hipferry.adamw_step_: exp_avg_in");
          const Tensor m2_in = in(exp_avg_sq_in, "hipferry.adamw_step_: exp_avg_sq_in");
          const Tensor mx_in = in(max_exp_avg_sq_in, "hipferry.adamw_step_: max_exp_avg_sq_in");
          py::gil_scoped_release no_gil;
          adamw_step(p, g, m1, m2, mx, out, step, lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, p_in, m1_in,
                     m2_in, mx_in, adopt_out);
        });
      },
      py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("max_exp_avg_sq"),
      py::arg("param_out"), py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
      py::arg("weight_decay"), py::arg("amsgrad"), py::arg("maximize"), py::arg("param_in") = py::none(),
      py::arg("exp_avg_in") = py::none(), py::arg("exp_avg_sq_in") = py::none(),
      py::arg("max_exp_avg_sq_in") = py::none(), py::arg("adopt_out") = false,
      "hipferry.ops.adamw_step_ without the dispatcher (Note [adamw_step_ fast path]).");
  m.def(
      "_adamw_step_many_",
      [](py::object params, py::object grads, py::object exp_avgs, py::object exp_avg_sqs, py::object max_exp_avg_sqs,
         py::object param_outs, py::object steps, py::object hypers, py::object adopt_outs) {
        translate_errors([&] {
          // Converted with the GIL; the tensors die after it is taken back (declared before no_gil).
          const std::vector<AdamWItem> items = items_from_python(
              {params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, param_outs, steps, hypers, adopt_outs});
          py::gil_scoped_release no_gil;
          adamw_step_many(items);
        });
      },
      py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("max_exp_avg_sqs"),
      py::arg("param_outs"), py::arg("steps"), py::arg("hypers"), py::arg("adopt_outs"),
      "hipferry.ops.adamw_step_many_ without the dispatcher (Note [adamw_step_ fast path]).");
}

}  // namespace hipferry

STABLE_TORCH_LIBRARY_IMPL(hipferry, CPU, m) {
  m.impl("adamw_step_", TORCH_BOX(&hipferry::adamw_step_op));
  m.impl("bits_equal", TORCH_BOX(&hipferry::bits_equal_op));
}
