// hipferry._C._adamw8bit_step_: the fused AdamW step with 8-bit blockwise moments
// (csrc/core/optim/quant8.h) over one parameter's tensors. CPU tensors: the loop on torch's
// thread pool, split at block boundaries; GPU tensors: ONE kernel on the current stream.
// Both run quant8.h's element code and agree bit for bit.
// hipferry._C._quantize_blockwise_8bit / _dequantize_blockwise_8bit: the same blockwise
// format on its own (state conversion, tests); _dynamic_map_8bit: the code tables.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <vector>

#include "csrc/core/errors.h"
#include "csrc/core/optim/adamw8bit_cpu.h"
#include "csrc/core/optim/quant8_map.h"
#include "csrc/torch/current_stream.h"
#include "csrc/torch/python_errors.h"
#include "csrc/torch/stable.h"
#include "csrc/torch/tensor_bridge.h"
#include "hip/adamw8bit_kernel.h"

namespace py = pybind11;

namespace hipferry {
namespace {

constexpr std::int64_t kBlock = optim::q8::kBlock;
constexpr std::int64_t kGrainBlocks = 128;  // 32768 elements per task, as _adamw_step_

enum class Kind { kFloat32, kUint8, kAnyFloat };

// `t` is a contiguous dense tensor of `numel` elements of `kind` on `device`; `what` says
// where the count comes from.
void check_array(const char* fn, const char* name, const Tensor& t, Kind kind, std::int64_t numel, const char* what,
                 const Device& device) {
  HF_CHECK_VALUE(t.defined(), fn, name, " is None; expected a tensor");
  HF_CHECK_VALUE(t.layout() == torch::headeronly::Layout::Strided && t.is_contiguous(), fn, name,
                 " must be a contiguous dense tensor");
  HF_CHECK_VALUE(t.device() == device, fn, name, " is on ", device_name(t.device()), " but param is on ",
                 device_name(device), "; expected one device");
  const ScalarType st = t.scalar_type();
  const bool ok = kind == Kind::kFloat32 ? st == ScalarType::Float
                  : kind == Kind::kUint8 ? st == ScalarType::Byte
                                         : is_float_convertible(st);
  HF_CHECK_VALUE(ok, fn, name, " has dtype ", dtype_name(st), "; expected ",
                 kind == Kind::kFloat32 ? "torch.float32"
                 : kind == Kind::kUint8 ? "torch.uint8"
                                        : "torch.float32, torch.float16 or torch.bfloat16");
  HF_CHECK_VALUE(t.numel() == numel, fn, name, " has ", t.numel(), " elements; expected ", numel, " (", what, ")");
}

// One 8-bit state: codes (uint8, n) and scales (float32, ceil(n / 256)).
void check_state8(const char* fn, const char* codes_name, const Tensor& codes, const char* absmax_name,
                  const Tensor& absmax, std::int64_t n, const Device& device) {
  check_array(fn, codes_name, codes, Kind::kUint8, n, "one code per element of param", device);
  check_array(fn, absmax_name, absmax, Kind::kFloat32, optim::q8::block_count(n),
              "one scale per block of 256 elements of param", device);
}

struct Named {
  const char* name;
  const Tensor* t;
};

// No array in `read` (or in `written`, pairwise) shares a byte with another in `written`.
void check_apart(const char* fn, const std::vector<Named>& written, const std::vector<Named>& read) {
  for (std::size_t i = 0; i < written.size(); ++i) {
    for (std::size_t j = 0; j < written.size() + read.size(); ++j) {
      if (j < written.size() && j <= i) continue;
      const Named& other = j < written.size() ? written[j] : read[j - written.size()];
      HF_CHECK_VALUE(!bytes_overlap(*written[i].t, *other.t), fn, other.name, " overlaps ", written[i].name,
                     ", which the step writes; expected separate memory");
    }
  }
}

// The tensors of one call; undefined ones stand for None.
struct Step8 {
  Tensor param, grad, m, m_absmax, v, v_absmax, x, x_absmax, out;
  Tensor param_in, m_in, m_absmax_in, v_in, v_absmax_in, x_in, x_absmax_in;
  bool amsgrad = false;
  bool adopt_out = false;  // param_out is the parameter: take the user's writes first (adamw_update.h)
  bool from() const {
    for (const Tensor* t : {&param_in, &m_in, &m_absmax_in, &v_in, &v_absmax_in, &x_in, &x_absmax_in}) {
      if (t->defined()) return true;
    }
    return false;
  }
};

constexpr const char* kFn = "hipferry._adamw8bit_step_: ";

void check_inputs(const Step8& a, std::int64_t n, const Device& device) {
  const std::pair<const char*, const Tensor*> in[] = {{"param_in", &a.param_in},
                                                      {"exp_avg_in", &a.m_in},
                                                      {"exp_avg_absmax_in", &a.m_absmax_in},
                                                      {"exp_avg_sq_in", &a.v_in},
                                                      {"exp_avg_sq_absmax_in", &a.v_absmax_in},
                                                      {"max_exp_avg_sq_in", &a.x_in},
                                                      {"max_exp_avg_sq_absmax_in", &a.x_absmax_in}};
  for (int i = 0; i < 7; ++i) {
    const bool wanted = i < 5 || a.amsgrad;
    HF_CHECK_VALUE(in[i].second->defined() == wanted, kFn, in[i].first,
                   wanted ? " is missing: param_in and the exp_avg and exp_avg_sq inputs (with max_exp_avg_sq's "
                            "under amsgrad), codes and absmax, come together"
                          : " is given without amsgrad");
  }
  check_array(kFn, "param_in", a.param_in, Kind::kFloat32, n, "as many as param", device);
  check_state8(kFn, "exp_avg_in", a.m_in, "exp_avg_absmax_in", a.m_absmax_in, n, device);
  check_state8(kFn, "exp_avg_sq_in", a.v_in, "exp_avg_sq_absmax_in", a.v_absmax_in, n, device);
  if (a.amsgrad) check_state8(kFn, "max_exp_avg_sq_in", a.x_in, "max_exp_avg_sq_absmax_in", a.x_absmax_in, n, device);
}

void check_step8(const Step8& a) {
  HF_CHECK_VALUE(a.param.is_cpu() || a.param.is_cuda(), kFn, "param is on ", device_name(a.param.device()),
                 "; expected the CPU or a GPU");
  const Device device = a.param.device();
  const std::int64_t n = a.param.numel();
  check_array(kFn, "param", a.param, Kind::kFloat32, n, "param's own", device);
  check_array(kFn, "grad", a.grad, Kind::kAnyFloat, n, "as many as param", device);
  check_state8(kFn, "exp_avg", a.m, "exp_avg_absmax", a.m_absmax, n, device);
  check_state8(kFn, "exp_avg_sq", a.v, "exp_avg_sq_absmax", a.v_absmax, n, device);
  if (a.amsgrad) {
    HF_CHECK_VALUE(a.x.defined() && a.x_absmax.defined(), kFn,
                   "amsgrad=True needs max_exp_avg_sq and max_exp_avg_sq_absmax");
    check_state8(kFn, "max_exp_avg_sq", a.x, "max_exp_avg_sq_absmax", a.x_absmax, n, device);
  }
  if (a.out.defined()) check_array(kFn, "param_out", a.out, Kind::kAnyFloat, n, "as many as param", device);
  const bool from = a.from();
  if (from) check_inputs(a, n, device);
  std::vector<Named> written = {{"param", &a.param},
                                {"exp_avg", &a.m},
                                {"exp_avg_absmax", &a.m_absmax},
                                {"exp_avg_sq", &a.v},
                                {"exp_avg_sq_absmax", &a.v_absmax}};
  if (a.amsgrad) written.insert(written.end(), {{"max_exp_avg_sq", &a.x}, {"max_exp_avg_sq_absmax", &a.x_absmax}});
  if (a.out.defined()) written.push_back({"param_out", &a.out});
  std::vector<Named> read = {{"grad", &a.grad}};
  if (from) {
    read.insert(read.end(), {{"param_in", &a.param_in},
                             {"exp_avg_in", &a.m_in},
                             {"exp_avg_absmax_in", &a.m_absmax_in},
                             {"exp_avg_sq_in", &a.v_in},
                             {"exp_avg_sq_absmax_in", &a.v_absmax_in}});
    if (a.amsgrad) {
      read.insert(read.end(), {{"max_exp_avg_sq_in", &a.x_in}, {"max_exp_avg_sq_absmax_in", &a.x_absmax_in}});
    }
  }
  check_apart(kFn, written, read);
}

optim::Quant8Array state_of(const Tensor& codes, const Tensor& absmax) {
  return {codes.mutable_data_ptr<std::uint8_t>(), absmax.mutable_data_ptr<float>()};
}
optim::Quant8Input input_of(const Tensor& codes, const Tensor& absmax) {
  return {codes.const_data_ptr<std::uint8_t>(), absmax.const_data_ptr<float>()};
}

optim::AdamW8bitArrays arrays_of(const Step8& t) {
  optim::AdamW8bitArrays a;
  a.param = t.param.mutable_data_ptr<float>();
  a.grad = t.grad.const_data_ptr();
  a.grad_type = element_type_of(t.grad);
  a.exp_avg = state_of(t.m, t.m_absmax);
  a.exp_avg_sq = state_of(t.v, t.v_absmax);
  if (t.amsgrad) a.max_exp_avg_sq = state_of(t.x, t.x_absmax);
  if (t.out.defined()) {
    a.param_out = t.out.mutable_data_ptr();
    a.out_type = element_type_of(t.out);
    a.adopt_out = t.adopt_out;
  }
  if (t.from()) {
    a.param_in = t.param_in.const_data_ptr<float>();
    a.exp_avg_in = input_of(t.m_in, t.m_absmax_in);
    a.exp_avg_sq_in = input_of(t.v_in, t.v_absmax_in);
    if (t.amsgrad) a.max_exp_avg_sq_in = input_of(t.x_in, t.x_absmax_in);
  }
  return a;
}

// Runs fn(begin, end) over [0, n) in pieces that start on block boundaries.
template <class Fn>
void for_blocks(std::int64_t n, Fn&& fn) {
  torch::stable::parallel_for(0, optim::q8::block_count(n), kGrainBlocks,
                              [&](std::int64_t b0, std::int64_t b1) { fn(b0 * kBlock, std::min(b1 * kBlock, n)); });
}

void adamw8bit_step(const Step8& t, std::int64_t step, const optim::AdamWHyper& h) {
  HF_CHECK_VALUE(step >= 1, kFn, "step must be >= 1, got ", step);
  check_step8(t);
  HF_CHECK_VALUE(!t.adopt_out || (t.out.defined() && !t.from()), kFn,
                 "adopt_out=True needs param_out (the parameter itself) and an in-place step (no param_in)");
  const optim::AdamWScalars s = optim::adamw_scalars(h, step);
  const optim::AdamW8bitArrays a = arrays_of(t);
  const std::int64_t n = t.param.numel();
  if (t.param.is_cpu()) {
    for_blocks(n, [&](std::int64_t begin, std::int64_t end) { optim::adamw8bit_cpu(a, s, begin, end); });
  } else {
    const int device = t.param.get_device_index();
    gpu::launch_adamw8bit(a, s, n, current_torch_stream(device), device);
  }
}

// _quantize_blockwise_8bit(x, signed, codes=None, absmax=None) -> (codes, absmax); codes and
// absmax are made when undefined. (Every tensor outlives the call: they die with the GIL held.)
void quantize8(const Tensor& x, bool is_signed, Tensor& codes, Tensor& absmax) {
  constexpr const char* fn = "hipferry._quantize_blockwise_8bit: ";
  HF_CHECK_VALUE(x.is_cpu(), fn, "x is on ", device_name(x.device()), "; expected the CPU");
  const std::int64_t n = x.numel();
  check_array(fn, "x", x, Kind::kFloat32, n, "x's own", x.device());
  if (!codes.defined()) codes = torch::stable::empty(shape_of(x), ScalarType::Byte, std::nullopt, x.device());
  if (!absmax.defined())
    absmax = torch::stable::empty({optim::q8::block_count(n)}, ScalarType::Float, std::nullopt, x.device());
  check_state8(fn, "codes", codes, "absmax", absmax, n, x.device());
  check_apart(fn, {{"codes", &codes}, {"absmax", &absmax}}, {{"x", &x}});
  const float* xs = x.const_data_ptr<float>();
  auto* q = codes.mutable_data_ptr<std::uint8_t>();
  auto* s = absmax.mutable_data_ptr<float>();
  const cpu::Isa isa = cpu::active_isa();
  for_blocks(n, [&](std::int64_t begin, std::int64_t end) {
    optim::quantize_blockwise8(isa, xs, is_signed, q, s, begin, end);
  });
}

// _dequantize_blockwise_8bit(codes, absmax, signed, out=None) -> out (made when undefined)
void dequantize8(const Tensor& codes, const Tensor& absmax, bool is_signed, Tensor& out) {
  constexpr const char* fn = "hipferry._dequantize_blockwise_8bit: ";
  HF_CHECK_VALUE(codes.is_cpu(), fn, "codes is on ", device_name(codes.device()), "; expected the CPU");
  const std::int64_t n = codes.numel();
  check_state8(fn, "codes", codes, "absmax", absmax, n, codes.device());
  if (!out.defined()) out = torch::stable::empty(shape_of(codes), ScalarType::Float, std::nullopt, codes.device());
  check_array(fn, "out", out, Kind::kFloat32, n, "as many as codes", codes.device());
  check_apart(fn, {{"out", &out}}, {{"codes", &codes}, {"absmax", &absmax}});
  const auto* q = codes.const_data_ptr<std::uint8_t>();
  const float* s = absmax.const_data_ptr<float>();
  float* o = out.mutable_data_ptr<float>();
  const cpu::Isa isa = cpu::active_isa();
  for_blocks(n, [&](std::int64_t begin, std::int64_t end) {
    optim::dequantize_blockwise8(isa, q, s, is_signed, o, begin, end);
  });
}

Tensor dynamic_map8(bool is_signed) {
  Tensor t = torch::stable::empty({optim::q8::kCodes}, ScalarType::Float, std::nullopt, Device(DeviceType::CPU));
  const float* code = optim::q8::quant8_map(is_signed).code;
  std::copy(code, code + optim::q8::kCodes, t.mutable_data_ptr<float>());
  return t;
}

Tensor optional_tensor(const py::object& o, const char* what) { return tensor_from_python(o, what, true); }

}  // namespace

void bind_adamw8bit(py::module_& m) {
  m.def(
      "_adamw8bit_step_",
      [](py::object param, py::object grad, py::object exp_avg, py::object exp_avg_absmax, py::object exp_avg_sq,
         py::object exp_avg_sq_absmax, py::object max_exp_avg_sq, py::object max_exp_avg_sq_absmax,
         py::object param_out, std::int64_t step, double lr, double beta1, double beta2, double eps,
         double weight_decay, bool amsgrad, bool maximize, py::object param_in, py::object exp_avg_in,
         py::object exp_avg_absmax_in, py::object exp_avg_sq_in, py::object exp_avg_sq_absmax_in,
         py::object max_exp_avg_sq_in, py::object max_exp_avg_sq_absmax_in, bool adopt_out) {
        translate_errors([&] {
          // Converted with the GIL; the tensors die after it is taken back (declared before no_gil).
          Step8 t;
          t.param = tensor_from_python(param, "hipferry._adamw8bit_step_: param");
          t.grad = tensor_from_python(grad, "hipferry._adamw8bit_step_: grad");
          t.m = tensor_from_python(exp_avg, "hipferry._adamw8bit_step_: exp_avg");
          t.m_absmax = tensor_from_python(exp_avg_absmax, "hipferry._adamw8bit_step_: exp_avg_absmax");
          t.v = tensor_from_python(exp_avg_sq, "hipferry._adamw8bit_step_: exp_avg_sq");
          t.v_absmax = tensor_from_python(exp_avg_sq_absmax, "hipferry._adamw8bit_step_: exp_avg_sq_absmax");
          t.x = optional_tensor(max_exp_avg_sq, "hipferry._adamw8bit_step_: max_exp_avg_sq");
          t.x_absmax = optional_tensor(max_exp_avg_sq_absmax, "hipferry._adamw8bit_step_: max_exp_avg_sq_absmax");
          t.out = optional_tensor(param_out, "hipferry._adamw8bit_step_: param_out");
          t.param_in = optional_tensor(param_in, "hipferry._adamw8bit_step_: param_in");
          t.m_in = optional_tensor(exp_avg_in, "hipferry._adamw8bit_step_: exp_avg_in");
          t.m_absmax_in = optional_tensor(exp_avg_absmax_in, "hipferry._adamw8bit_step_: exp_avg_absmax_in");
          t.v_in = optional_tensor(exp_avg_sq_in, "hipferry._adamw8bit_step_: exp_avg_sq_in");
          t.v_absmax_in = optional_tensor(exp_avg_sq_absmax_in, "hipferry._adamw8bit_step_: exp_avg_sq_absmax_in");
          t.x_in = optional_tensor(max_exp_avg_sq_in, "hipferry._adamw8bit_step_: max_exp_avg_sq_in");
          t.x_absmax_in =
              optional_tensor(max_exp_avg_sq_absmax_in, "hipferry._adamw8bit_step_: max_exp_avg_sq_absmax_in");
          t.amsgrad = amsgrad;
          const optim::AdamWHyper h{lr, beta1, beta2, eps, weight_decay, amsgrad, maximize};
          py::gil_scoped_release no_gil;
          t.adopt_out = adopt_out;
          adamw8bit_step(t, step, h);
        });
      },
      py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_absmax"), py::arg("exp_avg_sq"),
      py::arg("exp_avg_sq_absmax"), py::arg("max_exp_avg_sq"), py::arg("max_exp_avg_sq_absmax"), py::arg("param_out"),
      py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
      py::arg("amsgrad"), py::arg("maximize"), py::arg("param_in") = py::none(), py::arg("exp_avg_in") = py::none(),
      py::arg("exp_avg_absmax_in") = py::none(), py::arg("exp_avg_sq_in") = py::none(),
      py::arg("exp_avg_sq_absmax_in") = py::none(), py::arg("max_exp_avg_sq_in") = py::none(),
      py::arg("max_exp_avg_sq_absmax_in") = py::none(), py::arg("adopt_out") = false,
      "One fused AdamW step with 8-bit blockwise moments (uint8 codes, one float32 absmax per block of 256): "
      "in place, or reading param_in and the *_in state and writing param and the state.");
  m.def(
      "_quantize_blockwise_8bit",
      [](py::object x, bool is_signed, py::object codes, py::object absmax) {
        return translate_errors([&] {
          const Tensor tx = tensor_from_python(x, "hipferry._quantize_blockwise_8bit: x");
          Tensor tc = optional_tensor(codes, "hipferry._quantize_blockwise_8bit: codes");
          Tensor ta = optional_tensor(absmax, "hipferry._quantize_blockwise_8bit: absmax");
          {
            py::gil_scoped_release no_gil;
            quantize8(tx, is_signed, tc, ta);
          }
          return py::make_tuple(tensor_to_python(tc), tensor_to_python(ta));
        });
      },
      py::arg("x"), py::arg("signed"), py::arg("codes") = py::none(), py::arg("absmax") = py::none(),
      "float32 CPU tensor -> (uint8 codes of x's shape, float32 absmax per block of 256), with the signed or "
      "the unsigned dynamic map (into codes and absmax when given).");
  m.def(
      "_dequantize_blockwise_8bit",
      [](py::object codes, py::object absmax, bool is_signed, py::object out) {
        return translate_errors([&] {
          const Tensor tc = tensor_from_python(codes, "hipferry._dequantize_blockwise_8bit: codes");
          const Tensor ta = tensor_from_python(absmax, "hipferry._dequantize_blockwise_8bit: absmax");
          Tensor to = optional_tensor(out, "hipferry._dequantize_blockwise_8bit: out");
          {
            py::gil_scoped_release no_gil;
            dequantize8(tc, ta, is_signed, to);
          }
          return tensor_to_python(to);
        });
      },
      py::arg("codes"), py::arg("absmax"), py::arg("signed"), py::arg("out") = py::none(),
      "(uint8 codes, float32 absmax) CPU tensors -> float32 values code[q] * absmax (into out when given).");
  m.def(
      "_dynamic_map_8bit",
      [](bool is_signed) { return translate_errors([&] { return tensor_to_python(dynamic_map8(is_signed)); }); },
      py::arg("signed"), "bitsandbytes' create_dynamic_map(signed): the 256 codes, ascending (float32).");
}

}  // namespace hipferry
