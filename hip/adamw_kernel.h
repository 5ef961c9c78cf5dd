// Launcher of the fused AdamW kernel: ONE kernel reads the gradient, updates
// the float32 parameter (or master copy) and both moments, and writes the
// low-precision parameter, for n elements. Vendor-free: callable from code
// compiled by a plain C++ compiler.
#pragma once

#include <cstdint>

#include "csrc/core/optim/adamw_cpu.h"
#include "hip/runtime.h"

namespace hipferry::gpu {

// Every pointer in `a` is device-accessible (device memory or mapped pinned
// host memory). Enqueued on `stream` of `device`; throws rt::Error if the
// launch fails. The CPU-only build runs optim::adamw_cpu in place.
void launch_adamw(const optim::AdamWArrays& a, const optim::AdamWScalars& s, std::int64_t n, rt::StreamHandle stream,
                  int device);

}  // namespace hipferry::gpu
