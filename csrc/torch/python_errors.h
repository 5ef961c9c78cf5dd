// hipferry's errors (csrc/core/errors.h) and c10's as the Python exceptions
// torch itself raises for them, for functions bound with pybind11 (torch's own
// translation covers only its dispatcher bindings): ValueError, TypeError,
// torch.OutOfMemoryError, and RuntimeError without the C++ backtrace. c10
// errors still come from the ATen calls made here and from code shared with
// the dispatcher ops (pool_empty, the copy_cast_ checks). Anything else, a
// plain std::runtime_error included, passes through to pybind11, which raises
// RuntimeError with its what().
#pragma once

#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>

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
  // The hipferry types derive from std exceptions, the c10 ones from
  // std::exception only: no clause here can catch another's type.
  try {
    return f();
  } catch (const c10::OutOfMemoryError& e) {
    detail::raise_torch_out_of_memory(e.what_without_backtrace());
  } catch (const c10::ValueError& e) {
    throw pybind11::value_error(e.what_without_backtrace());
  } catch (const c10::TypeError& e) {
    throw pybind11::type_error(e.what_without_backtrace());
  } catch (const c10::Error& e) {
    throw std::runtime_error(e.what_without_backtrace());
  } catch (const OutOfMemory& e) {
    detail::raise_torch_out_of_memory(e.what());
  } catch (const ValueError& e) {
    throw pybind11::value_error(e.what());
  } catch (const TypeError& e) {
    throw pybind11::type_error(e.what());
  }
}

}  // namespace hipferry
