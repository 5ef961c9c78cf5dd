// The exceptions hipferry's torch layer throws. Torch-free on purpose: only std
// exceptions cross LibTorch's stable ABI, so c10's must not be ours.
// translate_errors (csrc/torch/python_errors.h) raises each as the Python
// exception torch raises for its c10 counterpart; generic failures are a plain
// std::runtime_error (RuntimeError).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace hipferry {

// A bad argument value: ValueError (c10::ValueError's Python type).
struct ValueError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// An argument of the wrong type: TypeError. A logic_error, not an
// invalid_argument, so that pybind11's own translation (invalid_argument ->
// ValueError) cannot pass it off as a ValueError: it needs translate_errors.
struct TypeError : std::logic_error {
  using std::logic_error::logic_error;
};

// Host (pinned) memory exhausted: torch.OutOfMemoryError, as for
// c10::OutOfMemoryError. Without translate_errors it would be a RuntimeError.
struct OutOfMemory : std::runtime_error {
  using std::runtime_error::runtime_error;
};

namespace detail {

// The message TORCH_CHECK builds from the same arguments (c10::str streams
// them, with the operator<< of c10 types such as ScalarType, Device,
// IntArrayRef found the same way). A message is required: there is no default.
template <class First, class... Rest>
std::string check_message(const First& first, const Rest&... rest) {
  std::ostringstream out;
  out << first;
  ((out << rest), ...);
  return out.str();
}

}  // namespace detail
}  // namespace hipferry

// Throws Exception(message) unless cond holds; the message arguments are only
// evaluated on failure.
#define HF_CHECK_WITH(Exception, cond, ...)                                       \
  do {                                                                            \
    if (!(cond)) throw Exception(::hipferry::detail::check_message(__VA_ARGS__)); \
  } while (false)

#define HF_CHECK(cond, ...) HF_CHECK_WITH(::std::runtime_error, cond, __VA_ARGS__)
#define HF_CHECK_VALUE(cond, ...) HF_CHECK_WITH(::hipferry::ValueError, cond, __VA_ARGS__)
#define HF_CHECK_TYPE(cond, ...) HF_CHECK_WITH(::hipferry::TypeError, cond, __VA_ARGS__)
#define HF_CHECK_OOM(cond, ...) HF_CHECK_WITH(::hipferry::OutOfMemory, cond, __VA_ARGS__)
