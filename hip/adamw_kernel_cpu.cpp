// launch_adamw for the CPU-only build: the "device" is the CPU and every
// stream is complete at once, so the update runs in place.
#include "hip/adamw_kernel.h"

namespace hipferry::gpu {

void launch_adamw(const optim::AdamWArrays& a, const optim::AdamWScalars& s, std::int64_t n, rt::StreamHandle, int) {
  optim::adamw_cpu(a, s, 0, n);
}

}  // namespace hipferry::gpu
