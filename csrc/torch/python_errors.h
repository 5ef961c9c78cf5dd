// hipferry's errors (csrc/core/errors.h) as the Python exceptions torch raises
// for their c10 counterparts, for functions bound with pybind11: ValueError,
// TypeError, torch.OutOfMemoryError. A failure inside torch reaches us through
// the stable C shim as a std::runtime_error carrying torch's message; an
// allocator's "out of memory" among them is raised as torch.OutOfMemoryError,
// as torch would. Anything else passes through to pybind11, which raises
// RuntimeError with its what().
#pragma once

#include <pybind11/pybind11.h>

#include <cstring>
#include <stdexcept>

#include "csrc/core/errors.h"

namespace hipferry {

namespace detail {

[[noreturn]] inline void raise_torch_out_of_memory(const char* message) {
  pybind11::gil_scoped_acquire gil;
  PyErr_SetString(pybind11::module_::import("torch").attr("OutOfMemoryError").ptr(), message);
  throw pybind11::error_already_set();
}

}  // namespace detail

template <class F>
auto translate_errors(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const OutOfMemory& e) {
    detail::raise_torch_out_of_memory(e.what());
  } catch (const ValueError& e) {
    throw pybind11::value_error(e.what());
  } catch (const TypeError& e) {
    throw pybind11::type_error(e.what());
  } catch (const pybind11::error_already_set&) {
    throw;
  } catch (const std::runtime_error& e) {
    if (std::strstr(e.what(), "out of memory") != nullptr) detail::raise_torch_out_of_memory(e.what());
    throw;
  }
}

}  // namespace hipferry
