// Many small copies (and conversions) as ONE kernel: the scatter step of a
// packed transfer (one host->device copy of a staging buffer, then this
// kernel moves every tensor to its place, converting where asked). A copy
// call costs microseconds of launch overhead; a thousand of them cost
// milliseconds, this costs one launch.
//
// Vendor-free: callable from code compiled by a plain C++ compiler.
#pragma once

#include <cstddef>
#include <cstdint>

#include "csrc/core/element_type.h"
#include "hip/runtime.h"

namespace hipferry::gpu {

// One copy: `count` bytes (convert == false) or `count` elements converted
// from src_type to dst_type. Addresses are device-readable/writable: device
// memory or mapped pinned host memory.
struct CopyJobSpec {
  const void* src = nullptr;
  void* dst = nullptr;
  std::int64_t count = 0;
  bool convert = false;
  ElementType src_type = ElementType::kFloat32;
  ElementType dst_type = ElementType::kFloat32;
};

// Bytes of job table launch_batched_copy needs for `jobs` jobs.
std::size_t batched_copy_table_bytes(std::size_t jobs);

// Writes the job table through `table_host` (a host view of memory the device
// reads at `table_device`: mapped pinned memory, e.g. a pool block) and
// enqueues one kernel for all jobs on `stream` of `device`. The table must
// stay untouched until the stream has passed the kernel (record the block's
// use on the stream). Jobs with count 0 are skipped. Throws rt::Error if the
// launch fails, std::invalid_argument for a negative count. On the CPU-only
// build the jobs run in place, in order, and the table is not used.
void launch_batched_copy(const CopyJobSpec* jobs, std::size_t n_jobs, void* table_host, const void* table_device,
                         rt::StreamHandle stream, int device);

}  // namespace hipferry::gpu
