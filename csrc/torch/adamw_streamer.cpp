// AdamWStreamer (see Note [GPU-streamed AdamW] in adamw_streamer.h) and its
// binding hipferry._C.AdamWStreamer, driven by hipferry.optim.OffloadAdamW.
#include "csrc/torch/adamw_streamer.h"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <optional>
#include <string>

#include "csrc/core/errors.h"
#include "csrc/core/optim/adamw_cpu.h"
#include "csrc/core/schedule/host_streams.h"
#include "csrc/torch/current_stream.h"
#include "csrc/torch/python_errors.h"
#include "csrc/torch/tensor_bridge.h"
#include "hip/adamw8bit_kernel.h"
#include "hip/adamw_kernel.h"
#include "hip/gpu_stream.h"
#include "hip/trace_session.h"

namespace py = pybind11;

namespace hipferry {
namespace {

std::unique_ptr<schedule::Stream> copy_stream(int device, const char* direction) {
  if (device < 0)
    return std::make_unique<schedule::ImmediateStream>(std::string("cpu adamw ") + direction, tracing::host_spans());
  return std::make_unique<gpu::GpuStream>(device, "gpu:" + std::to_string(device) + " adamw " + direction + " stream");
}

void check_host_state(const Tensor& t, const char* name, std::size_t index, std::int64_t numel,
                      ScalarType dtype = ScalarType::Float) {
  HF_CHECK_VALUE(t.is_cpu() && t.scalar_type() == dtype && t.is_contiguous() && t.numel() == numel,
                 "AdamWStreamer.step: ", name, "[", index, "] must be a contiguous ", dtype_name(dtype).substr(6),
                 " host tensor with ", numel, " elements; got ", dtype_name(t.scalar_type()), " on ",
                 device_name(t.device()), " with ", t.numel(), " elements");
}

void check_param(const StreamedParam& p, std::size_t i, int device, bool amsgrad, std::int64_t chunk_numel) {
  const Tensor& param = p.param;
  const bool placed = device < 0 ? param.is_cpu() : param.is_cuda() && param.get_device_index() == device;
  HF_CHECK_VALUE(placed && param.is_contiguous(), "AdamWStreamer.step: params[", i, "] must be a contiguous tensor on ",
                 device < 0 ? std::string("the CPU (host mode)") : "cuda:" + std::to_string(device), "; got ",
                 device_name(param.device()));
  const ScalarType pt = param.scalar_type();
  const bool low = pt == ScalarType::Half || pt == ScalarType::BFloat16;
  HF_CHECK_VALUE(low || pt == ScalarType::Float, "AdamWStreamer.step: params[", i, "] has dtype ", dtype_name(pt),
                 "; expected float32, float16 or bfloat16");
  HF_CHECK_VALUE(low == p.master.has_value(), "AdamWStreamer.step: params[", i, "] is ", dtype_name(pt),
                 low ? " and needs" : " and must not have", " a float32 master");
  HF_CHECK_VALUE(p.grad.device() == param.device() && p.grad.is_contiguous() && p.grad.numel() == param.numel() &&
                     is_float_convertible(p.grad.scalar_type()),
                 "AdamWStreamer.step: grads[", i, "] must be a contiguous float tensor on ",
                 device_name(param.device()), " with ", param.numel(), " elements");
  if (p.master) check_host_state(*p.master, "masters", i, param.numel());
  const bool q8 = p.exp_avg_absmax.has_value();
  HF_CHECK_VALUE(q8 == p.exp_avg_sq_absmax.has_value() && (!q8 || amsgrad == p.max_exp_avg_sq_absmax.has_value()) &&
                     (q8 || !p.max_exp_avg_sq_absmax.has_value()),
                 "AdamWStreamer.step: parameter ", i,
                 " has the scales of some of its moments but not all (8-bit "
                 "state needs exp_avg_absmaxes, exp_avg_sq_absmaxes and, with amsgrad, max_exp_avg_sq_absmaxes)");
  HF_CHECK_VALUE(!q8 || chunk_numel % optim::q8::kBlock == 0, "AdamWStreamer.step: 8-bit state streams in whole ",
                 "blocks of 256 elements; this streamer's chunk_numel is ", chunk_numel);
  const ScalarType moments = q8 ? ScalarType::Byte : ScalarType::Float;
  const std::int64_t blocks = optim::q8::block_count(param.numel());
  check_host_state(p.exp_avg, "exp_avgs", i, param.numel(), moments);
  check_host_state(p.exp_avg_sq, "exp_avg_sqs", i, param.numel(), moments);
  HF_CHECK_VALUE(amsgrad == p.max_exp_avg_sq.has_value(), "AdamWStreamer.step: max_exp_avg_sqs[", i, "] ",
                 amsgrad ? "is needed with amsgrad" : "must be None without amsgrad");
  if (p.max_exp_avg_sq) check_host_state(*p.max_exp_avg_sq, "max_exp_avg_sqs", i, param.numel(), moments);
  if (!q8) return;
  check_host_state(*p.exp_avg_absmax, "exp_avg_absmaxes", i, blocks);
  check_host_state(*p.exp_avg_sq_absmax, "exp_avg_sq_absmaxes", i, blocks);
  if (amsgrad) check_host_state(*p.max_exp_avg_sq_absmax, "max_exp_avg_sq_absmaxes", i, blocks);
}

}  // namespace

AdamWStreamer::AdamWStreamer(int device, std::int64_t chunk_numel, int slots)
    : device_(device),
      chunk_numel_(chunk_numel),
      slots_(slots),
      in_(copy_stream(device, "state in")),
      out_(copy_stream(device, "state out")),
      pipeline_(chunk_numel, slots) {}

AdamWStreamer::~AdamWStreamer() {
  try {
    synchronize();
  } catch (...) {
    // A failed device is reported by the next call on it; the ring must still go.
  }
}

void AdamWStreamer::synchronize() {
  std::optional<rt::DeviceGuard> guard;
  if (device_ >= 0) guard.emplace(device_);
  try {
    pipeline_.synchronize();
  } catch (...) {
    in_flight_.clear();  // every copy was waited for first: nothing still uses them
    throw;
  }
  in_flight_.clear();
}

bool AdamWStreamer::ensure_ring(std::size_t slot_bytes) {
  if (ring_.defined() && slot_bytes <= slot_bytes_) return false;
  synchronize();     // the old ring may still be read or written by the last step
  ring_ = Tensor();  // the old ring goes back before the new one is allocated
  const Device where = device_ >= 0 ? cuda_device(device_) : Device(DeviceType::CPU);
  const auto bytes = static_cast<std::int64_t>(slots_) * static_cast<std::int64_t>(slot_bytes);
  ring_ = torch::stable::empty({bytes}, ScalarType::Byte, std::nullopt, where);
  slot_bytes_ = slot_bytes;
  return true;
}

void AdamWStreamer::step(const std::vector<StreamedParam>& params, const optim::AdamWScalars& s) {
  for (std::size_t i = 0; i < params.size(); ++i) check_param(params[i], i, device_, s.amsgrad, chunk_numel_);
  if (params.empty()) return;
  std::vector<optim::StreamedArrays> arrays;
  for (const StreamedParam& p : params) {
    optim::StreamedArrays a;
    a.numel = p.param.numel();
    a.param = p.param.mutable_data_ptr();
    a.param_type = element_type_of(p.param);
    a.grad = p.grad.const_data_ptr();
    a.grad_type = element_type_of(p.grad);
    a.master = p.master ? p.master->mutable_data_ptr<float>() : nullptr;
    a.quant8 = p.exp_avg_absmax.has_value();
    if (a.quant8) {
      a.exp_avg8 = {p.exp_avg.mutable_data_ptr<std::uint8_t>(), p.exp_avg_absmax->mutable_data_ptr<float>()};
      a.exp_avg_sq8 = {p.exp_avg_sq.mutable_data_ptr<std::uint8_t>(), p.exp_avg_sq_absmax->mutable_data_ptr<float>()};
      if (p.max_exp_avg_sq) {
        a.max_exp_avg_sq8 = {p.max_exp_avg_sq->mutable_data_ptr<std::uint8_t>(),
                             p.max_exp_avg_sq_absmax->mutable_data_ptr<float>()};
      }
    } else {
      a.exp_avg = p.exp_avg.mutable_data_ptr<float>();
      a.exp_avg_sq = p.exp_avg_sq.mutable_data_ptr<float>();
      a.max_exp_avg_sq = p.max_exp_avg_sq ? p.max_exp_avg_sq->mutable_data_ptr<float>() : nullptr;
    }
    arrays.push_back(a);
  }
  const bool host = device_ < 0;
  std::optional<rt::DeviceGuard> guard;
  if (!host) guard.emplace(device_);
  const bool fresh = ensure_ring(optim::adamw_slot_bytes(arrays, s.amsgrad, chunk_numel_));
  // The kernel runs where the gradient was produced and the next forward reads the parameter.
  std::unique_ptr<schedule::Stream> compute;
  if (host) {
    compute = std::make_unique<schedule::ImmediateStream>("cpu adamw step", tracing::host_spans());
  } else {
    compute = std::make_unique<gpu::GpuStream>(device_, current_torch_stream(device_),
                                               "gpu:" + std::to_string(device_) + " current stream");
  }
  for (const StreamedParam& p : params) {
    for (const auto* t : {&p.exp_avg, &p.exp_avg_sq}) in_flight_.push_back(*t);
    for (const auto* t :
         {&p.master, &p.max_exp_avg_sq, &p.exp_avg_absmax, &p.exp_avg_sq_absmax, &p.max_exp_avg_sq_absmax}) {
      if (t->has_value()) in_flight_.push_back(**t);
    }
  }
  const int device = device_;
  optim::AdamWLaunchers launch;
  launch.float32 = [device](const optim::AdamWArrays& a, const optim::AdamWScalars& sc, std::int64_t n,
                            schedule::NativeStream stream) { gpu::launch_adamw(a, sc, n, stream, device); };
  launch.quant8 = [device](const optim::AdamW8bitArrays& a, const optim::AdamWScalars& sc, std::int64_t n,
                           schedule::NativeStream stream) { gpu::launch_adamw8bit(a, sc, n, stream, device); };
  pipeline_.step(arrays, s, optim::AdamWStreams{*in_, *compute, *out_}, ring_.mutable_data_ptr(), slot_bytes_, fresh,
                 launch);
}

void bind_adamw_streamer(py::module_& m) {
  py::class_<AdamWStreamer>(m, "AdamWStreamer",
                            "GPU-streamed AdamW: host state through a ring of device buffers (OffloadAdamW's "
                            "step_on='gpu' engine).")
      .def(py::init([](int device, std::int64_t chunk_numel, int slots) {
             return translate_errors([&] {
               HF_CHECK_VALUE(device >= -1, "AdamWStreamer: device must be a GPU index or -1 (host mode), got ",
                              device);
               HF_CHECK_VALUE(chunk_numel >= 1, "AdamWStreamer: chunk_numel must be >= 1, got ", chunk_numel);
               HF_CHECK_VALUE(slots >= 2, "AdamWStreamer: slots must be >= 2, got ", slots);
               return std::make_unique<AdamWStreamer>(device, chunk_numel, slots);
             });
           }),
           py::arg("device"), py::arg("chunk_numel"), py::arg("slots"))
      .def(
          "step",
          [](AdamWStreamer& self, py::object params_in, py::object grads_in, py::object masters_in,
             py::object exp_avgs_in, py::object exp_avg_sqs_in, py::object maxes_in, std::int64_t step, double lr,
             double beta1, double beta2, double eps, double weight_decay, bool amsgrad, bool maximize,
             py::object m_scales_in, py::object v_scales_in, py::object max_scales_in) {
            translate_errors([&] {
              // Converted with the GIL; every tensor here dies after it is taken back (declared before no_gil).
              const std::vector<Tensor> params = tensors_from_python(params_in, "AdamWStreamer.step: params");
              const std::vector<Tensor> grads = tensors_from_python(grads_in, "AdamWStreamer.step: grads");
              const std::vector<Tensor> masters = tensors_from_python(masters_in, "AdamWStreamer.step: masters", true);
              const std::vector<Tensor> exp_avgs = tensors_from_python(exp_avgs_in, "AdamWStreamer.step: exp_avgs");
              const std::vector<Tensor> exp_avg_sqs =
                  tensors_from_python(exp_avg_sqs_in, "AdamWStreamer.step: exp_avg_sqs");
              const std::vector<Tensor> maxes =
                  tensors_from_python(maxes_in, "AdamWStreamer.step: max_exp_avg_sqs", true);
              const std::size_t n = params.size();
              // The scales of 8-bit moments: a list with None for float32 moments, or None for all.
              const auto scales = [n](py::object in, const char* name) {
                return in.is_none() ? std::vector<Tensor>(n) : tensors_from_python(in, name, true);
              };
              const std::vector<Tensor> m_scales = scales(m_scales_in, "AdamWStreamer.step: exp_avg_absmaxes");
              const std::vector<Tensor> v_scales = scales(v_scales_in, "AdamWStreamer.step: exp_avg_sq_absmaxes");
              const std::vector<Tensor> max_scales =
                  scales(max_scales_in, "AdamWStreamer.step: max_exp_avg_sq_absmaxes");
              HF_CHECK_VALUE(grads.size() == n && masters.size() == n && exp_avgs.size() == n &&
                                 exp_avg_sqs.size() == n && maxes.size() == n && m_scales.size() == n &&
                                 v_scales.size() == n && max_scales.size() == n,
                             "AdamWStreamer.step: every list must have one entry per parameter (", n, ")");
              HF_CHECK_VALUE(step >= 1, "AdamWStreamer.step: step must be >= 1, got ", step);
              // None (an undefined tensor) is an absent master / max_exp_avg_sq.
              const auto present = [](const Tensor& t) {
                return t.defined() ? std::optional<Tensor>(t) : std::nullopt;
              };
              std::vector<StreamedParam> ps;
              ps.reserve(n);
              for (std::size_t i = 0; i < n; ++i) {
                ps.push_back(StreamedParam{params[i], grads[i], present(masters[i]), exp_avgs[i], exp_avg_sqs[i],
                                           present(maxes[i]), present(m_scales[i]), present(v_scales[i]),
                                           present(max_scales[i])});
              }
              const optim::AdamWHyper h{lr, beta1, beta2, eps, weight_decay, amsgrad, maximize};
              py::gil_scoped_release no_gil;
              self.step(ps, optim::adamw_scalars(h, step));
            });
          },
          py::arg("params"), py::arg("grads"), py::arg("masters"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"),
          py::arg("max_exp_avg_sqs"), py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
          py::arg("eps"), py::arg("weight_decay"), py::arg("amsgrad"), py::arg("maximize"),
          py::arg("exp_avg_absmaxes") = py::none(), py::arg("exp_avg_sq_absmaxes") = py::none(),
          py::arg("max_exp_avg_sq_absmaxes") = py::none())
      .def("synchronize",
           [](AdamWStreamer& self) {
             translate_errors([&] {
               py::gil_scoped_release no_gil;
               self.synchronize();
             });
           })
      .def_property_readonly("ring_bytes", &AdamWStreamer::ring_bytes)
      .def_property_readonly("device", &AdamWStreamer::device)
      .def_property_readonly("chunk_numel", &AdamWStreamer::chunk_numel)
      .def_property_readonly("slots", &AdamWStreamer::slots);
}

}  // namespace hipferry
