// launch_adamw8bit for the CPU-only build: the "device" is the CPU and every stream is
// complete at once, so the step runs here.
#include "hip/adamw8bit_kernel.h"

namespace hipferry::gpu {

void launch_adamw8bit(const optim::AdamW8bitArrays& a, const optim::AdamWScalars& s, std::int64_t n, rt::StreamHandle,
                      int) {
  optim::adamw8bit_cpu(a, s, 0, n);
}

}  // namespace hipferry::gpu
