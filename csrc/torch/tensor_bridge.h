// torch.Tensor <-> torch::stable::Tensor for the pybind11 bindings, through no
// torch C++ type (the module links libtorch only, never libtorch_python).
//
// Note [tensor bridge]
// ~~~~~~~~~~~~~~~~~~~~
// Three ways across, chosen once per process:
//   * "pyobject shim" (torch >= 2.14): the stable C shims
//     torch_tensor_from_pyobject / torch_tensor_to_pyobject. The build targets
//     torch 2.13, whose libtorch lacks them, so they are looked up in the loaded
//     libtorch at first use, never linked;
//   * "torch 2.13 THPVariable" (torch 2.13, which has no shims): what those
//     shims do, done here against that one release's fixed layout: a
//     torch.Tensor object holds its at::Tensor right after its PyObject header
//     (the handle is a pointer to it; a new handle is made from it), and
//     libtorch_python's exported THPVariable_Wrap(const at::TensorBase&) makes
//     the Python object. Used only when torch.__version__ is 2.13.x and a
//     self-check on a fresh tensor agrees; the hot paths (PinnedPool.empty,
//     hipferry.pin) then cost the same on 2.13 as on later releases;
//   * "stash op" (HIPFERRY_TENSOR_BRIDGE=op, or neither of the above): the
//     private ops torch.ops.hipferry_bridge.stash(Tensor[]) -> int and
//     unstash(int) -> Tensor[], called from here through Python. A stable op
//     receives the tensors as stable handles: stash parks them in this file's
//     table under an id, and the binding takes them out at once; unstash hands
//     out what the binding parked. Several microseconds a crossing.
// Invariants: every entry parked is taken out by the same call (an id never
// outlives the function that made it, also when it throws); the table's lock
// is held only to insert or erase, never while a tensor dies or Python runs.
// All functions need the GIL.
#pragma once

#include <pybind11/pybind11.h>

#include <string>
#include <vector>

#include "csrc/torch/stable.h"

namespace hipferry {

// `obj` must be a torch.Tensor; None gives an undefined Tensor when
// `allow_none`. Throws TypeError naming `what` otherwise.
Tensor tensor_from_python(pybind11::handle obj, const char* what, bool allow_none = false);
// A sequence of torch.Tensor (None entries when `allow_none`), in one crossing.
// Errors name `what`[i].
std::vector<Tensor> tensors_from_python(pybind11::handle sequence, const char* what, bool allow_none = false);
pybind11::object tensor_to_python(const Tensor& t);
pybind11::list tensors_to_python(const std::vector<Tensor>& ts);

// torch.Tensor (the type object), looked up once.
PyObject* torch_tensor_type();

// "pyobject shim", "torch 2.13 THPVariable" or "stash op": the way in use (see the Note).
std::string tensor_bridge_kind();

// Chooses the way now. Called while hipferry._C is imported: the choice runs
// torch ops, which release the GIL, so it must not first happen inside a
// static initializer that a second thread could enter meanwhile.
void init_tensor_bridge();

}  // namespace hipferry
