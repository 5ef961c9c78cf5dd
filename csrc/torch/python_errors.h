// c10 errors as the Python exceptions torch itself raises for them, for
// functions bound with pybind11 (torch's own translation covers only its
// dispatcher bindings): ValueError, TypeError, torch.OutOfMemoryError, and
// RuntimeError without the C++ backtrace.
#pragma once

#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>

#include <stdexcept>

namespace hipferry {

template <class F>
auto translate_errors(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const c10::OutOfMemoryError& e) {
    pybind11::gil_scoped_acquire gil;
    PyErr_SetString(pybind11::module_::import("torch").attr("OutOfMemoryError").ptr(), e.what_without_backtrace());
    throw pybind11::error_already_set();
  } catch (const c10::ValueError& e) {
    throw pybind11::value_error(e.what_without_backtrace());
  } catch (const c10::TypeError& e) {
    throw pybind11::type_error(e.what_without_backtrace());
  } catch (const c10::Error& e) {
    throw std::runtime_error(e.what_without_backtrace());
  }
}

}  // namespace hipferry
