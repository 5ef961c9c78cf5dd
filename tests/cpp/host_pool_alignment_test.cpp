// Page-aligned blocks (allocate's `alignment`, Note [hipferry pinned pool]):
// every one aligned, whole pages, inside its segment and apart from every
// other live block; a free block's unaligned head split off and merged back,
// so mixed workloads still end fully coalesced with exact stats; a bad
// alignment rejected before anything changes, and so is a provider segment
// that does not start on a page. Random sequences with page-aligned requests:
// host_pool_property_test.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "csrc/core/host_pool/host_pool.h"
#include "csrc/core/host_pool/size_classes.h"
#include "tests/cpp/address_only_provider.h"
#include "tests/cpp/host_pool_fixture.h"

namespace hipferry::pool {
namespace {

using testing::AddressOnlyProvider;
using testing::AddressOrder;
using testing::bad_input_error;
using testing::expect_same_holdings;
using testing::Fixture;
using testing::KiB;
using testing::MiB;
using testing::small_options;

std::uintptr_t addr(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

// Live blocks by host address: each new one must lie apart from all others.
class LiveBlocks {
 public:
  ::testing::AssertionResult add(const HostPool::Allocation& a) {
    const std::uintptr_t b = addr(a.host), e = b + a.size;
    auto next = live_.lower_bound(b);
    if (next != live_.end() && next->first < e) return ::testing::AssertionFailure() << "overlaps the next live block";
    if (next != live_.begin() && std::prev(next)->second > b)
      return ::testing::AssertionFailure() << "overlaps the previous live block";
    live_.emplace(b, e);
    return ::testing::AssertionSuccess();
  }
  void remove(const void* host) { live_.erase(addr(host)); }

 private:
  std::map<std::uintptr_t, std::uintptr_t> live_;  // start -> end
};

TEST(HostPoolAlignment, PageAlignedBlocksAreAlignedWholePagesInsideTheirSegment) {
  Fixture f;  // small <= 4 KiB in 64 KiB segments, medium <= 256 KiB in 1 MiB ones, larger their own
  LiveBlocks live;
  std::vector<void*> hosts;
  std::size_t allocated = 0;
  for (std::size_t bytes : {std::size_t{1}, std::size_t{255}, std::size_t{256}, std::size_t{300}, std::size_t{4095},
                            std::size_t{4096}, std::size_t{4097}, std::size_t{5000}, 12 * KiB + 1, 64 * KiB - 1,
                            100 * KiB, 256 * KiB - 1, 256 * KiB, 256 * KiB + 1, 1 * MiB + 3, 3 * MiB + 5000}) {
    // A 256-aligned block of 256 bytes between page-aligned ones leaves the
    // free rest misaligned: the next page-aligned block needs a head split.
    for (std::size_t alignment : {kAlignment, kPageAlignment, kPageAlignment}) {
      SCOPED_TRACE(std::to_string(bytes) + " bytes, alignment " + std::to_string(alignment));
      const std::size_t ask = alignment == kAlignment ? 256 : bytes;
      const auto a = f.pool->allocate(ask, -1, alignment);
      EXPECT_EQ(addr(a.host) % alignment, 0u);
      EXPECT_EQ(a.size % alignment, 0u);
      EXPECT_GE(a.size, ask);
      const auto seg = f.mem->segment_of(a.host);
      ASSERT_TRUE(seg.has_value());
      EXPECT_LE(addr(a.host) + a.size, seg->host + seg->bytes) << "block outside its segment";
      EXPECT_EQ(addr(a.device), seg->device + (addr(a.host) - seg->host));
      ASSERT_TRUE(live.add(a));
      hosts.push_back(a.host);
      allocated += a.size;
      EXPECT_EQ(f.stats().allocated_bytes, allocated);  // heads are free, not allocated
      ASSERT_NO_THROW(f.pool->check_invariants());
    }
  }
  for (void* h : hosts) f.pool->deallocate(h);
  const PoolStats s = f.stats();
  EXPECT_EQ(s.allocated_bytes, 0u);
  EXPECT_EQ(s.cached_free_bytes, s.reserved_bytes);
  EXPECT_EQ(f.pool->trim(), s.reserved_bytes) << "a segment did not coalesce into one free block";
}

TEST(HostPoolAlignment, TheUnalignedHeadIsAFreeBlockThatServesSmallRequestsAndMergesBack) {
  Fixture f;
  const auto first = f.pool->allocate(256);  // a small segment's first 256 bytes
  const auto seg = *f.mem->segment_of(first.host);
  ASSERT_EQ(addr(first.host), seg.host);
  const auto page = f.pool->allocate(100, -1, kPageAlignment);
  EXPECT_EQ(addr(page.host), seg.host + 4096) << "expected the same segment's first page after the head";
  EXPECT_EQ(page.size, 4096u);
  PoolStats s = f.stats();
  EXPECT_EQ(s.segments, 1u);
  EXPECT_EQ(s.allocated_bytes, 256u + 4096u);
  EXPECT_EQ(s.requested_bytes, 256u + 100u);
  EXPECT_EQ(s.cached_free_bytes, 64 * KiB - 256 - 4096);
  // Best fit: the 3840-byte head is the smallest free block that fits.
  const auto small = f.pool->allocate(2000);
  EXPECT_EQ(addr(small.host), seg.host + 256);
  f.pool->check_invariants();
  // The small block merges with the head's rest, then the page's block with
  // both neighbours, then the first block with everything.
  f.pool->deallocate(small.host);
  f.pool->deallocate(page.host);
  f.pool->check_invariants();
  s = f.stats();
  EXPECT_EQ(s.allocated_bytes, 256u);
  EXPECT_EQ(s.cached_free_bytes, 64 * KiB - 256);
  f.pool->deallocate(first.host);
  EXPECT_EQ(f.pool->trim(), 64 * KiB) << "the segment is not one free block";
}

TEST(HostPoolAlignment, ManyMisfitsBelowTheSizeStillFindTheBlockThatFits) {
  Fixture f;
  // Small segment 1: 256-byte separators and 4 KiB blocks, none of them on a page.
  std::vector<void*> separators, pages;
  for (int i = 0; i < 15; ++i) {
    separators.push_back(f.pool->allocate(256).host);
    pages.push_back(f.pool->allocate(4096).host);
    ASSERT_NE(addr(pages.back()) % 4096, 0u);
  }
  ASSERT_EQ(f.stats().segments, 1u);
  // Segment 2: one 2 KiB block and a free rest of 62 KiB at a misaligned start.
  const auto other = f.pool->allocate(2048);
  ASSERT_EQ(f.stats().segments, 2u);
  for (void* p : pages) f.pool->deallocate(p);  // 15 free 4 KiB blocks, each too small for its head
  const PoolStats before = f.stats();
  const auto a = f.pool->allocate(4096, -1, kPageAlignment);
  EXPECT_EQ(addr(a.host) % 4096, 0u);
  EXPECT_EQ(f.stats().cache_misses, before.cache_misses) << "a new segment, with a fitting block cached";
  EXPECT_EQ(f.stats().segments, 2u);
  EXPECT_EQ(f.mem->segment_of(a.host)->host, f.mem->segment_of(other.host)->host);
  f.pool->check_invariants();
  f.pool->deallocate(a.host);
  f.pool->deallocate(other.host);
  for (void* p : separators) f.pool->deallocate(p);
  EXPECT_EQ(f.pool->trim(), 2 * 64 * KiB);
}

// Log-uniform 1 B .. 24 MiB, half of them page aligned, a random half freed
// and allocated again round after round: blocks stay aligned, inside their
// segments and apart; allocated_bytes is the sum of the live blocks; once
// all are freed nothing is allocated, every byte reserved is free, and every
// segment is one free block again (trim gives back all of them).
void run_mixed_workload(AddressOrder order, std::uint64_t seed) {
  PoolOptions o;  // the default segment sizes: 2 MiB small, 32 MiB large
  auto provider = std::make_unique<AddressOnlyProvider>(order, seed);
  const AddressOnlyProvider& segments = *provider;
  HostPool pool(std::move(provider), std::make_unique<CompletedEventSource>(), o);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> log_size(0.0, std::log(24.0 * MiB));
  std::vector<HostPool::Allocation> blocks;
  LiveBlocks live;
  std::size_t allocated = 0;
  const auto allocate_one = [&] {
    const std::size_t bytes = std::max<std::size_t>(1, static_cast<std::size_t>(std::exp(log_size(rng))));
    const std::size_t alignment = rng() % 2 == 0 ? kPageAlignment : kAlignment;
    const auto a = pool.allocate(bytes, -1, alignment);
    ASSERT_EQ(addr(a.host) % alignment, 0u) << bytes << " bytes";
    ASSERT_GE(a.size, bytes);
    const auto [seg_host, seg_bytes] = segments.segment_of(addr(a.host));
    ASSERT_NE(seg_bytes, 0u);
    ASSERT_EQ(seg_host % kPageAlignment, 0u);
    ASSERT_LE(addr(a.host) + a.size, seg_host + seg_bytes) << "block outside its segment";
    ASSERT_TRUE(live.add(a));
    blocks.push_back(a);
    allocated += a.size;
  };
  const auto free_one = [&](std::size_t i) {
    pool.deallocate(blocks[i].host);
    live.remove(blocks[i].host);
    allocated -= blocks[i].size;
    blocks[i] = blocks.back();
    blocks.pop_back();
  };
  for (int i = 0; i < 400; ++i) ASSERT_NO_FATAL_FAILURE(allocate_one());
  for (int round = 0; round < 10; ++round) {
    for (int i = 0; i < 200; ++i) free_one(rng() % blocks.size());
    for (int i = 0; i < 200; ++i) ASSERT_NO_FATAL_FAILURE(allocate_one());
    ASSERT_EQ(pool.stats().allocated_bytes, allocated);
    ASSERT_NO_THROW(pool.check_invariants());
  }
  const std::size_t reserved = pool.stats().reserved_bytes;
  while (!blocks.empty()) free_one(rng() % blocks.size());
  const PoolStats s = pool.stats();
  EXPECT_EQ(s.allocated_bytes, 0u);
  EXPECT_EQ(s.requested_bytes, 0u);
  EXPECT_EQ(s.reserved_bytes, reserved) << "a free gave back a segment (max_cached_bytes is unlimited)";
  EXPECT_EQ(s.cached_free_bytes, reserved);
  EXPECT_EQ(segments.live_bytes(), reserved);
  EXPECT_EQ(pool.trim(), reserved) << "some segment is not one free block: a head or rest did not merge back";
  EXPECT_EQ(pool.stats().segments, 0u);
}

TEST(HostPoolAlignment, MixedWorkloadsWithRandomFreesEndFullyCoalesced) {
  for (const auto order : {AddressOrder::kAscending, AddressOrder::kDescending, AddressOrder::kShuffled}) {
    for (std::uint64_t seed : {1u, 2u, 3u}) {
      SCOPED_TRACE(std::string(testing::to_string(order)) + ", seed " + std::to_string(seed));
      run_mixed_workload(order, seed);
      if (HasFatalFailure()) return;
    }
  }
}

TEST(HostPoolAlignment, BadAlignmentIsRejectedBeforeAnythingChanges) {
  Fixture f;
  const auto a = f.pool->allocate(3000);
  const auto b = f.pool->allocate(5000, -1, kPageAlignment);
  f.pool->deallocate(f.pool->allocate(200).host);
  const PoolStats before = f.stats();
  const std::uint64_t segments_made = f.mem->allocs();
  for (std::size_t alignment :
       {std::size_t{0}, std::size_t{1}, std::size_t{64}, std::size_t{128}, std::size_t{255}, std::size_t{512},
        std::size_t{2048}, std::size_t{4097}, std::size_t{8192}, std::size_t{1} << 21, SIZE_MAX}) {
    SCOPED_TRACE("alignment " + std::to_string(alignment));
    const std::string m = bad_input_error([&] { f.pool->allocate(100, -1, alignment); }, "a bad alignment");
    if (!m.empty()) {
      EXPECT_NE(m.find("alignment " + std::to_string(alignment)), std::string::npos) << m;
      EXPECT_NE(m.find("expected alignment 256 (the default) or 4096"), std::string::npos) << m;
    }
    const PoolStats s = f.stats();
    expect_same_holdings(s, before);
    EXPECT_EQ(s.cache_hits, before.cache_hits);
    EXPECT_EQ(s.cache_misses, before.cache_misses);
    EXPECT_EQ(f.mem->allocs(), segments_made);
    EXPECT_NO_THROW(f.pool->check_invariants());
  }
  f.pool->deallocate(a.host);
  f.pool->deallocate(b.host);
}

// Hands out 256-aligned segments that start 256 bytes past a page, as the
// provider contract (HostSegment::host) forbids.
class OffPageProvider : public HostMemoryProvider {
 public:
  HostSegment allocate(std::size_t bytes, int) override {
    ++allocs;
    return {reinterpret_cast<void*>((std::uintptr_t{1} << 44) + allocs * (std::uintptr_t{1} << 40) + 256), nullptr};
  }
  void release(const HostSegment&, std::size_t bytes) noexcept override {
    ++releases;
    released_bytes += bytes;
  }
  std::string describe() const override { return "off-page provider"; }
  int allocs = 0, releases = 0;
  std::size_t released_bytes = 0;
};

TEST(HostPoolAlignment, ASegmentOffAPageIsGivenBackAndReported) {
  PoolOptions o = small_options();
  o.capacity = 64 * KiB;  // one small segment: capacity held back by the failure would show
  auto provider = std::make_unique<OffPageProvider>();
  const OffPageProvider& p = *provider;
  HostPool pool(std::move(provider), std::make_unique<CompletedEventSource>(), o);
  for (int attempt = 1; attempt <= 2; ++attempt) {
    try {
      pool.allocate(100);
      ADD_FAILURE() << "no exception";
    } catch (const PoolCapacityError& e) {
      ADD_FAILURE() << "capacity held back by the failed attempt: " << e.what();
    } catch (const PoolError& e) {
      EXPECT_NE(std::string(e.what()).find("off-page provider handed out a segment at"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("expected segments aligned to 4096 bytes"), std::string::npos);
    }
    EXPECT_EQ(p.allocs, attempt);
    EXPECT_EQ(p.releases, attempt);
    EXPECT_EQ(p.released_bytes, attempt * 64 * KiB);
    EXPECT_EQ(pool.stats().reserved_bytes, 0u);
    EXPECT_EQ(pool.stats().segments, 0u);
    EXPECT_NO_THROW(pool.check_invariants());
  }
  o.reserve_bytes = 64 * KiB;
  EXPECT_THROW(HostPool(std::make_unique<OffPageProvider>(), std::make_unique<CompletedEventSource>(), o), PoolError);
}

}  // namespace
}  // namespace hipferry::pool
