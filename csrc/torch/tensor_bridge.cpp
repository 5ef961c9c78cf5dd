// The tensor bridge (Note [tensor bridge] in tensor_bridge.h).
#include "csrc/torch/tensor_bridge.h"

#include <dlfcn.h>
#include <torch/csrc/stable/library.h>

#include <cstdlib>
#include <mutex>
#include <unordered_map>

#include "csrc/core/errors.h"

namespace py = pybind11;

namespace hipferry {
namespace {

using FromPyObject = AOTITorchError (*)(void* py_obj, AtenTensorHandle* ret);
using ToPyObject = AOTITorchError (*)(AtenTensorHandle ath, void* py_type, void** ret);

struct Shims {
  FromPyObject from = nullptr;
  ToPyObject to = nullptr;
};

// The loaded libtorch's Python interop shims, or nulls (torch 2.13, or the op
// path asked for). Found through the library that holds a shim we link.
const Shims& shims() {
  static const Shims found = [] {
    Shims s;
    const char* forced = std::getenv("HIPFERRY_TENSOR_BRIDGE");
    if (forced != nullptr && std::string(forced) == "op") return s;
    Dl_info info{};
    if (dladdr(reinterpret_cast<void*>(&torch_call_dispatcher), &info) == 0 || info.dli_fname == nullptr) return s;
    void* lib = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
    if (lib == nullptr) return s;
    s.from = reinterpret_cast<FromPyObject>(dlsym(lib, "torch_tensor_from_pyobject"));
    s.to = reinterpret_cast<ToPyObject>(dlsym(lib, "torch_tensor_to_pyobject"));
    if (s.from == nullptr || s.to == nullptr) s = Shims{};
    return s;  // the handle stays open: libtorch is loaded for the process's life
  }();
  return found;
}

std::mutex table_mutex;  // guards table and next_id
std::unordered_map<std::int64_t, std::vector<Tensor>> table;
std::int64_t next_id = 1;

std::int64_t park(std::vector<Tensor> ts) {
  std::lock_guard<std::mutex> lock(table_mutex);
  const std::int64_t id = next_id++;
  table.emplace(id, std::move(ts));
  return id;
}

std::vector<Tensor> take(std::int64_t id) {
  std::vector<Tensor> ts;
  {
    std::lock_guard<std::mutex> lock(table_mutex);
    auto it = table.find(id);
    HF_CHECK(it != table.end(), "hipferry: internal error, tensor bridge entry ", id, " does not exist");
    ts = std::move(it->second);
    table.erase(it);
  }
  return ts;  // tensors die (if at all) outside the lock
}

// The ops, called through Python by the stash path only.
std::int64_t stash(std::vector<Tensor> tensors) { return park(std::move(tensors)); }
std::vector<Tensor> unstash(std::int64_t id) { return take(id); }

// torch.Tensor, looked up once (the module never unloads: deliberately leaked).
PyObject* tensor_type() {
  static PyObject* type = py::object(py::module_::import("torch").attr("Tensor")).release().ptr();
  return type;
}

py::object bridge_op(const char* name) {
  return py::module_::import("torch").attr("ops").attr("hipferry_bridge").attr(name).attr("default");
}

void check_tensor(py::handle obj, const char* what, std::size_t index, bool indexed) {
  const int is = PyObject_IsInstance(obj.ptr(), tensor_type());
  if (is < 0) throw py::error_already_set();
  if (is == 0) {
    const std::string type = py::str(py::type::handle_of(obj).attr("__name__"));
    if (indexed) HF_CHECK_TYPE(false, what, "[", index, "] is a ", type, "; expected a torch.Tensor");
    HF_CHECK_TYPE(false, what, " is a ", type, "; expected a torch.Tensor");
  }
}

Tensor from_shim(py::handle obj) {
  AtenTensorHandle ath = nullptr;
  check_shim(shims().from(obj.ptr(), &ath), "torch_tensor_from_pyobject");
  return Tensor(ath);
}

}  // namespace

std::string tensor_bridge_kind() { return shims().from != nullptr ? "pyobject shim" : "stash op"; }

Tensor tensor_from_python(py::handle obj, const char* what, bool allow_none) {
  if (allow_none && obj.is_none()) return Tensor();
  check_tensor(obj, what, 0, false);
  if (shims().from != nullptr) return from_shim(obj);
  py::list one;
  one.append(obj);
  std::vector<Tensor> ts = take(bridge_op("stash")(one).cast<std::int64_t>());
  return ts.at(0);
}

std::vector<Tensor> tensors_from_python(py::handle sequence, const char* what, bool allow_none) {
  HF_CHECK_TYPE(PySequence_Check(sequence.ptr()) && !py::isinstance<py::str>(sequence), what,
                " is a ", std::string(py::str(py::type::handle_of(sequence).attr("__name__"))),
                "; expected a list of torch.Tensor");
  py::sequence items = py::reinterpret_borrow<py::sequence>(sequence);
  const std::size_t n = items.size();
  std::vector<Tensor> out;
  out.reserve(n);
  if (shims().from != nullptr) {
    for (std::size_t i = 0; i < n; ++i) {
      py::object obj = items[i];
      if (allow_none && obj.is_none()) {
        out.emplace_back();
        continue;
      }
      check_tensor(obj, what, i, true);
      out.push_back(from_shim(obj));
    }
    return out;
  }
  py::list present;
  std::vector<bool> is_none(n, false);
  for (std::size_t i = 0; i < n; ++i) {
    py::object obj = items[i];
    if (allow_none && obj.is_none()) {
      is_none[i] = true;
      continue;
    }
    check_tensor(obj, what, i, true);
    present.append(obj);
  }
  std::vector<Tensor> parked = take(bridge_op("stash")(present).cast<std::int64_t>());
  std::size_t next = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (is_none[i]) {
      out.emplace_back();
    } else {
      out.push_back(std::move(parked.at(next++)));
    }
  }
  return out;
}

py::object tensor_to_python(const Tensor& t) {
  if (!t.defined()) return py::none();
  if (shims().to != nullptr) {
    void* raw = nullptr;
    check_shim(shims().to(t.get(), nullptr, &raw), "torch_tensor_to_pyobject");
    return py::reinterpret_steal<py::object>(static_cast<PyObject*>(raw));
  }
  return tensors_to_python({t})[0];
}

py::list tensors_to_python(const std::vector<Tensor>& ts) {
  if (shims().to != nullptr) {
    py::list out;
    for (const Tensor& t : ts) out.append(tensor_to_python(t));
    return out;
  }
  const std::int64_t id = park(ts);
  try {
    return bridge_op("unstash")(id);
  } catch (...) {
    try {
      take(id);
    } catch (...) {
    }
    throw;
  }
}

}  // namespace hipferry

// The stash ops (hipferry_bridge, apart from hipferry's public ops: internal,
// never traced, no fake kernels).
STABLE_TORCH_LIBRARY(hipferry_bridge, m) {
  m.def("stash(Tensor[] tensors) -> int");
  m.def("unstash(int id) -> Tensor[]");
}
STABLE_TORCH_LIBRARY_IMPL(hipferry_bridge, CompositeExplicitAutograd, m) {
  m.impl("stash", TORCH_BOX(&hipferry::stash));
  m.impl("unstash", TORCH_BOX(&hipferry::unstash));
}
