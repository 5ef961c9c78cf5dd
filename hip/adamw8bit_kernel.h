// Launcher of the fused 8-bit AdamW kernel (csrc/core/optim/adamw8bit_cpu.h has the
// arrays and the step): one thread block per quantization block of 256 elements
// dequantizes, updates, reduces the new scales and quantizes, in one kernel. Vendor-free:
// callable from code compiled by a plain C++ compiler.
#pragma once

#include <cstdint>

#include "csrc/core/optim/adamw8bit_cpu.h"
#include "hip/runtime.h"

namespace hipferry::gpu {

// Every pointer in `a` is device-accessible (device memory or mapped pinned host memory);
// n elements, so ceil(n / 256) scales per state. Enqueued on `stream` of `device`; throws
// rt::Error if the launch fails. The CPU-only build runs optim::adamw8bit_cpu in place.
// Bit-identical to the CPU loop (tests/cpp/adamw8bit_kernel_test.cpp).
void launch_adamw8bit(const optim::AdamW8bitArrays& a, const optim::AdamWScalars& s, std::int64_t n,
                      rt::StreamHandle stream, int device);

}  // namespace hipferry::gpu
