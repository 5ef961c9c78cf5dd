// launch_copy_cast for the CPU-only build: the "device" is the CPU and every
// stream is complete at once, so the launch runs the CPU kernel in place.
#include "csrc/core/copy_cast_cpu.h"
#include "hip/copy_cast_kernel.h"

namespace hipferry::gpu {

void launch_copy_cast(const void* src, ElementType src_type, void* dst, ElementType dst_type, std::int64_t n,
                      rt::StreamHandle, int) {
  copy_cast_cpu(src, src_type, dst, dst_type, 0, n);
}

}  // namespace hipferry::gpu
