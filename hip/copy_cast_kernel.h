// Launcher of the copy_cast kernel. Vendor-free: callable from code compiled by
// a plain C++ compiler (the torch glue, GoogleTest).
#pragma once

#include <cstdint>

#include "csrc/core/element_type.h"
#include "hip/runtime.h"

namespace hipferry::gpu {

// Enqueues dst[i] = convert_element(src[i]) for i in [0, n) on `stream` of
// `device`: ONE kernel, no temporary buffer. `src` and `dst` are addresses the
// device can read/write: device memory or mapped pinned host memory (pass the
// pointer from rt::host_device_pointer). Throws rt::Error if the launch fails.
void launch_copy_cast(const void* src, ElementType src_type, void* dst, ElementType dst_type, std::int64_t n,
                      rt::StreamHandle stream, int device);

}  // namespace hipferry::gpu
