// Python bindings of the transfer engine and of hipferry.trace()
// (hipferry._C.start_prefetch/start_offload/Transfer/transfer_stats/trace_*).
// python/hipferry/transfer.py and trace.py are the public wrappers.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>  // at::Tensor <-> torch.Tensor, ScalarType, Device

#include <optional>
#include <stdexcept>

#include "csrc/torch/python_errors.h"
#include "hip/trace_session.h"
#include "csrc/torch/transfer_engine.h"

namespace py = pybind11;

namespace hipferry {
namespace {

std::shared_ptr<Transfer> start(TransferKind kind, std::vector<at::Tensor> sources, c10::Device device,
                                std::optional<at::ScalarType> dtype, std::int64_t pool_id) {
  TransferRequest r;
  r.kind = kind;
  r.sources = std::move(sources);
  r.device = device;
  r.dtype = dtype;
  r.pool_id = pool_id;
  return translate_errors([&] { return start_transfer(std::move(r)); });
}

py::tuple trace_stop() {
  tracing::TraceResult r;
  {
    py::gil_scoped_release no_gil;  // waits for the traced host and stream work
    try {
      drain_transfer_worker();
      r = tracing::stop();
    } catch (const std::logic_error& e) {
      throw std::runtime_error(e.what());
    }
  }
  py::list events;
  for (const auto& e : r.events) {
    py::dict d;
    d["name"] = e.name;
    d["category"] = e.category;
    d["track"] = e.track;
    d["start_ns"] = e.start_ns;
    d["end_ns"] = e.end_ns;
    d["bytes"] = e.bytes;
    events.append(d);
  }
  return py::make_tuple(events, r.chrome_json);
}

}  // namespace

void bind_transfers(py::module_& m) {
  // Every method releases the GIL: one may block, and all of them may let go
  // of tensors, which can take the GIL (see Transfer in transfer_engine.h).
  py::class_<Transfer, std::shared_ptr<Transfer>>(m, "Transfer")
      .def("wait", [](Transfer& t) { return translate_errors([&] { return t.wait(); }); },
           py::call_guard<py::gil_scoped_release>())
      .def("ready", [](Transfer& t) { return translate_errors([&] { return t.ready(); }); },
           py::call_guard<py::gil_scoped_release>())
      .def("synchronize", [](Transfer& t) { translate_errors([&] { t.synchronize(); }); },
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("device", &Transfer::device)
      .def_property_readonly("nbytes", &Transfer::nbytes)
      .def_property_readonly("num_tensors", &Transfer::num_tensors);
  m.def("start_prefetch",
        [](std::vector<at::Tensor> sources, c10::Device device, std::optional<at::ScalarType> dtype,
           std::int64_t pool) { return start(TransferKind::kPrefetch, std::move(sources), device, dtype, pool); },
        py::arg("sources"), py::arg("device"), py::arg("dtype"), py::arg("pool"),
        py::call_guard<py::gil_scoped_release>());  // may wait: pool capacity, a producer event
  m.def("start_offload",
        [](std::vector<at::Tensor> sources, std::optional<at::ScalarType> dtype, std::int64_t pool) {
          return start(TransferKind::kOffload, std::move(sources), c10::Device(c10::kCPU), dtype, pool);
        },
        py::arg("sources"), py::arg("dtype"), py::arg("pool"), py::call_guard<py::gil_scoped_release>());
  m.def("transfer_stats", [] {
    const TransferStats s = transfer_stats();
    py::dict d;
    d["transfers"] = s.transfers;
    d["bytes"] = s.bytes;
    d["packed_batches"] = s.packed_batches;
    d["packed_tensors"] = s.packed_tensors;
    d["runtime_batches"] = s.runtime_batches;
    d["staged_chunks"] = s.staged_chunks;
    d["direct_copies"] = s.direct_copies;
    d["worker_tasks"] = s.worker_tasks;
    d["pending_releases"] = s.pending_releases;
    return d;
  });
  m.def("poll_transfer_releases", &poll_transfer_releases);
  m.def("transfer_drain", &drain_transfer_worker, "Waits for every queued host copy.",
        py::call_guard<py::gil_scoped_release>());
  m.def("transfer_batched_copy", [](const std::string& mode) { return translate_errors([&] {
          return set_batched_copy(mode); }); }, py::arg("mode") = "");
  m.def("trace_start", [] {
    try {
      tracing::start();
    } catch (const std::logic_error& e) {
      throw std::runtime_error(e.what());
    }
  });
  m.def("trace_stop", &trace_stop, "Ends the trace: (events, Chrome trace JSON).");
  m.def("trace_active", &tracing::active);
  m.def("trace_now_ns", &tracing::now_ns);
  m.def("trace_add", &tracing::add_host_span, py::arg("name"), py::arg("category"), py::arg("track"),
        py::arg("start_ns"), py::arg("end_ns"), py::arg("bytes") = 0);
}

}  // namespace hipferry
