// AdamWStreamer (see Note [GPU-streamed AdamW] in adamw_streamer.h) and its
// binding hipferry._C.AdamWStreamer, driven by hipferry.optim.OffloadAdamW.
#include "torch/adamw_streamer.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>

#include "adamw_kernel.h"
#include "torch/copy_cast_checks.h"
#include "torch/current_stream.h"
#include "torch/python_errors.h"

namespace py = pybind11;

namespace hipferry {
namespace {

std::vector<std::unique_ptr<rt::Event>> make_events(int device, int n) {
  std::vector<std::unique_ptr<rt::Event>> out;
  for (int i = 0; i < n; ++i) out.push_back(std::make_unique<rt::Event>(device));
  return out;
}

void check_host_state(const at::Tensor& t, const char* name, std::size_t index, std::int64_t numel) {
  TORCH_CHECK_VALUE(t.is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == numel,
                    "AdamWStreamer.step: ", name, "[", index, "] must be a contiguous float32 host tensor with ",
                    numel, " elements; got ", t.scalar_type(), " on ", t.device(), " with ", t.numel(),
                    " elements");
}

void check_param(const StreamedParam& p, std::size_t i, int device, bool amsgrad) {
  const at::Tensor& param = p.param;
  TORCH_CHECK_VALUE(param.is_cuda() && param.device().index() == device && param.is_contiguous(),
                    "AdamWStreamer.step: params[", i, "] must be a contiguous tensor on cuda:", device, "; got ",
                    param.device());
  const bool low = param.scalar_type() == at::kHalf || param.scalar_type() == at::kBFloat16;
  TORCH_CHECK_VALUE(low || param.scalar_type() == at::kFloat, "AdamWStreamer.step: params[", i, "] has dtype ",
                    param.scalar_type(), "; expected float32, float16 or bfloat16");
  TORCH_CHECK_VALUE(low == p.master.has_value(), "AdamWStreamer.step: params[", i, "] is ", param.scalar_type(),
                    low ? " and needs" : " and must not have", " a float32 master");
  const auto gt = p.grad.scalar_type();
  TORCH_CHECK_VALUE(p.grad.device() == param.device() && p.grad.is_contiguous() &&
                        p.grad.numel() == param.numel() &&
                        (gt == at::kFloat || gt == at::kHalf || gt == at::kBFloat16),
                    "AdamWStreamer.step: grads[", i, "] must be a contiguous float tensor on ", param.device(),
                    " with ", param.numel(), " elements");
  if (p.master) check_host_state(*p.master, "masters", i, param.numel());
  check_host_state(p.exp_avg, "exp_avgs", i, param.numel());
  check_host_state(p.exp_avg_sq, "exp_avg_sqs", i, param.numel());
  TORCH_CHECK_VALUE(amsgrad == p.max_exp_avg_sq.has_value(), "AdamWStreamer.step: max_exp_avg_sqs[", i, "] ",
                    amsgrad ? "is needed with amsgrad" : "must be None without amsgrad");
  if (p.max_exp_avg_sq) check_host_state(*p.max_exp_avg_sq, "max_exp_avg_sqs", i, param.numel());
}

}  // namespace

AdamWStreamer::AdamWStreamer(int device, std::int64_t chunk_numel, int slots)
    : device_(device),
      chunk_numel_(chunk_numel),
      slots_(slots),
      in_(device),
      out_(device),
      loaded_(make_events(device, slots)),
      computed_(make_events(device, slots)),
      free_(make_events(device, slots)),
      free_recorded_(static_cast<std::size_t>(slots), false),
      finished_(device) {}

AdamWStreamer::~AdamWStreamer() {
  try {
    synchronize();
  } catch (...) {
    // A failed device is reported by the next call on it; the ring must still go.
  }
}

void AdamWStreamer::synchronize() {
  if (finished_recorded_) finished_.synchronize();
}

void AdamWStreamer::ensure_ring(int arrays_per_slot) {
  if (ring_.defined() && arrays_per_slot <= arrays_per_slot_) return;
  synchronize();  // the old ring may still be read or written by the last step
  ring_ = at::Tensor();
  ring_ = at::empty({slots_ * arrays_per_slot * chunk_numel_},
                    at::TensorOptions().dtype(at::kFloat).device(at::Device(at::kCUDA, device_)));
  arrays_per_slot_ = arrays_per_slot;
}

void AdamWStreamer::step(const std::vector<StreamedParam>& params, const optim::AdamWScalars& s) {
  int arrays = 2 + (s.amsgrad ? 1 : 0);
  for (std::size_t i = 0; i < params.size(); ++i) {
    check_param(params[i], i, device_, s.amsgrad);
    if (params[i].master) arrays = 3 + (s.amsgrad ? 1 : 0);
  }
  if (params.empty()) return;
  rt::DeviceGuard guard(device_);
  ensure_ring(arrays);
  const rt::StreamHandle compute = current_torch_stream(device_);
  float* ring = ring_.data_ptr<float>();
  const std::size_t slot_floats = static_cast<std::size_t>(arrays_per_slot_ * chunk_numel_);
  if (finished_recorded_) finished_.block_stream(in_.handle());

  std::int64_t chunk = 0;
  for (const StreamedParam& p : params) {
    const std::int64_t n = p.param.numel();
    // Host arrays in slot order: master (if any), exp_avg, exp_avg_sq, max (if any).
    std::vector<float*> host;
    if (p.master) host.push_back(p.master->data_ptr<float>());
    host.push_back(p.exp_avg.data_ptr<float>());
    host.push_back(p.exp_avg_sq.data_ptr<float>());
    if (p.max_exp_avg_sq) host.push_back(p.max_exp_avg_sq->data_ptr<float>());
    char* param_bytes = static_cast<char*>(p.param.data_ptr());
    const char* grad_bytes = static_cast<const char*>(p.grad.const_data_ptr());
    for (std::int64_t off = 0; off < n; off += chunk_numel_, ++chunk) {
      const std::int64_t count = std::min(chunk_numel_, n - off);
      const auto k = static_cast<std::size_t>(chunk % slots_);
      float* slot = ring + k * slot_floats;
      std::vector<float*> dev;
      for (std::size_t a = 0; a < host.size(); ++a) dev.push_back(slot + a * chunk_numel_);
      const std::size_t bytes = static_cast<std::size_t>(count) * sizeof(float);

      if (free_recorded_[k]) free_[k]->block_stream(in_.handle());
      for (std::size_t a = 0; a < host.size(); ++a) rt::memcpy_async(dev[a], host[a] + off, bytes, in_.handle());
      loaded_[k]->record(in_.handle());

      loaded_[k]->block_stream(compute);
      optim::AdamWArrays arr;
      std::size_t a = 0;
      if (p.master) {
        arr.param = dev[a++];
        arr.param_out = param_bytes + off * p.param.element_size();
        arr.out_type = element_type_of(p.param);
      } else {
        arr.param = reinterpret_cast<float*>(param_bytes) + off;
      }
      arr.exp_avg = dev[a++];
      arr.exp_avg_sq = dev[a++];
      if (p.max_exp_avg_sq) arr.max_exp_avg_sq = dev[a++];
      arr.grad = grad_bytes + off * p.grad.element_size();
      arr.grad_type = element_type_of(p.grad);
      gpu::launch_adamw(arr, s, count, compute, device_);
      computed_[k]->record(compute);

      computed_[k]->block_stream(out_.handle());
      for (std::size_t b = 0; b < host.size(); ++b) rt::memcpy_async(host[b] + off, dev[b], bytes, out_.handle());
      free_[k]->record(out_.handle());
      free_recorded_[k] = true;
    }
  }
  finished_.record(out_.handle());
  finished_recorded_ = true;
}

void bind_adamw_streamer(py::module_& m) {
  py::class_<AdamWStreamer>(m, "AdamWStreamer",
                            "GPU-streamed AdamW: host state through a ring of device buffers (OffloadAdamW's "
                            "step_on='gpu' engine).")
      .def(py::init([](int device, std::int64_t chunk_numel, int slots) {
             return translate_errors([&] {
               TORCH_CHECK_VALUE(chunk_numel >= 1, "AdamWStreamer: chunk_numel must be >= 1, got ", chunk_numel);
               TORCH_CHECK_VALUE(slots >= 2, "AdamWStreamer: slots must be >= 2, got ", slots);
               return std::make_unique<AdamWStreamer>(device, chunk_numel, slots);
             });
           }),
           py::arg("device"), py::arg("chunk_numel"), py::arg("slots"))
      .def(
          "step",
          [](AdamWStreamer& self, const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
             const std::vector<std::optional<at::Tensor>>& masters, const std::vector<at::Tensor>& exp_avgs,
             const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<std::optional<at::Tensor>>& maxes,
             std::int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay, bool amsgrad,
             bool maximize) {
            translate_errors([&] {
              const std::size_t n = params.size();
              TORCH_CHECK_VALUE(grads.size() == n && masters.size() == n && exp_avgs.size() == n &&
                                    exp_avg_sqs.size() == n && maxes.size() == n,
                                "AdamWStreamer.step: every list must have one entry per parameter (", n, ")");
              TORCH_CHECK_VALUE(step >= 1, "AdamWStreamer.step: step must be >= 1, got ", step);
              std::vector<StreamedParam> ps(n);
              for (std::size_t i = 0; i < n; ++i)
                ps[i] = StreamedParam{params[i], grads[i], masters[i], exp_avgs[i], exp_avg_sqs[i], maxes[i]};
              optim::AdamWHyper h;
              h.lr = lr;
              h.beta1 = beta1;
              h.beta2 = beta2;
              h.eps = eps;
              h.weight_decay = weight_decay;
              h.amsgrad = amsgrad;
              h.maximize = maximize;
              py::gil_scoped_release no_gil;
              self.step(ps, optim::adamw_scalars(h, step));
            });
          },
          py::arg("params"), py::arg("grads"), py::arg("masters"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"),
          py::arg("max_exp_avg_sqs"), py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
          py::arg("eps"), py::arg("weight_decay"), py::arg("amsgrad"), py::arg("maximize"))
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
