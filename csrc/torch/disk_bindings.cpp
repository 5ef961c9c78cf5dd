// hipferry._C.DiskIo: the disk state store's files and passes
// (csrc/core/disk/state_pass.h) for hipferry/optim/disk/. Python plans the
// layout and keeps the journal; this runs the I/O and the fused step with the
// GIL released, on torch's thread pool.
// Errors: IoFailure -> OSError(errno, message naming file and offset);
// ChecksumMismatch -> hipferry._C.ChecksumError (a RuntimeError).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "csrc/core/disk/crc32c.h"
#include "csrc/core/disk/io_backend.h"
#include "csrc/core/disk/io_queue.h"
#include "csrc/core/disk/state_file.h"
#include "csrc/core/disk/state_pass.h"
#include "csrc/core/errors.h"
#include "csrc/torch/disk_bindings.h"
#include "csrc/torch/python_errors.h"
#include "csrc/torch/stable.h"
#include "csrc/torch/tensor_bridge.h"

namespace py = pybind11;

namespace hipferry {
namespace {

DiskBackendWrapper g_backend_wrapper = nullptr;

constexpr const char* kFn = "hipferry DiskIo.run_pass: ";

disk::StateFormat format_of(const std::string& f) {
  HF_CHECK_VALUE(f == "float32" || f == "uint8", kFn, "format must be 'float32' or 'uint8', got '", f, "'");
  return f == "float32" ? disk::StateFormat::kFloat32 : disk::StateFormat::kUint8;
}

disk::PassKind kind_of(const std::string& k) {
  if (k == "step") return disk::PassKind::kStep;
  if (k == "fill") return disk::PassKind::kFill;
  if (k == "load") return disk::PassKind::kLoad;
  HF_CHECK_VALUE(k == "read", kFn, "kind must be 'step', 'fill', 'load' or 'read', got '", k, "'");
  return disk::PassKind::kRead;
}

// A CPU tensor, contiguous, of at least `bytes` bytes (0: any); undefined when None and allowed.
Tensor cpu_tensor(const py::handle& o, const char* what, std::size_t bytes, bool allow_none = false) {
  Tensor t = tensor_from_python(o, what, allow_none);
  if (!t.defined()) return t;
  HF_CHECK_VALUE(t.is_cpu() && t.is_contiguous(), kFn, what, " must be a contiguous CPU tensor");
  HF_CHECK_VALUE(nbytes_of(t) >= bytes, kFn, what, " has ", nbytes_of(t), " bytes; expected at least ", bytes);
  return t;
}

class DiskIo {
 public:
  DiskIo(const std::string& backend, std::size_t depth, std::size_t request_bytes) : request_bytes_(request_bytes) {
    HF_CHECK_VALUE(depth >= 1 && depth <= 4096, "DiskIo: depth must be in [1, 4096], got ", depth);
    HF_CHECK_VALUE(request_bytes >= 4096 && request_bytes % 4096 == 0,
                   "DiskIo: request_bytes must be a multiple "
                   "of 4096, got ",
                   request_bytes);
    backend_ = disk::make_backend(backend, depth, &note_);
    if (g_backend_wrapper != nullptr) backend_ = g_backend_wrapper(std::move(backend_));
    queue_ = std::make_unique<disk::IoQueue>(*backend_, request_bytes);
  }
  ~DiskIo() { close(); }

  int open(const std::string& path, bool create, bool allow_direct) {
    files_.push_back(std::make_unique<disk::OpenedFile>(disk::open_state_file(path, create, allow_direct)));
    return static_cast<int>(files_.size() - 1);
  }
  py::tuple file_info(int id) const {
    const disk::OpenedFile& f = file(id);
    return py::make_tuple(f.file.path, f.direct, f.note, f.file.fd);
  }
  void reserve(int id, std::uint64_t bytes) { disk::reserve(file(id).file, bytes); }
  void sync(int id) { disk::sync_data(file(id).file); }
  void close() {
    queue_.reset();  // waits for anything in flight
    for (auto& f : files_) disk::close_file(&f->file);
  }

  py::dict counters() const {
    using namespace pybind11::literals;
    const disk::IoCounters& c = queue_->counters();
    return py::dict("bytes_read"_a = c.bytes_read, "bytes_written"_a = c.bytes_written, "requests"_a = c.requests,
                    "short_transfers"_a = c.short_transfers, "max_in_flight"_a = c.max_in_flight);
  }

  void run_pass(const std::string& kind, const std::string& format, bool amsgrad, std::int64_t chunk_numel,
                py::handle window, const py::list& params);
  void raw_pass(const std::string& op, int id, std::uint64_t bytes, py::handle window);

  std::string backend_name() const { return backend_->name(); }
  const std::string& note() const { return note_; }

 private:
  const disk::OpenedFile& file(int id) const {
    HF_CHECK_VALUE(id >= 0 && static_cast<std::size_t>(id) < files_.size(), "DiskIo: no file ", id);
    return *files_[id];
  }
  std::vector<const disk::FileRef*> file_list(const py::handle& ids, std::size_t arrays) const;
  disk::ParamPass param_pass(const py::dict& d, disk::PassKind kind, std::size_t arrays, std::int64_t chunk_numel,
                             std::vector<Tensor>& keep);

  std::size_t request_bytes_;
  std::string note_;
  std::unique_ptr<disk::IoBackend> backend_;
  std::unique_ptr<disk::IoQueue> queue_;
  std::vector<std::unique_ptr<disk::OpenedFile>> files_;
};

using disk::FileRef;

std::vector<const FileRef*> DiskIo::file_list(const py::handle& ids, std::size_t arrays) const {
  std::vector<const FileRef*> out;
  if (ids.is_none()) return out;
  for (const py::handle& id : ids) out.push_back(&file(id.cast<int>()).file);
  HF_CHECK_VALUE(out.size() == arrays, kFn, "a file list has ", out.size(), " entries; expected ", arrays);
  return out;
}

disk::ParamPass DiskIo::param_pass(const py::dict& d, disk::PassKind kind, std::size_t arrays, std::int64_t chunk_numel,
                                   std::vector<Tensor>& keep) {
  disk::ParamPass p;
  p.numel = d["numel"].cast<std::int64_t>();
  p.offsets = d["offsets"].cast<std::vector<std::uint64_t>>();
  auto get = [&](const char* key) { return d.contains(key) ? py::object(d[key]) : py::object(py::none()); };
  p.read_files = file_list(get("read_files"), arrays);
  p.write_files = file_list(get("write_files"), arrays);
  const std::size_t checksums = static_cast<std::size_t>((p.numel + chunk_numel - 1) / chunk_numel) * arrays * 4;
  auto take = [&](const char* key, std::size_t bytes) -> Tensor {
    if (!d.contains(key) || d[key].is_none()) return Tensor();
    keep.push_back(cpu_tensor(d[key], key, bytes));
    return keep.back();
  };
  if (Tensor t = take("crc_in", checksums); t.defined())
    p.crc_in = static_cast<const std::uint32_t*>(t.const_data_ptr());
  if (Tensor t = take("crc_out", checksums); t.defined()) p.crc_out = static_cast<std::uint32_t*>(t.mutable_data_ptr());
  if (Tensor t = take("grad", 0); t.defined()) {
    HF_CHECK_VALUE(t.numel() == p.numel && is_float_convertible(t.scalar_type()), kFn, "grad must hold ", p.numel,
                   " float32/bfloat16/float16 elements");
    p.grad = t.const_data_ptr();
    p.grad_type = element_type_of(t);
  }
  if (Tensor t = take("out", 0); t.defined()) {
    HF_CHECK_VALUE(t.numel() == p.numel && is_float_convertible(t.scalar_type()), kFn, "out must hold ", p.numel,
                   " float32/bfloat16/float16 elements");
    p.out = t.mutable_data_ptr();
    p.out_type = element_type_of(t);
  }
  if (Tensor t = take("source", 0); t.defined()) {
    HF_CHECK_VALUE(t.numel() == p.numel && is_float_convertible(t.scalar_type()), kFn, "source must hold ", p.numel,
                   " float elements");
    p.source = t.const_data_ptr();
    p.source_type = element_type_of(t);
  }
  p.adopt = d.contains("adopt") && d["adopt"].cast<bool>();
  if (kind == disk::PassKind::kStep) {
    const auto hyper = d["hyper"].cast<std::tuple<double, double, double, double, double, bool, bool>>();
    const optim::AdamWHyper h{.lr = std::get<0>(hyper),
                              .beta1 = std::get<1>(hyper),
                              .beta2 = std::get<2>(hyper),
                              .eps = std::get<3>(hyper),
                              .weight_decay = std::get<4>(hyper),
                              .amsgrad = std::get<5>(hyper),
                              .maximize = std::get<6>(hyper)};
    const std::int64_t step = d["step"].cast<std::int64_t>();
    HF_CHECK_VALUE(step >= 1, kFn, "step must be >= 1, got ", step);
    p.scalars = optim::adamw_scalars(h, step);
  }
  if (d.contains("fill_bytes")) p.fill_bytes = d["fill_bytes"].cast<std::vector<std::uint8_t>>();
  for (const char* key : {"sources", "dests"}) {
    if (!d.contains(key)) continue;
    for (const py::handle& o : d[key]) {
      keep.push_back(cpu_tensor(o, key, 0, true));
      void* ptr = keep.back().defined() ? keep.back().mutable_data_ptr() : nullptr;
      if (key[0] == 's')
        p.sources.push_back(ptr);
      else
        p.dests.push_back(ptr);
    }
  }
  return p;
}

void DiskIo::run_pass(const std::string& kind, const std::string& format, bool amsgrad, std::int64_t chunk_numel,
                      py::handle window, const py::list& params) {
  HF_CHECK_VALUE(queue_ != nullptr, "DiskIo: closed");
  disk::PassConfig c;
  c.kind = kind_of(kind);
  c.format = format_of(format);
  c.amsgrad = amsgrad;
  c.chunk_numel = chunk_numel;
  HF_CHECK_VALUE(chunk_numel > 0 && chunk_numel % disk::kChunkQuantum == 0, kFn,
                 "chunk_numel must be a positive multiple of 2^18, got ", chunk_numel);
  const std::size_t arrays = disk::state_arrays(c.format, amsgrad).size();
  std::vector<Tensor> keep;
  std::vector<disk::ParamPass> plan;
  for (const py::handle& d : params) plan.push_back(param_pass(d.cast<py::dict>(), c.kind, arrays, chunk_numel, keep));
  const std::size_t each = disk::pass_buffer_bytes(c, plan);
  Tensor w = cpu_tensor(window, "window", each);
  std::vector<void*> buffers;
  auto* base = static_cast<std::uint8_t*>(w.mutable_data_ptr());
  for (std::size_t at = 0; at + each <= nbytes_of(w); at += each) buffers.push_back(base + at);
  c.parallel = [](std::int64_t n, std::int64_t grain, const std::function<void(std::int64_t, std::int64_t)>& fn) {
    torch::stable::parallel_for(0, n, grain, fn);
  };
  py::gil_scoped_release no_gil;
  try {
    disk::run_state_pass(*queue_, buffers, c, plan);
  } catch (...) {
    // A queue that failed stays failed (Note [no I/O after a failure returns]); the next pass
    // gets a new one over the same backend, which has nothing in flight now.
    queue_ = std::make_unique<disk::IoQueue>(*backend_, request_bytes_);
    throw;
  }
}

// Bytes [0, bytes) of a file read into / written from the window's request-sized
// buffers, the queue kept as deep as the backend allows: what the disk gives this
// I/O path without the state pass's compute (the disk bench's own reader/writer).
void DiskIo::raw_pass(const std::string& op, int id, std::uint64_t bytes, py::handle window) {
  constexpr const char* kRaw = "hipferry DiskIo.raw_pass: ";
  HF_CHECK_VALUE(queue_ != nullptr, "DiskIo: closed");
  HF_CHECK_VALUE(op == "read" || op == "write", kRaw, "op must be 'read' or 'write', got '", op, "'");
  HF_CHECK_VALUE(bytes % 4096 == 0, kRaw, "bytes must be a multiple of 4096 (O_DIRECT), got ", bytes);
  const FileRef& f = file(id).file;
  Tensor w = cpu_tensor(window, "window", request_bytes_);
  auto* base = static_cast<std::uint8_t*>(w.mutable_data_ptr());
  HF_CHECK_VALUE(reinterpret_cast<std::uintptr_t>(base) % 4096 == 0, kRaw, "window must start on a 4096-byte page");
  std::vector<std::uint64_t> free_buffers, done;
  for (std::uint64_t b = 0; b < nbytes_of(w) / request_bytes_; ++b) free_buffers.push_back(b);
  py::gil_scoped_release no_gil;
  try {
    std::uint64_t next = 0;
    while (next < bytes || queue_->pending() > 0) {
      for (; next < bytes && !free_buffers.empty(); free_buffers.pop_back()) {
        const std::uint64_t b = free_buffers.back();
        const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(request_bytes_, bytes - next));
        if (op == "read")
          queue_->read(f, next, base + b * request_bytes_, n, b);
        else
          queue_->write(f, next, base + b * request_bytes_, n, b);
        next += n;
      }
      done.clear();
      queue_->poll(true, &done);
      free_buffers.insert(free_buffers.end(), done.begin(), done.end());
    }
  } catch (...) {
    queue_ = std::make_unique<disk::IoQueue>(*backend_, request_bytes_);  // (as run_pass: a failed queue stays failed)
    throw;
  }
}

}  // namespace

void set_disk_backend_wrapper(DiskBackendWrapper wrapper) { g_backend_wrapper = wrapper; }

void bind_disk(py::module_& m) {
  static py::exception<disk::ChecksumMismatch> checksum_error(m, "ChecksumError", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const disk::IoFailure& e) {
      py::object err = py::module_::import("builtins").attr("OSError")(e.error, e.what());
      PyErr_SetObject(PyExc_OSError, err.ptr());
    } catch (const disk::ChecksumMismatch& e) {
      PyErr_SetString(checksum_error.ptr(), e.what());
    }
  });
  py::class_<DiskIo>(m, "DiskIo")
      .def(py::init<const std::string&, std::size_t, std::size_t>(), py::arg("backend") = "auto", py::arg("depth") = 32,
           py::arg("request_bytes") = std::size_t{1} << 20)
      .def_property_readonly("backend", &DiskIo::backend_name)
      .def_property_readonly("note", &DiskIo::note)
      .def(
          "open",
          [](DiskIo& d, const std::string& path, bool create, bool allow_direct) {
            return translate_errors([&] { return d.open(path, create, allow_direct); });
          },
          py::arg("path"), py::arg("create"), py::arg("allow_direct") = true)
      .def("file_info", &DiskIo::file_info, py::arg("file"), "(path, O_DIRECT?, why not, fd)")
      .def(
          "reserve",
          [](DiskIo& d, int f, std::uint64_t b) {
            py::gil_scoped_release g;
            d.reserve(f, b);
          },
          py::arg("file"), py::arg("bytes"))
      .def(
          "sync",
          [](DiskIo& d, int f) {
            py::gil_scoped_release g;
            d.sync(f);
          },
          py::arg("file"))
      .def("close", &DiskIo::close)
      .def("counters", &DiskIo::counters)
      .def(
          "run_pass",
          [](DiskIo& d, const std::string& kind, const std::string& format, bool amsgrad, std::int64_t chunk_numel,
             py::handle window, const py::list& params) {
            translate_errors([&] { d.run_pass(kind, format, amsgrad, chunk_numel, window, params); });
          },
          py::arg("kind"), py::arg("format"), py::arg("amsgrad"), py::arg("chunk_numel"), py::arg("window"),
          py::arg("params"))
      .def(
          "raw_pass",
          [](DiskIo& d, const std::string& op, int file, std::uint64_t bytes, py::handle window) {
            translate_errors([&] { d.raw_pass(op, file, bytes, window); });
          },
          py::arg("op"), py::arg("file"), py::arg("bytes"), py::arg("window"),
          "Reads or writes bytes [0, bytes) of a file through the queue (no compute): the disk bench's reader/writer.");
  m.def(
      "_disk_regions",
      [](const std::string& format, bool amsgrad, std::int64_t numel) {
        std::vector<std::uint64_t> out;
        for (const auto& f : disk::state_arrays(format_of(format), amsgrad))
          out.push_back(disk::region_bytes(f, numel));
        return out;
      },
      py::arg("format"), py::arg("amsgrad"), py::arg("numel"),
      "Page-rounded bytes of each state array of a parameter.");
  m.def(
      "_disk_chunk_buffer_bytes",
      [](const std::string& format, bool amsgrad, std::int64_t chunk_numel) {
        return disk::chunk_buffer_bytes(format_of(format), amsgrad, chunk_numel);
      },
      py::arg("format"), py::arg("amsgrad"), py::arg("chunk_numel"));
  m.def(
      "_crc32c",
      [](py::handle t, std::uint32_t crc) {
        Tensor x = cpu_tensor(t, "data", 0);
        return disk::crc32c(x.const_data_ptr(), nbytes_of(x), crc);
      },
      py::arg("data"), py::arg("crc") = 0, "CRC-32C of a contiguous CPU tensor's bytes.");
  m.def("_crc32c_hardware", &disk::crc32c_hardware);
}

}  // namespace hipferry
