// Shared by the pinned pool's tests: small pool options and a pool over fakes.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <memory>
#include <string>

#include "csrc/core/host_pool/host_pool.h"
#include "tests/cpp/fake_host_memory.h"

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
  // Frees `host` with work queued on `use` after its last use: the block waits
  // (parked) until that work completes.
  void free_in_use(void* host, const StreamUse& use) {
    pool->record_use(host, use);
    streams->enqueue(use);
    pool->deallocate(host);
  }
};

// The message of the PoolError that call() throws for bad input (`what`, for the failure
// messages); a test failure, and "", when it throws none or a capacity error instead.
template <class Call>
std::string bad_input_error(Call call, const char* what = "bad input") {
  try {
    call();
    ADD_FAILURE() << "no exception";
  } catch (const PoolCapacityError& e) {
    ADD_FAILURE() << "a capacity error for " << what << ": " << e.what();
  } catch (const PoolError& e) {
    return e.what();
  }
  return "";
}

// What the pool holds is as it was `before` (bad input changes nothing).
inline void expect_same_holdings(const PoolStats& now, const PoolStats& before) {
  EXPECT_EQ(now.live_blocks, before.live_blocks);
  EXPECT_EQ(now.waiting_blocks, before.waiting_blocks);
  EXPECT_EQ(now.requested_bytes, before.requested_bytes);
  EXPECT_EQ(now.allocated_bytes, before.allocated_bytes);
  EXPECT_EQ(now.reserved_bytes, before.reserved_bytes);
  EXPECT_EQ(now.cached_free_bytes, before.cached_free_bytes);
}

}  // namespace hipferry::pool::testing
