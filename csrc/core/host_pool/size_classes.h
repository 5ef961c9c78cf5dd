// How the pinned pool rounds requests and sizes its segments.
//
// Requests up to `own_segment_threshold` are rounded to size classes: 8 per
// power of two (a 1.2 MiB request takes 1.25 MiB), so from 2 KiB up a block
// wastes at most 1/8 of itself and about 1/16 on average (below 2 KiB the
// 256-byte granularity rules); PyTorch's pinned allocator rounds to the next
// power of two and wastes up to 1x. Larger requests get a segment
// of their own, rounded only to kOwnSegmentGranule.
#pragma once

#include <cstddef>

namespace hipferry::pool {

// Every block starts at a multiple of this: enough for DMA engines and for
// the widest vector loads of CPU and GPU kernels.
constexpr std::size_t kAlignment = 256;
// The other alignment a request may ask for: a page, as O_DIRECT needs of the
// buffers it reads and writes (the disk state store reads straight into pool
// blocks). Every segment starts on a page.
constexpr std::size_t kPageAlignment = 4096;
constexpr std::size_t kClassesPerDoubling = 8;
constexpr std::size_t kOwnSegmentGranule = std::size_t{64} << 10;
// Above this no request is accepted (no host has 256 TiB).
constexpr std::size_t kMaxRequestBytes = std::size_t{1} << 48;

constexpr std::size_t round_up(std::size_t n, std::size_t multiple) { return (n + multiple - 1) / multiple * multiple; }

constexpr std::size_t floor_pow2(std::size_t n) {
  std::size_t p = 1;
  while (p <= n / 2) p *= 2;
  return p;
}

// The block size that serves a request of `bytes` (1 <= bytes <= kMaxRequestBytes).
constexpr std::size_t size_class(std::size_t bytes, std::size_t own_segment_threshold) {
  if (bytes <= kAlignment) return kAlignment;
  if (bytes > own_segment_threshold) return round_up(bytes, kOwnSegmentGranule);
  const std::size_t step = floor_pow2(bytes) / kClassesPerDoubling;
  return round_up(bytes, step > kAlignment ? step : kAlignment);
}

}  // namespace hipferry::pool
