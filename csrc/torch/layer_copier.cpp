// hipferry._C.LayerCopier: the copies of offload_layers' device ring (Note
// [layer ring] in python/hipferry/module_offload/layer_ring.py) on a copy
// scheduler stream (Note [copy scheduler]). Python keeps the policy (which
// block, which slot, when); this is where the copies run and what they wait for.
//   GPU (device >= 0): a stream of the ring's own. Each start() first waits
//     for the work queued so far on torch's current stream (a copy into a slot
//     is ordered after every kernel that read its previous block), then
//     queues one copy, or one copy_cast kernel reading mapped host memory,
//     per tensor. wait() makes the current stream wait; the host does not.
//   CPU (device -1): a worker thread of the ring's own runs the copies (the
//     vectorized, multi-threaded CPU copy_cast); wait() blocks the host.
// Either way every copy shows on hipferry.trace()'s timeline, on the ring's
// track, and a failed copy fails every later wait() (the scheduler's rule).
#include <pybind11/pybind11.h>

#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "csrc/core/copy_cast_cpu.h"
#include "csrc/core/errors.h"
#include "csrc/core/schedule/host_streams.h"
#include "csrc/core/transfer/serial_worker.h"
#include "csrc/torch/copy_cast_checks.h"
#include "csrc/torch/current_stream.h"
#include "csrc/torch/pinned_pool.h"
#include "csrc/torch/python_errors.h"
#include "csrc/torch/stable.h"
#include "csrc/torch/tensor_bridge.h"
#include "hip/copy_cast_kernel.h"
#include "hip/gpu_stream.h"
#include "hip/trace_session.h"

namespace py = pybind11;

namespace hipferry {
namespace {

// What start() hands back: the copies' completion, and the tensors they use
// (kept until the ticket is let go of, after wait(): the ring's buffers and
// the host weights outlive every copy anyway).
struct CopyTicket {
  std::shared_ptr<schedule::Event> done;
  std::vector<Tensor> tensors;
};

// Bytes per CPU thread piece: one thread converts ~1-2 GB/s.
constexpr std::int64_t kGrainElements = std::int64_t{1} << 18;

class LayerCopier {
 public:
  explicit LayerCopier(int device) : device_(device) {
    if (device >= 0) {
      stream_ = std::make_unique<gpu::GpuStream>(device, "gpu:" + std::to_string(device) + " layer ring stream");
    } else {
      worker_ = std::make_unique<transfer::SerialWorker>("hipferry layer ring");
      stream_ = std::make_unique<schedule::WorkerStream>(*worker_, "cpu layer ring worker", tracing::host_spans());
    }
  }
  ~LayerCopier() {
    try {
      drain();
    } catch (...) {  // a failed copy was reported to its waiters; the stream must still go
    }
  }

  std::shared_ptr<CopyTicket> start(const std::vector<Tensor>& dsts, const std::vector<Tensor>& srcs) {
    HF_CHECK_VALUE(dsts.size() == srcs.size(), "LayerCopier.start: ", dsts.size(), " destinations for ", srcs.size(),
                   " sources; expected one each");
    const bool gpu = device_ >= 0;
    for (std::size_t i = 0; i < dsts.size(); ++i) {  // everything checked before anything is queued
      check_copy_cast_args(dsts[i], srcs[i]);
      HF_CHECK_VALUE(gpu ? dsts[i].is_cuda() && dsts[i].get_device_index() == device_ : dsts[i].is_cpu(),
                     "LayerCopier.start: destination ", i, " is on ", device_name(dsts[i].device()), "; expected ",
                     gpu ? "cuda:" + std::to_string(device_) : std::string("the CPU"));
      HF_CHECK_VALUE(srcs[i].is_cpu(), "LayerCopier.start: source ", i, " is on ", device_name(srcs[i].device()),
                     "; expected host weights");
    }
    auto ticket = std::make_shared<CopyTicket>();
    std::vector<schedule::Work> work;
    for (std::size_t i = 0; i < dsts.size(); ++i) {
      if (dsts[i].numel() == 0) continue;
      work.push_back(copy_of(dsts[i], srcs[i]));  // device addresses resolved (and rejected) here
      ticket->tensors.push_back(dsts[i]);
      ticket->tensors.push_back(srcs[i]);
    }
    std::optional<rt::DeviceGuard> guard;
    if (gpu) {
      guard.emplace(device_);
      gpu::GpuStream current(device_, current_torch_stream(device_), "");
      stream_->wait(current.record());  // after every kernel queued so far (readers of the slot's last block)
    }
    for (schedule::Work& w : work) stream_->enqueue(std::move(w));
    ticket->done = stream_->record();
    if (gpu) {
      for (const Tensor& t : ticket->tensors)
        record_pool_use(t, device_, static_cast<gpu::GpuStream&>(*stream_).handle());
    }
    return ticket;
  }

  bool done(const CopyTicket& t) const { return t.done->query(); }

  void wait(const CopyTicket& t) {
    if (device_ >= 0) {
      rt::DeviceGuard guard(device_);
      gpu::GpuStream current(device_, current_torch_stream(device_), "");
      current.wait(t.done);  // the consumer is the current stream: it waits, the host does not
    } else {
      t.done->synchronize();
    }
  }

  void drain() { stream_->record()->synchronize(); }

 private:
  schedule::Work copy_of(const Tensor& dst, const Tensor& src) {
    schedule::Work w;
    const bool convert = dst.scalar_type() != src.scalar_type();
    const std::size_t bytes = nbytes_of(dst);
    w.label = schedule::Label{convert ? "layer copy_cast" : "layer copy", convert ? "kernel" : "copy", bytes};
    const std::int64_t n = dst.numel();
    // Element types matter to a conversion only (a byte copy may be of any dtype).
    const ElementType st = convert ? element_type_of(src) : ElementType{};
    const ElementType dt = convert ? element_type_of(dst) : ElementType{};
    if (device_ >= 0) {
      void* d = copy_cast_device_address(dst, "dst", device_);
      const void* s = copy_cast_device_address(src, "src", device_);
      const int device = device_;
      w.on_device = [=](schedule::NativeStream stream) {
        if (convert) {
          gpu::launch_copy_cast(s, st, d, dt, n, stream, device);
        } else {
          rt::memcpy_async(d, s, bytes, stream);
        }
      };
    } else {
      void* d = dst.mutable_data_ptr();
      const void* s = src.const_data_ptr();
      const std::size_t src_size = src.element_size(), dst_size = dst.element_size();
      w.on_host = [=] {
        torch::stable::parallel_for(0, n, kGrainElements, [&](std::int64_t lo, std::int64_t hi) {
          const char* from = static_cast<const char*>(s) + lo * static_cast<std::int64_t>(src_size);
          char* to = static_cast<char*>(d) + lo * static_cast<std::int64_t>(dst_size);
          if (convert) {
            copy_cast_cpu(from, st, to, dt, 0, hi - lo);
          } else {
            std::memcpy(to, from, static_cast<std::size_t>(hi - lo) * src_size);
          }
        });
      };
    }
    return w;
  }

  int device_;
  std::unique_ptr<transfer::SerialWorker> worker_;  // CPU only; outlives stream_ (declared first)
  std::unique_ptr<schedule::Stream> stream_;
};

}  // namespace

void bind_layer_copier(py::module_& m) {
  py::class_<CopyTicket, std::shared_ptr<CopyTicket>>(m, "LayerCopyTicket", "Completion of one LayerCopier.start().");
  py::class_<LayerCopier>(m, "LayerCopier", "offload_layers' ring copies on a copy scheduler stream.")
      .def(py::init([](int device) {
             return translate_errors([&] {
               HF_CHECK_VALUE(device >= -1, "LayerCopier: device must be a GPU index or -1 (the CPU), got ", device);
               return std::make_unique<LayerCopier>(device);
             });
           }),
           py::arg("device"))
      .def(
          "start",
          [](LayerCopier& self, py::object dsts_in, py::object srcs_in) {
            return translate_errors([&] {
              // Converted with the GIL; the lists die after it is taken back (declared before no_gil). The
              // ticket's copies die when Python lets go of the ticket, with the GIL.
              const std::vector<Tensor> dsts = tensors_from_python(dsts_in, "LayerCopier.start: dsts");
              const std::vector<Tensor> srcs = tensors_from_python(srcs_in, "LayerCopier.start: srcs");
              py::gil_scoped_release no_gil;
              return self.start(dsts, srcs);
            });
          },
          py::arg("dsts"), py::arg("srcs"))
      .def("done",
           [](LayerCopier& self, const CopyTicket& t) { return translate_errors([&] { return self.done(t); }); })
      .def("wait",
           [](LayerCopier& self, const CopyTicket& t) {
             translate_errors([&] {
               py::gil_scoped_release no_gil;
               self.wait(t);
             });
           })
      .def("drain", [](LayerCopier& self) {
        translate_errors([&] {
          py::gil_scoped_release no_gil;
          self.drain();
        });
      });
}

}  // namespace hipferry
