// Error checking for GPU runtime calls: every failure becomes an rt::Error that
// names the call, the device and the runtime's own error name and text.
#pragma once

#include <string>

#include "hip/platform.h"
#include "hip/runtime.h"

namespace hipferry::rt {

[[noreturn]] inline void throw_runtime_error(hipError_t err, const char* call, int device) {
  std::string msg = std::string("hipferry: ") + call + " failed";
  if (device >= 0) msg += " on device " + std::to_string(device);
  msg += std::string(": ") + hipGetErrorString(err) + " (" + hipGetErrorName(err) + ")";
  throw Error(msg);
}

inline int current_device_or_minus_one() {
  int d = -1;
  if (hipGetDevice(&d) != hipSuccess) {
    (void)hipGetLastError();  // do not leave a sticky error for the next check
    return -1;
  }
  return d;
}

}  // namespace hipferry::rt

// HIPFERRY_CHECK(hipFoo(...)) on the current device;
// HIPFERRY_CHECK_ON(device, hipFoo(...)) when the device is known.
#define HIPFERRY_CHECK_ON(device, call)                                    \
  do {                                                                     \
    const hipError_t hipferry_err_ = (call);                               \
    if (hipferry_err_ != hipSuccess) {                                     \
      (void)hipGetLastError();                                             \
      ::hipferry::rt::throw_runtime_error(hipferry_err_, #call, (device)); \
    }                                                                      \
  } while (0)
#define HIPFERRY_CHECK(call) HIPFERRY_CHECK_ON(::hipferry::rt::current_device_or_minus_one(), call)
