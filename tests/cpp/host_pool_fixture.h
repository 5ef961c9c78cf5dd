// Shared by the pinned pool's tests: small pool options and a pool over fakes.
#pragma once

#include <cstddef>
#include <memory>

#include "tests/cpp/fake_host_memory.h"
#include "csrc/core/host_pool/host_pool.h"

namespace hipferry::pool::testing {

constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t MiB = std::size_t{1} << 20;

// Small sizes so every kind of segment appears within a few allocations:
// small <= 4 KiB in 64 KiB segments, medium <= 256 KiB in 1 MiB segments,
// larger in segments of their own.
inline PoolOptions small_options() {
  PoolOptions o;
  o.small_max = 4 * KiB;
  o.small_segment_bytes = 64 * KiB;
  o.own_segment_threshold = 256 * KiB;
  o.large_segment_bytes = 1 * MiB;
  return o;
}

// A pool over fakes. Members are destroyed in reverse order: the pool first,
// then the fakes, whose destructors report what the pool left behind.
struct Fixture {
  std::shared_ptr<FakeMemory> mem;
  std::shared_ptr<FakeStreams> streams = FakeStreams::make();
  std::unique_ptr<HostPool> pool;
  explicit Fixture(PoolOptions o = small_options(), bool mapped = true) : mem(FakeMemory::make(mapped)) {
    pool = std::make_unique<HostPool>(mem->provider(), streams->source(), o);
  }
  PoolStats stats() const { return pool->stats(); }
};

}  // namespace hipferry::pool::testing
