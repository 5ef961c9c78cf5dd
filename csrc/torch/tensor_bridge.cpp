// The tensor bridge (Note [tensor bridge] in tensor_bridge.h).
#include "csrc/torch/tensor_bridge.h"

#include <dlfcn.h>
#include <torch/csrc/stable/library.h>

#include <cstddef>
#include <cstdlib>
#include <mutex>
#include <string>
#include <unordered_map>

#include "csrc/core/errors.h"

namespace py = pybind11;

namespace hipferry {
namespace {

using FromPyObject = AOTITorchError (*)(void* py_obj, AtenTensorHandle* ret);
using ToPyObject = AOTITorchError (*)(AtenTensorHandle ath, void* py_type, void** ret);
// libtorch_python's THPVariable_Wrap(const at::TensorBase&); a handle points to an at::Tensor.
using WrapTensor = PyObject* (*)(const void* tensor);
constexpr const char* kWrapSymbol = "_Z16THPVariable_WrapRKN2at10TensorBaseE";

// torch 2.13's THPVariable (torch/csrc/autograd/python_variable.h there): the
// header, then the at::Tensor (one intrusive pointer) the object stands for.
struct ThpVariable213 {
  PyObject_HEAD void* cdata;
};

enum class BridgeKind { kShim, kThpVariable213, kStashOp };

struct Bridge {
  BridgeKind kind = BridgeKind::kStashOp;
  FromPyObject from = nullptr;  // kShim
  ToPyObject to = nullptr;      // kShim
  WrapTensor wrap = nullptr;    // kThpVariable213
};

// A library loaded beside the one that holds a shim we link (libtorch_cpu), or null.
void* loaded_torch_library(const char* file_name) {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&torch_call_dispatcher), &info) == 0 || info.dli_fname == nullptr) {
    return nullptr;
  }
  if (file_name == nullptr) return dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  std::string path(info.dli_fname);
  const auto slash = path.rfind('/');
  path = (slash == std::string::npos ? std::string() : path.substr(0, slash + 1)) + file_name;
  return dlopen(path.c_str(), RTLD_LAZY | RTLD_NOLOAD);  // handles stay open: torch is loaded for good
}

AtenTensorHandle borrowed_handle_213(PyObject* obj) {
  return reinterpret_cast<AtenTensorHandle>(reinterpret_cast<char*>(obj) + offsetof(ThpVariable213, cdata));
}

// The 2.13 way, checked on a fresh tensor both ways before it is trusted.
bool thp_variable_213_agrees(WrapTensor wrap) {
  py::object torch = py::module_::import("torch");
  py::object probe = torch.attr("arange")(7);
  AtenTensorHandle owned = nullptr;
  if (aoti_torch_new_tensor_handle(borrowed_handle_213(probe.ptr()), &owned) != AOTI_TORCH_SUCCESS) return false;
  Tensor t(owned);
  if (t.numel() != 7 ||
      reinterpret_cast<std::uintptr_t>(t.const_data_ptr()) != probe.attr("data_ptr")().cast<std::uintptr_t>()) {
    return false;
  }
  py::object back = py::reinterpret_steal<py::object>(wrap(t.get()));
  return back && PyObject_IsInstance(back.ptr(), torch_tensor_type()) == 1 && back.is(probe);  // the same Python object
}

// The bridge of this process (see the Note). Called with the GIL held.
const Bridge& bridge() {
  static const Bridge chosen = [] {
    Bridge b;
    const char* forced = std::getenv("HIPFERRY_TENSOR_BRIDGE");
    if (forced != nullptr && std::string(forced) == "op") return b;
    if (void* lib = loaded_torch_library(nullptr)) {
      b.from = reinterpret_cast<FromPyObject>(dlsym(lib, "torch_tensor_from_pyobject"));
      b.to = reinterpret_cast<ToPyObject>(dlsym(lib, "torch_tensor_to_pyobject"));
      if (b.from != nullptr && b.to != nullptr) {
        b.kind = BridgeKind::kShim;
        return b;
      }
      b.from = nullptr;
      b.to = nullptr;
    }
    const std::string version = py::str(py::module_::import("torch").attr("__version__"));
    if (version.rfind("2.13.", 0) != 0) return b;
    if (void* lib = loaded_torch_library("libtorch_python.so")) {
      b.wrap = reinterpret_cast<WrapTensor>(dlsym(lib, kWrapSymbol));
      if (b.wrap != nullptr && thp_variable_213_agrees(b.wrap)) {
        b.kind = BridgeKind::kThpVariable213;
        return b;
      }
      b.wrap = nullptr;
    }
    return b;
  }();
  return chosen;
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

py::object bridge_op(const char* name) {
  return py::module_::import("torch").attr("ops").attr("hipferry_bridge").attr(name).attr("default");
}

void check_tensor(py::handle obj, const char* what, std::size_t index, bool indexed) {
  const int is = PyObject_IsInstance(obj.ptr(), torch_tensor_type());
  if (is < 0) throw py::error_already_set();
  if (is == 0) {
    const std::string type = py::str(py::type::handle_of(obj).attr("__name__"));
    if (indexed) HF_CHECK_TYPE(false, what, "[", index, "] is a ", type, "; expected a torch.Tensor");
    HF_CHECK_TYPE(false, what, " is a ", type, "; expected a torch.Tensor");
  }
}

// One tensor by the shim or the 2.13 layout (not the stash op); `obj` is a torch.Tensor.
Tensor from_direct(py::handle obj) {
  AtenTensorHandle ath = nullptr;
  if (bridge().kind == BridgeKind::kShim) {
    check_shim(bridge().from(obj.ptr(), &ath), "torch_tensor_from_pyobject");
  } else {
    check_shim(aoti_torch_new_tensor_handle(borrowed_handle_213(obj.ptr()), &ath), "aoti_torch_new_tensor_handle");
  }
  return Tensor(ath);
}

bool direct() { return bridge().kind != BridgeKind::kStashOp; }

}  // namespace

// (The module never unloads: the reference is deliberately kept.)
PyObject* torch_tensor_type() {
  static PyObject* type = py::object(py::module_::import("torch").attr("Tensor")).release().ptr();
  return type;
}

void init_tensor_bridge() { (void)bridge(); }

std::string tensor_bridge_kind() {
  switch (bridge().kind) {
    case BridgeKind::kShim: return "pyobject shim";
    case BridgeKind::kThpVariable213: return "torch 2.13 THPVariable";
    case BridgeKind::kStashOp: break;
  }
  return "stash op";
}

Tensor tensor_from_python(py::handle obj, const char* what, bool allow_none) {
  if (allow_none && obj.is_none()) return Tensor();
  check_tensor(obj, what, 0, false);
  if (direct()) return from_direct(obj);
  py::list one;
  one.append(obj);
  std::vector<Tensor> ts = take(bridge_op("stash")(one).cast<std::int64_t>());
  return ts.at(0);
}

std::vector<Tensor> tensors_from_python(py::handle sequence, const char* what, bool allow_none) {
  HF_CHECK_TYPE(PySequence_Check(sequence.ptr()) && !py::isinstance<py::str>(sequence), what, " is a ",
                std::string(py::str(py::type::handle_of(sequence).attr("__name__"))),
                "; expected a list of torch.Tensor");
  py::sequence items = py::reinterpret_borrow<py::sequence>(sequence);
  const std::size_t n = items.size();
  std::vector<Tensor> out;
  out.reserve(n);
  if (direct()) {
    for (std::size_t i = 0; i < n; ++i) {
      py::object obj = items[i];
      if (allow_none && obj.is_none()) {
        out.emplace_back();
        continue;
      }
      check_tensor(obj, what, i, true);
      out.push_back(from_direct(obj));
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
  if (bridge().kind == BridgeKind::kShim) {
    void* raw = nullptr;
    check_shim(bridge().to(t.get(), nullptr, &raw), "torch_tensor_to_pyobject");
    return py::reinterpret_steal<py::object>(static_cast<PyObject*>(raw));
  }
  if (bridge().kind == BridgeKind::kThpVariable213) {
    PyObject* raw = bridge().wrap(t.get());
    if (raw == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(raw);
  }
  return tensors_to_python({t})[0];
}

py::list tensors_to_python(const std::vector<Tensor>& ts) {
  if (direct()) {
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
