// Errors out of hipferry's op kernels. torch's dispatcher raises whatever a
// stable kernel throws as RuntimeError with its message, so a kernel tags the
// message with the Python type it stands for ("[hipferry ValueError] ...") and
// hipferry.ops.call_op re-raises it as that type. Plain std::runtime_error
// (RuntimeError, as torch's own argument checks) stays untagged.
#pragma once

#include <stdexcept>
#include <string>

#include "csrc/core/errors.h"

namespace hipferry {

template <class F>
auto tag_op_errors(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const OutOfMemory& e) {
    throw std::runtime_error(std::string("[hipferry OutOfMemoryError] ") + e.what());
  } catch (const ValueError& e) {
    throw std::runtime_error(std::string("[hipferry ValueError] ") + e.what());
  } catch (const TypeError& e) {
    throw std::runtime_error(std::string("[hipferry TypeError] ") + e.what());
  }
}

}  // namespace hipferry
