// The eager fast path of PinnedPool.empty and hipferry.pin
// (hipferry._C.pool_empty_fast, pool_pin_fast).
//
// Note [pool fast path]
// ~~~~~~~~~~~~~~~~~~~~~
// A cached pool allocation costs about 0.1 us in the core; the op
// torch.ops.hipferry.pool_empty costs 2-5 us more from Python (the op call's
// argument parsing, the dispatcher, the stable ABI's boxing). These two
// functions are CPython METH_FASTCALL functions that read plain arguments
// themselves, take the block, make the tensor (from_blob with the pool's
// deleter) and hand it to Python through the tensor bridge: no dispatcher,
// no Python code.
// Invariants:
//   * They return None, having changed nothing, for anything but the plain
//     case (exact ints, a dtype torch has, a pool that is open, a plain dense
//     CPU tensor); the Python wrappers then run their full checks, which
//     raise the clear error, or the op. So every error message stays in one
//     place, and the fast path cannot accept what the checks would refuse.
//   * Errors of the allocation itself (a full pool) are raised as from the op:
//     torch.OutOfMemoryError, the pool unchanged.
//   * Only eager calls come here: tracing (torch.compile) and dispatch modes
//     (FakeTensorMode) take the op, whose fake kernel they need.
#include <Python.h>
#include <pybind11/pybind11.h>

#include <cstring>
#include <utility>
#include <vector>

#include "csrc/core/errors.h"
#include "csrc/torch/pinned_pool.h"
#include "csrc/torch/python_errors.h"
#include "csrc/torch/stable.h"
#include "csrc/torch/tensor_bridge.h"

namespace py = pybind11;

namespace hipferry {
namespace {

// Copies up to this size are one memcpy here; larger ones go to torch's
// copy_ (threaded), where a dispatcher call is nothing beside the copy.
constexpr std::size_t kInlineCopyBytes = 256 << 10;

// Each torch.dtype object hipferry knows, with its ScalarType. dtypes are
// singletons, so a lookup is a pointer comparison. Built on first use (GIL
// held); the references are kept for the process's life.
const std::vector<std::pair<PyObject*, ScalarType>>& dtype_objects() {
  static const auto table = [] {
    std::vector<std::pair<PyObject*, ScalarType>> t;
    py::object torch = py::module_::import("torch");
    for (ScalarType type : known_dtypes()) {
      const std::string name = dtype_name(type).substr(6);  // "torch.float32" -> "float32"
      if (py::hasattr(torch, name.c_str())) t.emplace_back(py::object(torch.attr(name.c_str())).release().ptr(), type);
    }
    return t;
  }();
  return table;
}

bool dtype_of(PyObject* obj, ScalarType& out) {
  for (const auto& [object, type] : dtype_objects()) {
    if (object == obj) {
      out = type;
      return true;
    }
  }
  return false;
}

// An exact int (not a bool, not a numpy scalar) in [lo, hi].
bool plain_int(PyObject* obj, long long lo, long long hi, long long& out) {
  if (!PyLong_CheckExact(obj)) return false;
  int overflow = 0;
  out = PyLong_AsLongLongAndOverflow(obj, &overflow);
  return overflow == 0 && !(out == -1 && PyErr_Occurred()) && out >= lo && out <= hi;
}

// `size` as PinnedPool.empty takes it: ints, or one tuple / list / torch.Size of ints.
bool plain_shape(PyObject* size, Shape& shape) {
  if (!PyTuple_CheckExact(size)) return false;
  PyObject* items = size;
  if (PyTuple_GET_SIZE(size) == 1) {
    PyObject* only = PyTuple_GET_ITEM(size, 0);
    if (PyTuple_Check(only) || PyList_CheckExact(only)) items = only;  // torch.Size is a tuple
  }
  const bool list = PyList_CheckExact(items);
  const Py_ssize_t n = list ? PyList_GET_SIZE(items) : PyTuple_GET_SIZE(items);
  shape.resize(static_cast<std::size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    long long d = 0;
    if (!plain_int(list ? PyList_GET_ITEM(items, i) : PyTuple_GET_ITEM(items, i), 0, (1LL << 50), d)) return false;
    shape[static_cast<std::size_t>(i)] = d;
  }
  return true;
}

// A pool id (a closed PinnedPool's is None). An id without a pool is
// pinned_pool's error, as from the op.
bool pool_id_of(PyObject* id, std::int64_t& out) {
  long long v = 0;
  if (!plain_int(id, 1, (1LL << 62), v)) return false;
  out = v;
  return true;
}

// Whether `obj` is a torch.Tensor or nn.Parameter (not a subclass with a
// dispatch of its own) that needs nothing the stable ABI cannot see: no
// autograd (requires_grad), no negative bit (read through the tensor's C
// getters; no Python frame runs). The conjugate bit exists on complex tensors
// only, which the caller leaves to the slow path. -1: a Python error.
int plain_tensor(PyObject* obj) {
  static PyObject* const tensor = torch_tensor_type();
  static PyObject* const parameter =
      py::object(py::module_::import("torch").attr("nn").attr("Parameter")).release().ptr();
  static PyObject* const requires_grad = PyUnicode_InternFromString("requires_grad");
  static PyObject* const is_neg = PyUnicode_InternFromString("is_neg");
  if (Py_TYPE(obj) != reinterpret_cast<PyTypeObject*>(tensor) &&
      Py_TYPE(obj) != reinterpret_cast<PyTypeObject*>(parameter)) {
    return 0;
  }
  PyObject* values[2] = {PyObject_GetAttr(obj, requires_grad), nullptr};
  if (values[0] == Py_False)
    values[1] = PyObject_VectorcallMethod(is_neg, &obj, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
  const int plain = values[0] == nullptr || (values[0] == Py_False && values[1] == nullptr) ? -1
                    : values[0] == Py_False && values[1] == Py_False                        ? 1
                                                                                            : 0;
  Py_XDECREF(values[0]);
  Py_XDECREF(values[1]);
  return plain;
}

bool is_complex(ScalarType t) {
  return t == ScalarType::ComplexHalf || t == ScalarType::ComplexFloat || t == ScalarType::ComplexDouble;
}

// Runs `f` (which returns a new reference), raising hipferry's errors as their Python types.
template <class F>
PyObject* python_call(F&& f) {
  try {
    return translate_errors(std::forward<F>(f));
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const py::builtin_exception& e) {
    e.set_error();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

// pool_empty_fast(pool_id, size, dtype, for_device[, alignment]) -> Tensor | None
// `size` is PinnedPool.empty's *size tuple.
PyObject* pool_empty_fast(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4 && nargs != 5) {
    PyErr_SetString(PyExc_TypeError,
                    "hipferry._C.pool_empty_fast: expected (pool_id, size, dtype, for_device[, alignment])");
    return nullptr;
  }
  std::int64_t pool_id = 0;
  Shape shape;
  ScalarType dtype = ScalarType::Undefined;
  long long device = -1, alignment = pool::kAlignment;
  if (!pool_id_of(args[0], pool_id) || !plain_shape(args[1], shape) || !dtype_of(args[2], dtype) ||
      is_quantized(dtype) || !(args[3] == Py_None || plain_int(args[3], 0, (1 << 16) - 1, device)) ||
      (nargs == 5 && !(plain_int(args[4], pool::kAlignment, pool::kPageAlignment, alignment) &&
                       (alignment == pool::kAlignment || alignment == pool::kPageAlignment)))) {
    Py_RETURN_NONE;
  }
  return python_call(
      [&] { return tensor_to_python(pool_empty(pool_id, shape, dtype, device, alignment)).release().ptr(); });
}

// pool_pin_fast(pool_id, tensor) -> Tensor | None: a copy of a plain dense
// CPU tensor (see plain_tensor) in a pool block.
PyObject* pool_pin_fast(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "hipferry._C.pool_pin_fast: expected (pool_id, tensor)");
    return nullptr;
  }
  std::int64_t pool_id = 0;
  if (!pool_id_of(args[0], pool_id)) Py_RETURN_NONE;
  const int plain = plain_tensor(args[1]);
  if (plain < 0) return nullptr;
  if (plain == 0) Py_RETURN_NONE;
  return python_call([&]() -> PyObject* {
    Tensor src;
    Shape shape;
    ScalarType type = ScalarType::Undefined;
    try {  // anything the stable ABI cannot describe (a nested tensor's sizes) is the slow path's to name
      src = tensor_from_python(args[1], "hipferry.pin: tensor");
      type = src.scalar_type();
      if (!src.is_cpu() || src.layout() != torch::headeronly::Layout::Strided || is_quantized(type) ||
          is_complex(type) || !src.is_contiguous()) {
        return py::none().release().ptr();
      }
      shape = shape_of(src);
    } catch (const std::exception&) {
      return py::none().release().ptr();
    }
    Tensor out = pool_empty(pool_id, shape, type);
    const std::size_t nbytes = nbytes_of(src);
    if (nbytes <= kInlineCopyBytes) {
      if (nbytes != 0) std::memcpy(out.mutable_data_ptr(), src.const_data_ptr(), nbytes);
    } else {
      (void)call_aten("aten::copy_", "", out, src, false);
    }
    return tensor_to_python(out).release().ptr();
  });
}

PyMethodDef fast_path_methods[] = {
    {"pool_empty_fast", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&pool_empty_fast)), METH_FASTCALL,
     "pool_empty_fast(pool_id, size, dtype, for_device[, alignment]) -> Tensor | None (Note [pool fast path])"},
    {"pool_pin_fast", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&pool_pin_fast)), METH_FASTCALL,
     "pool_pin_fast(pool_id, tensor) -> Tensor | None (Note [pool fast path])"},
};

}  // namespace

void bind_pool_fast_path(py::module_& m) {
  for (PyMethodDef& def : fast_path_methods) {
    py::object f = py::reinterpret_steal<py::object>(PyCFunction_NewEx(&def, nullptr, m.attr("__name__").ptr()));
    if (!f) throw py::error_already_set();
    m.add_object(def.ml_name, f);
  }
}

}  // namespace hipferry
