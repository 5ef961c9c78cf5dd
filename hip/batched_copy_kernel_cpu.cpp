// launch_batched_copy for the CPU-only build: the "device" is the CPU and
// every stream is complete at once, so the jobs run in place, in order.
#include <cstring>
#include <stdexcept>
#include <string>

#include "csrc/core/copy_cast_cpu.h"
#include "hip/batched_copy_kernel.h"

namespace hipferry::gpu {

std::size_t batched_copy_table_bytes(std::size_t jobs) { return jobs * 64; }

void launch_batched_copy(const CopyJobSpec* jobs, std::size_t n_jobs, void*, const void*, rt::StreamHandle, int) {
  for (std::size_t k = 0; k < n_jobs; ++k) {
    if (jobs[k].count < 0) {
      throw std::invalid_argument("launch_batched_copy: job " + std::to_string(k) + " has a negative count");
    }
  }
  for (std::size_t k = 0; k < n_jobs; ++k) {
    const CopyJobSpec& j = jobs[k];
    if (j.count == 0) continue;
    if (j.convert) {
      copy_cast_cpu(j.src, j.src_type, j.dst, j.dst_type, 0, j.count);
    } else {
      std::memcpy(j.dst, j.src, static_cast<std::size_t>(j.count));
    }
  }
}

}  // namespace hipferry::gpu
