// AdamWStreamer (see Note [GPU-streamed AdamW] in adamw_streamer.h) and its
// binding hipferry._C.AdamWStreamer, driven by hipferry.optim.OffloadAdamW.
#include "torch/adamw_streamer.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>

#include "adamw_kernel.h"
#include "optim/adamw_cpu.h"
#include "torch/copy_cast_checks.h"
#include "torch/current_stream.h"
#include "torch/python_errors.h"

namespace py = pybind11;

namespace hipferry {
namespace {

// Host mode (device -1) has no streams or events: every operation below is
// then done at once on the calling thread, in the same order.
std::vector<std::unique_ptr<rt::Event>> make_events(int device, int n) {
  std::vector<std::unique_ptr<rt::Event>> out;
  for (int i = 0; i < n; ++i) out.push_back(device >= 0 ? std::make_unique<rt::Event>(device) : nullptr);
  return out;
}

rt::StreamHandle handle_of(const std::unique_ptr<rt::Stream>& s) { return s ? s->handle() : nullptr; }

void record(const std::unique_ptr<rt::Event>& e, rt::StreamHandle stream) {
  if (e) e->record(stream);
}

void wait(const std::unique_ptr<rt::Event>& e, rt::StreamHandle stream) {
  if (e) e->block_stream(stream);
}

void check_host_state(const at::Tensor& t, const char* name, std::size_t index, std::int64_t numel) {
  TORCH_CHECK_VALUE(t.is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == numel,
                    "AdamWStreamer.step: ", name, "[", index, "] must be a contiguous float32 host tensor with ",
                    numel, " elements; got ", t.scalar_type(), " on ", t.device(), " with ", t.numel(),
                    " elements");
}

void check_param(const StreamedParam& p, std::size_t i, int device, bool amsgrad) {
  const at::Tensor& param = p.param;
  const bool placed = device < 0 ? param.is_cpu() : param.is_cuda() && param.device().index() == device;
  TORCH_CHECK_VALUE(placed && param.is_contiguous(), "AdamWStreamer.step: params[", i,
                    "] must be a contiguous tensor on ", device < 0 ? std::string("the CPU (host mode)")
                                                                    : "cuda:" + std::to_string(device),
                    "; got ", param.device());
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
      in_(device >= 0 ? std::make_unique<rt::Stream>(device) : nullptr),
      out_(device >= 0 ? std::make_unique<rt::Stream>(device) : nullptr),
      loaded_(make_events(device, slots)),
      computed_(make_events(device, slots)),
      free_(make_events(device, slots)),
      free_recorded_(static_cast<std::size_t>(slots), false),
      finished_(device >= 0 ? std::make_unique<rt::Event>(device) : nullptr) {}

AdamWStreamer::~AdamWStreamer() {
  try {
    synchronize();
  } catch (...) {
    // A failed device is reported by the next call on it; the ring must still go.
  }
}

void AdamWStreamer::synchronize() {
  if (finished_recorded_ && finished_) finished_->synchronize();
  in_flight_.clear();
}

void AdamWStreamer::ensure_ring(int arrays_per_slot) {
  if (ring_.defined() && arrays_per_slot <= arrays_per_slot_) return;
  synchronize();  // the old ring may still be read or written by the last step
  ring_ = at::Tensor();
  const at::Device where = device_ >= 0 ? at::Device(at::kCUDA, device_) : at::Device(at::kCPU);
  ring_ = at::empty({slots_ * arrays_per_slot * chunk_numel_}, at::TensorOptions().dtype(at::kFloat).device(where));
  arrays_per_slot_ = arrays_per_slot;
  if (device_ >= 0) {
    // torch's allocator orders this memory after the current stream only; our
    // copies run on in_, so in_ waits for what the current stream has queued.
    rt::Event allocated(device_);
    allocated.record(current_torch_stream(device_));
    allocated.block_stream(in_->handle());
  }
}

void AdamWStreamer::step(const std::vector<StreamedParam>& params, const optim::AdamWScalars& s) {
  int arrays = 2 + (s.amsgrad ? 1 : 0);
  for (std::size_t i = 0; i < params.size(); ++i) {
    check_param(params[i], i, device_, s.amsgrad);
    if (params[i].master) arrays = 3 + (s.amsgrad ? 1 : 0);
  }
  if (params.empty()) return;
  const bool host = device_ < 0;
  std::optional<rt::DeviceGuard> guard;
  if (!host) guard.emplace(device_);
  ensure_ring(arrays);
  const rt::StreamHandle compute = host ? nullptr : current_torch_stream(device_);
  const rt::StreamHandle in = handle_of(in_), out = handle_of(out_);
  const auto copy = [host](void* dst, const void* src, std::size_t bytes, rt::StreamHandle stream) {
    host ? static_cast<void>(std::memcpy(dst, src, bytes)) : rt::memcpy_async(dst, src, bytes, stream);
  };
  float* ring = ring_.data_ptr<float>();
  const std::size_t slot_floats = static_cast<std::size_t>(arrays_per_slot_ * chunk_numel_);
  if (finished_recorded_) wait(finished_, in);

  std::int64_t chunk = 0;
  for (const StreamedParam& p : params) {
    const std::int64_t n = p.param.numel();
    // Host arrays in slot order: master (if any), exp_avg, exp_avg_sq, max (if any).
    for (const auto* t : {&p.exp_avg, &p.exp_avg_sq}) in_flight_.push_back(*t);
    if (p.master) in_flight_.push_back(*p.master);
    if (p.max_exp_avg_sq) in_flight_.push_back(*p.max_exp_avg_sq);
    std::vector<float*> state;
    if (p.master) state.push_back(p.master->data_ptr<float>());
    state.push_back(p.exp_avg.data_ptr<float>());
    state.push_back(p.exp_avg_sq.data_ptr<float>());
    if (p.max_exp_avg_sq) state.push_back(p.max_exp_avg_sq->data_ptr<float>());
    char* param_bytes = static_cast<char*>(p.param.data_ptr());
    const char* grad_bytes = static_cast<const char*>(p.grad.const_data_ptr());
    for (std::int64_t off = 0; off < n; off += chunk_numel_, ++chunk) {
      const std::int64_t count = std::min(chunk_numel_, n - off);
      const auto k = static_cast<std::size_t>(chunk % slots_);
      float* slot = ring + k * slot_floats;
      std::vector<float*> dev;
      for (std::size_t a = 0; a < state.size(); ++a) dev.push_back(slot + a * chunk_numel_);
      const std::size_t bytes = static_cast<std::size_t>(count) * sizeof(float);

      if (free_recorded_[k]) wait(free_[k], in);
      for (std::size_t a = 0; a < state.size(); ++a) copy(dev[a], state[a] + off, bytes, in);
      record(loaded_[k], in);

      wait(loaded_[k], compute);
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
      if (host) {
        optim::adamw_cpu(arr, s, 0, count);
      } else {
        gpu::launch_adamw(arr, s, count, compute, device_);
      }
      record(computed_[k], compute);

      wait(computed_[k], out);
      for (std::size_t b = 0; b < state.size(); ++b) copy(state[b] + off, dev[b], bytes, out);
      record(free_[k], out);
      free_recorded_[k] = true;
    }
  }
  record(finished_, out);
  finished_recorded_ = true;
}

void bind_adamw_streamer(py::module_& m) {
  py::class_<AdamWStreamer>(m, "AdamWStreamer",
                            "GPU-streamed AdamW: host state through a ring of device buffers (OffloadAdamW's "
                            "step_on='gpu' engine).")
      .def(py::init([](int device, std::int64_t chunk_numel, int slots) {
             return translate_errors([&] {
               TORCH_CHECK_VALUE(device >= -1, "AdamWStreamer: device must be a GPU index or -1 (host mode), got ",
                                 device);
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
              const optim::AdamWHyper h{.lr = lr, .beta1 = beta1, .beta2 = beta2, .eps = eps,
                                        .weight_decay = weight_decay, .amsgrad = amsgrad, .maximize = maximize};
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
