// platform.h first: it defines __host__/__device__ for the core headers.
#include "hip/platform.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "csrc/core/convert.h"
#include "hip/batched_copy_kernel.h"
#include "hip/check.h"

namespace hipferry::gpu {
namespace {

constexpr int kThreads = 256;
constexpr std::int64_t kTileItems = 4096;  // items (elements, 16-byte vectors or bytes) per tile
constexpr std::int64_t kMaxBlocks = 65535;

// The device's view of one job. Plain data, written by the host into mapped memory.
struct DeviceJob {
  const void* src;
  void* dst;
  std::int64_t items;       // elements, 16-byte vectors or bytes
  std::int64_t first_tile;  // tiles of all earlier jobs
  std::uint8_t kind;        // kBytes, kVectors or kConvert
  std::uint8_t src_type;
  std::uint8_t dst_type;
};
enum : std::uint8_t { kBytes, kVectors, kConvert };

template <class From, class To>
__device__ void convert_range(const DeviceJob& j, std::int64_t begin, std::int64_t end) {
  const auto* src = static_cast<const typename From::storage*>(j.src);
  auto* dst = static_cast<typename To::storage*>(j.dst);
  for (std::int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) dst[i] = convert_element<From, To>(src[i]);
}

template <class From>
__device__ void convert_from(const DeviceJob& j, std::int64_t begin, std::int64_t end) {
  switch (static_cast<ElementType>(j.dst_type)) {
    case ElementType::kFloat32: convert_range<From, Float32>(j, begin, end); break;
    case ElementType::kFloat16: convert_range<From, Float16>(j, begin, end); break;
    case ElementType::kBFloat16: convert_range<From, BFloat16>(j, begin, end); break;
  }
}

__global__ void batched_copy_kernel(const DeviceJob* __restrict__ jobs, int n_jobs, std::int64_t tiles) {
  for (std::int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    int lo = 0, hi = n_jobs - 1;  // the last job whose first tile is <= tile
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (jobs[mid].first_tile <= tile)
        lo = mid;
      else
        hi = mid - 1;
    }
    const DeviceJob j = jobs[lo];
    const std::int64_t begin = (tile - j.first_tile) * kTileItems;
    const std::int64_t end = begin + kTileItems < j.items ? begin + kTileItems : j.items;
    if (j.kind == kVectors) {
      const auto* src = static_cast<const uint4*>(j.src);
      auto* dst = static_cast<uint4*>(j.dst);
      for (std::int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) dst[i] = src[i];
    } else if (j.kind == kBytes) {
      const auto* src = static_cast<const unsigned char*>(j.src);
      auto* dst = static_cast<unsigned char*>(j.dst);
      for (std::int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) dst[i] = src[i];
    } else {
      switch (static_cast<ElementType>(j.src_type)) {
        case ElementType::kFloat32: convert_from<Float32>(j, begin, end); break;
        case ElementType::kFloat16: convert_from<Float16>(j, begin, end); break;
        case ElementType::kBFloat16: convert_from<BFloat16>(j, begin, end); break;
      }
    }
  }
}

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

}  // namespace

std::size_t batched_copy_table_bytes(std::size_t jobs) { return jobs * sizeof(DeviceJob); }

void launch_batched_copy(const CopyJobSpec* jobs, std::size_t n_jobs, void* table_host, const void* table_device,
                         rt::StreamHandle stream, int device) {
  auto* table = static_cast<DeviceJob*>(table_host);
  int n = 0;
  std::int64_t tiles = 0;
  for (std::size_t k = 0; k < n_jobs; ++k) {
    const CopyJobSpec& s = jobs[k];
    if (s.count < 0)
      throw std::invalid_argument("launch_batched_copy: job " + std::to_string(k) + " has a negative count");
    if (s.count == 0) continue;
    DeviceJob j{s.src,
                s.dst,
                s.count,
                tiles,
                kConvert,
                static_cast<std::uint8_t>(s.src_type),
                static_cast<std::uint8_t>(s.dst_type)};
    if (!s.convert) {
      const bool vectors = aligned16(s.src) && aligned16(s.dst) && s.count % 16 == 0;
      j.kind = vectors ? kVectors : kBytes;
      j.items = vectors ? s.count / 16 : s.count;
    }
    tiles += (j.items + kTileItems - 1) / kTileItems;
    table[n++] = j;
  }
  if (n == 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min(tiles, kMaxBlocks));
  batched_copy_kernel<<<blocks, kThreads, 0, static_cast<hipStream_t>(stream)>>>(
      static_cast<const DeviceJob*>(table_device), n, tiles);
  HIPFERRY_CHECK_ON(device, hipGetLastError());
}

}  // namespace hipferry::gpu
