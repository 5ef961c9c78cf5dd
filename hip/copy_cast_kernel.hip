// platform.h first: it defines __host__/__device__ for the core headers.
#include "hip/platform.h"

#include <algorithm>

#include "csrc/core/dispatch.h"
#include "hip/check.h"
#include "hip/copy_cast_kernel.h"

namespace hipferry::gpu {
namespace {

constexpr int kThreads = 256;
// Enough blocks to fill any current GPU; the grid-stride loop covers the rest.
constexpr std::int64_t kMaxBlocks = 65535;

template <class From, class To>
__global__ void copy_cast_kernel(const typename From::storage* __restrict__ src, typename To::storage* __restrict__ dst,
                                 std::int64_t n) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    dst[i] = convert_element<From, To>(src[i]);
  }
}

}  // namespace

void launch_copy_cast(const void* src, ElementType src_type, void* dst, ElementType dst_type, std::int64_t n,
                      rt::StreamHandle stream, int device) {
  if (n <= 0) return;
  const std::int64_t blocks = std::min<std::int64_t>((n + kThreads - 1) / kThreads, kMaxBlocks);
  dispatch_element_pair(src_type, dst_type, [&](auto from, auto to) {
    using From = decltype(from);
    using To = decltype(to);
    copy_cast_kernel<From, To><<<static_cast<unsigned>(blocks), kThreads, 0, static_cast<hipStream_t>(stream)>>>(
        static_cast<const typename From::storage*>(src), static_cast<typename To::storage*>(dst), n);
  });
  HIPFERRY_CHECK_ON(device, hipGetLastError());
}

}  // namespace hipferry::gpu
