// Python bindings of the transfer engine and of hipferry.trace()
// (hipferry._C.start_prefetch/start_offload/Transfer/transfer_stats/trace_*).
// python/hipferry/transfer.py and trace.py are the public wrappers.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <stdexcept>
#include <string>

#include "csrc/torch/python_errors.h"
#include "csrc/torch/stable.h"
#include "csrc/torch/tensor_bridge.h"
#include "csrc/torch/transfer_engine.h"
#include "hip/trace_session.h"

namespace py = pybind11;

namespace hipferry {
namespace {

// Called with the GIL held: the arguments are read (tensors through the
// bridge) with it, then the GIL is released for the transfer's start, which
// may wait (pool capacity, a producer event) and lets go of tensors.
// `device`: a torch.device or its spelling; `dtype`: None or a torch.dtype;
// `negative_views`: whether a source may be a torch._neg_view (see TransferRequest).
// `source_names`: None, or a callable i -> what errors call source i (the
// caller's structure); asked only when a check fails, with the GIL taken back.
std::shared_ptr<Transfer> start(TransferKind kind, py::handle sources, py::handle device, py::handle dtype,
                                std::int64_t pool_id, bool negative_views, py::handle source_names) {
  return translate_errors([&] {
    const bool prefetch = kind == TransferKind::kPrefetch;
    TransferRequest r;
    r.kind = kind;
    r.sources = tensors_from_python(sources, prefetch ? "hipferry.prefetch: tensors" : "hipferry.offload: tensors");
    if (prefetch) r.device = parse_device(py::str(device), "hipferry.prefetch: device");
    if (!dtype.is_none()) {
      r.dtype = parse_dtype(py::str(dtype), prefetch ? "hipferry.prefetch: dtype" : "hipferry.offload: dtype");
    }
    r.pool_id = pool_id;
    r.may_have_negative_views = negative_views;
    if (!source_names.is_none()) {
      // A borrowed handle: the caller holds it, and r dies before this call returns.
      r.source_name = [source_names](std::size_t i) {
        py::gil_scoped_acquire gil;
        try {
          return py::str(source_names(i)).cast<std::string>();
        } catch (const py::error_already_set&) {  // (dropped here, with the GIL)
          return "tensors[" + std::to_string(i) + "]";
        }
      };
    }
    py::gil_scoped_release no_gil;
    return start_transfer(std::move(r));
  });
}

// Hands the results over: (list of tensors, whether each must be recorded on
// the current stream), see Transfer::Waited. The wait runs without the GIL;
// the results cross into Python with it.
py::tuple wait(Transfer& t) {
  return translate_errors([&] {
    Transfer::Waited waited;
    {
      py::gil_scoped_release no_gil;
      waited = t.wait();
    }
    return py::make_tuple(tensors_to_python(waited.results), waited.record_on_current_stream);
  });
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
  // wait() returns (results, record_on_current_stream): python/hipferry/transfer.py
  // records the results on the current stream when told to.
  py::class_<Transfer, std::shared_ptr<Transfer>>(m, "Transfer")
      .def("wait", &wait)
      .def(
          "ready", [](Transfer& t) { return translate_errors([&] { return t.ready(); }); },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "synchronize", [](Transfer& t) { translate_errors([&] { t.synchronize(); }); },
          py::call_guard<py::gil_scoped_release>())
      .def_property_readonly(
          "device",  // a torch.device
          [](const Transfer& t) { return py::module_::import("torch").attr("device")(device_name(t.device())); })
      .def_property_readonly("nbytes", &Transfer::nbytes)
      .def_property_readonly("num_tensors", &Transfer::num_tensors);
  // start_*: the GIL is released once the arguments are read (see start).
  m.def(
      "start_prefetch",
      [](py::object sources, py::object device, py::object dtype, std::int64_t pool, bool negative_views,
         py::object source_names) {
        return start(TransferKind::kPrefetch, sources, device, dtype, pool, negative_views, source_names);
      },
      py::arg("sources"), py::arg("device"), py::arg("dtype"), py::arg("pool"), py::arg("negative_views") = true,
      py::arg("source_names") = py::none());
  m.def(
      "start_offload",
      [](py::object sources, py::object dtype, std::int64_t pool, bool negative_views, py::object source_names) {
        return start(TransferKind::kOffload, sources, py::none(), dtype, pool, negative_views, source_names);
      },
      py::arg("sources"), py::arg("dtype"), py::arg("pool"), py::arg("negative_views") = true,
      py::arg("source_names") = py::none());
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
  m.def(
      "transfer_batched_copy",
      [](const std::string& mode) { return translate_errors([&] { return set_batched_copy(mode); }); },
      py::arg("mode") = "");
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
