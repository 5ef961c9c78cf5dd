// The pinned pool (Note [hipferry pinned pool] in host_pool.h) against fake
// memory and fake streams: size classes, placement, splitting and
// coalescing, capacity, the reserve, stream-ordered reuse, misuse, close,
// failures of the provider and the event source. Many threads:
// host_pool_concurrency_test.cpp; random sequences: host_pool_property_test.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "csrc/core/host_pool/host_pool.h"
#include "csrc/core/host_pool/size_classes.h"
#include "tests/cpp/fake_host_memory.h"
#include "tests/cpp/host_pool_fixture.h"

namespace hipferry::pool {
namespace {

using namespace testing;  // the fixtures: fake_host_memory.h, host_pool_fixture.h

const StreamUse kS0 = FakeStreams::stream(0);
const StreamUse kS1 = FakeStreams::stream(1);

// What every allocation must satisfy: alignment, a size class, inside one
// provider segment, and a device address derived from that segment's.
::testing::AssertionResult well_formed(const FakeMemory& mem, const HostPool::Allocation& a, std::size_t bytes,
                                       std::size_t own_threshold) {
  const auto h = reinterpret_cast<std::uintptr_t>(a.host);
  if (a.host == nullptr || h % kAlignment != 0) return ::testing::AssertionFailure() << "unaligned host " << a.host;
  const std::size_t cls = size_class(bytes, own_threshold);
  if (a.size < cls || a.size - cls > a.size / 8)
    return ::testing::AssertionFailure() << "block of " << a.size << " bytes for a request of " << bytes;
  const auto seg = mem.segment_of(a.host);
  if (!seg || h + a.size > seg->host + seg->bytes)
    return ::testing::AssertionFailure() << "block " << a.host << "+" << a.size << " is not inside one segment";
  void* want = seg->device == 0 ? nullptr : reinterpret_cast<void*>(seg->device + (h - seg->host));
  if (a.device != want)
    return ::testing::AssertionFailure() << "device " << a.device << ", expected " << want
                                         << " (segment device base + offset)";
  return ::testing::AssertionSuccess();
}

// Size and start of the provider segment holding `p`; 0 when none does.
std::size_t segment_bytes(const FakeMemory& mem, const void* p) {
  const auto s = mem.segment_of(p);
  return s ? s->bytes : 0;
}
std::uintptr_t segment_start(const FakeMemory& mem, const void* p) {
  const auto s = mem.segment_of(p);
  return s ? s->host : 0;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

bool overlaps(const HostPool::Allocation& a, const void* p, std::size_t n) {
  const auto b = static_cast<const char*>(a.host), q = static_cast<const char*>(p);
  return b < q + n && q < b + a.size;
}

// --- size classes ------------------------------------------------------------

TEST(SizeClass, RequestsUpTo256BytesTakeTheMinimumBlock) {
  for (std::size_t n = 1; n <= kAlignment; ++n) ASSERT_EQ(size_class(n, 16 * MiB), kAlignment) << n;
  EXPECT_EQ(size_class(257, 16 * MiB), 512u);
}

TEST(SizeClass, EightClassesPerDoubling) {
  // From 2 KiB on a doubling's eighth is at least 256 bytes, so each doubling
  // (2^k, 2^(k+1)] has exactly the classes 2^k + i * 2^k / 8, i = 1..8.
  for (int k = 11; k < 24; ++k) {
    const std::size_t base = std::size_t{1} << k, step = base / 8;
    for (std::size_t i = 1; i <= 8; ++i) {
      ASSERT_EQ(size_class(base + (i - 1) * step + 1, 16 * MiB), base + i * step) << "k=" << k << " i=" << i;
      ASSERT_EQ(size_class(base + i * step, 16 * MiB), base + i * step) << "k=" << k << " i=" << i;
    }
  }
  // Below 2 KiB the 256-byte minimum step wins.
  EXPECT_EQ(size_class(1025, 16 * MiB), 1280u);
  EXPECT_EQ(size_class(1281, 16 * MiB), 1536u);
}

TEST(SizeClass, RoundsUpMonotonicallyWastingAtMostAnEighth) {
  for (std::size_t threshold : {256 * KiB, 16 * MiB}) {
    SCOPED_TRACE("threshold " + std::to_string(threshold));
    std::size_t prev = 0;
    const auto check = [&](std::size_t n) {
      const std::size_t c = size_class(n, threshold);
      if (c < n || c % kAlignment != 0 || c < prev) return false;
      // A class is its own class: a block's size maps back to itself.
      if (n <= threshold && size_class(c, threshold) != c) return false;
      // Own segments waste less than their granule; classes at most an eighth,
      // or below 2 KiB less than the 256-byte minimum step.
      const std::size_t waste = c - n;
      if (n > threshold) {
        if (c % kOwnSegmentGranule != 0 || waste >= kOwnSegmentGranule) return false;
      } else if (n > 2 * KiB ? waste > c / 8 : waste >= kAlignment) {
        return false;
      }
      prev = c;
      return true;
    };
    // Every size up to 1 MiB crosses the small, medium and own ranges of the
    // 256 KiB threshold; then sorted random sizes up to the largest request.
    for (std::size_t n = 1; n <= MiB; ++n) ASSERT_TRUE(check(n)) << "bytes " << n;
    std::mt19937_64 rng(threshold);
    std::vector<std::size_t> sizes;
    for (int i = 0; i < 20000; ++i) sizes.push_back(MiB + rng() % kMaxRequestBytes);
    sizes.push_back(kMaxRequestBytes);
    std::sort(sizes.begin(), sizes.end());
    for (std::size_t n : sizes) ASSERT_TRUE(check(n)) << "bytes " << n;
  }
}

TEST(SizeClass, AboveTheThresholdRoundsToTheOwnSegmentGranule) {
  EXPECT_EQ(size_class(256 * KiB, 256 * KiB), 256 * KiB);
  EXPECT_EQ(size_class(256 * KiB + 1, 256 * KiB), 320 * KiB);            // not the 288 KiB class
  EXPECT_EQ(size_class(100 * MiB + 1, 16 * MiB), 100 * MiB + 64 * KiB);  // not 112 MiB
  EXPECT_EQ(size_class(kMaxRequestBytes, 16 * MiB), kMaxRequestBytes);
}

// --- placement -----------------------------------------------------------------

TEST(HostPool, BlocksAreAlignedInsideTheirSegmentAndNeverOverlap) {
  for (bool mapped : {true, false}) {
    SCOPED_TRACE(mapped ? "mapped" : "unmapped");
    Fixture f(small_options(), mapped);
    struct Live {
      HostPool::Allocation a;
      std::size_t bytes;
      std::uint64_t tag;
    };
    std::vector<Live> live;
    std::mt19937_64 rng(mapped ? 7 : 8);
    std::uint64_t tag = 1;
    const auto verify_all = [&] {
      std::vector<HostPool::Allocation> sorted;
      for (const Live& l : live) {
        ASSERT_EQ(find_pattern_damage(l.a.host, l.bytes, l.tag), -1) << "block " << l.a.host << " was overwritten";
        sorted.push_back(l.a);
      }
      std::sort(sorted.begin(), sorted.end(), [](auto& x, auto& y) { return x.host < y.host; });
      for (std::size_t i = 1; i < sorted.size(); ++i)
        ASSERT_LE(static_cast<char*>(sorted[i - 1].host) + sorted[i - 1].size, sorted[i].host) << "blocks overlap";
    };
    for (int op = 0; op < 800; ++op) {
      if (live.size() < 40 && (live.empty() || rng() % 3 != 0)) {
        // 1 B .. 1 MiB, log-uniform: small, medium and own blocks.
        std::size_t bytes = std::size_t{1} << (rng() % 20);
        bytes += rng() % bytes;
        const auto a = f.pool->allocate(bytes);
        ASSERT_TRUE(well_formed(*f.mem, a, bytes, small_options().own_segment_threshold));
        write_pattern(a.host, bytes, tag);
        live.push_back({a, bytes, tag++});
      } else {
        const std::size_t i = rng() % live.size();
        ASSERT_EQ(find_pattern_damage(live[i].a.host, live[i].bytes, live[i].tag), -1);
        f.pool->deallocate(live[i].a.host);
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
      }
      if (op % 50 == 0) {
        ASSERT_NO_FATAL_FAILURE(verify_all());
      }
    }
    ASSERT_NO_FATAL_FAILURE(verify_all());
    for (const Live& l : live) f.pool->deallocate(l.a.host);
    f.pool->check_invariants();
    EXPECT_EQ(f.stats().live_blocks, 0u);
    EXPECT_EQ(f.stats().cached_free_bytes, f.stats().reserved_bytes);
  }
}

TEST(HostPool, FreedBlockIsServedFromTheCache) {
  Fixture f;
  const auto a = f.pool->allocate(1000);
  auto s = f.stats();
  EXPECT_EQ(s.system_allocs, 1u);
  EXPECT_EQ(s.cache_misses, 1u);
  EXPECT_EQ(s.cache_hits, 0u);
  EXPECT_EQ(s.requested_bytes, 1000u);
  EXPECT_EQ(s.allocated_bytes, 1024u);
  EXPECT_EQ(s.reserved_bytes, 64 * KiB);
  EXPECT_EQ(s.cached_free_bytes, 64 * KiB - 1024);
  EXPECT_EQ(a.size, 1024u);

  f.pool->deallocate(a.host);
  s = f.stats();
  EXPECT_EQ(s.requested_bytes, 0u);
  EXPECT_EQ(s.allocated_bytes, 0u);
  EXPECT_EQ(s.cached_free_bytes, s.reserved_bytes);
  EXPECT_EQ(f.mem->live_segments(), 1u);  // cached, not given back

  const auto b = f.pool->allocate(1000);
  EXPECT_EQ(b.host, a.host);  // best fit, lowest address: the same block
  const auto c = f.pool->allocate(3000);
  EXPECT_NE(c.host, b.host);
  EXPECT_NE(segment_start(*f.mem, c.host), 0u);
  EXPECT_EQ(segment_start(*f.mem, c.host), segment_start(*f.mem, b.host));
  s = f.stats();
  EXPECT_EQ(s.cache_hits, 2u);
  EXPECT_EQ(s.cache_misses, 1u);
  EXPECT_EQ(s.system_allocs, 1u);
  EXPECT_EQ(f.mem->allocs(), 1u);
  EXPECT_EQ(s.requested_bytes, 4000u);
  EXPECT_EQ(s.allocated_bytes, 1024u + 3072u);
  EXPECT_EQ(s.live_blocks, 2u);
  EXPECT_EQ(s.peak_requested_bytes, 4000u);
  EXPECT_EQ(s.peak_allocated_bytes, 4096u);
  EXPECT_EQ(s.peak_reserved_bytes, 64 * KiB);
  f.pool->deallocate(b.host);
  f.pool->deallocate(c.host);
  const auto d = f.pool->allocate(10);
  s = f.stats();
  EXPECT_EQ(s.peak_requested_bytes, 4000u);  // peaks outlive the blocks
  EXPECT_EQ(s.peak_allocated_bytes, 4096u);
  EXPECT_EQ(s.allocated_bytes, 256u);
  f.pool->deallocate(d.host);
  f.pool->check_invariants();
}

// Four blocks that fill one 1 MiB segment; after any free order the segment
// is one free block again, which a request for all of it proves.
TEST(HostPool, SplitBlocksCoalesceInAnyFreeOrder) {
  PoolOptions o = small_options();
  o.own_segment_threshold = 1 * MiB;  // so a 1 MiB request is medium, carved from a large segment
  Fixture f(o);
  const std::size_t sizes[] = {128 * KiB, 256 * KiB, 384 * KiB, 256 * KiB};  // classes summing to 1 MiB
  const auto fill = [&] {
    std::vector<HostPool::Allocation> v;
    for (std::size_t n : sizes) v.push_back(f.pool->allocate(n));
    return v;
  };
  std::vector<HostPool::Allocation> first = fill();
  const auto seg = f.mem->segment_of(first[0].host);
  ASSERT_TRUE(seg);
  ASSERT_EQ(seg->bytes, 1 * MiB);
  for (const auto& a : first) ASSERT_EQ(segment_start(*f.mem, a.host), seg->host);

  // Freed neighbours in the middle serve a request as large as both.
  f.pool->deallocate(first[1].host);
  f.pool->deallocate(first[2].host);
  f.pool->check_invariants();
  const auto middle = f.pool->allocate(640 * KiB);
  EXPECT_EQ(middle.host, first[1].host);
  EXPECT_EQ(f.stats().system_allocs, 1u);
  f.pool->deallocate(middle.host);
  f.pool->deallocate(first[0].host);
  f.pool->deallocate(first[3].host);

  std::vector<int> order = {0, 1, 2, 3};
  do {
    SCOPED_TRACE("free order " + std::to_string(order[0]) + std::to_string(order[1]) + std::to_string(order[2]) +
                 std::to_string(order[3]));
    const auto blocks = fill();
    for (std::size_t i = 0; i < blocks.size(); ++i) ASSERT_EQ(blocks[i].host, first[i].host);
    for (int i : order) {
      f.pool->deallocate(blocks[i].host);
      ASSERT_NO_THROW(f.pool->check_invariants());
    }
    const auto s = f.stats();
    ASSERT_EQ(s.segments, 1u);
    ASSERT_EQ(s.cached_free_bytes, 1 * MiB);
    ASSERT_EQ(s.reserved_bytes, 1 * MiB);
  } while (std::next_permutation(order.begin(), order.end()));

  const auto whole = f.pool->allocate(1 * MiB);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(whole.host), seg->host);
  EXPECT_EQ(whole.size, 1 * MiB);
  EXPECT_EQ(f.stats().system_allocs, 1u);
  f.pool->deallocate(whole.host);
}

// An own segment, once cached, serves smaller requests by splitting: the rest
// stays free for others, and the blocks merge back when freed.
TEST(HostPool, ACachedOwnSegmentIsSplitForSmallerRequestsAndMergesBack) {
  Fixture f;
  const auto a = f.pool->allocate(1 * MiB);
  ASSERT_EQ(segment_bytes(*f.mem, a.host), 1 * MiB);
  EXPECT_EQ(a.size, 1 * MiB);
  f.pool->deallocate(a.host);
  const auto b = f.pool->allocate(832 * KiB);
  EXPECT_EQ(b.host, a.host);
  EXPECT_EQ(b.size, 832 * KiB);
  EXPECT_EQ(f.stats().cached_free_bytes, 192 * KiB) << "the rest of the segment stays free";
  const auto c = f.pool->allocate(192 * KiB);  // served by the rest
  EXPECT_EQ(c.host, static_cast<char*>(a.host) + 832 * KiB);
  EXPECT_EQ(f.stats().system_allocs, 1u);
  f.pool->deallocate(b.host);
  f.pool->deallocate(c.host);
  EXPECT_EQ(f.stats().cached_free_bytes, 1 * MiB);
  const auto d = f.pool->allocate(1 * MiB);  // merged back: the whole segment again
  EXPECT_EQ(d.host, a.host);
  EXPECT_EQ(f.stats().system_allocs, 1u);
  f.pool->deallocate(d.host);
  f.pool->check_invariants();
}

// The Note: "larger requests get a segment of their own". A request above
// own_segment_threshold must not be carved out of a large segment's or the
// reserve's free space.
// Above the threshold: free space of a large segment or of the reserve serves
// the request when it fits (it exists to be used); otherwise the request gets
// a new segment of exactly its rounded size, not a large slab.
TEST(HostPool, RequestAboveTheThresholdGetsASegmentOfItsOwnWhenNothingCachedFits) {
  {
    SCOPED_TRACE("nothing cached: a segment of its own");
    Fixture f;
    const auto big = f.pool->allocate(300 * KiB);
    EXPECT_EQ(big.size, 320 * KiB);
    EXPECT_EQ(segment_bytes(*f.mem, big.host), 320 * KiB);
    EXPECT_EQ(f.stats().system_allocs, 1u);
    f.pool->deallocate(big.host);
  }
  {
    SCOPED_TRACE("next to a large segment with 960 KiB free: carved from it");
    Fixture f;
    const auto medium = f.pool->allocate(64 * KiB);
    ASSERT_EQ(segment_bytes(*f.mem, medium.host), 1 * MiB);
    const auto big = f.pool->allocate(300 * KiB);
    EXPECT_EQ(big.size, 320 * KiB);
    EXPECT_EQ(segment_bytes(*f.mem, big.host), 1 * MiB);
    EXPECT_EQ(f.stats().system_allocs, 1u);
    f.pool->deallocate(big.host);
    f.pool->deallocate(medium.host);
    f.pool->check_invariants();
  }
  {
    SCOPED_TRACE("next to a free 1 MiB reserve: carved from it");
    PoolOptions o = small_options();
    o.reserve_bytes = 1 * MiB;
    Fixture f(o);
    const auto big = f.pool->allocate(300 * KiB);
    EXPECT_EQ(segment_bytes(*f.mem, big.host), 1 * MiB);
    EXPECT_EQ(f.stats().system_allocs, 1u);
    f.pool->deallocate(big.host);
  }
}

// --- capacity ------------------------------------------------------------------

TEST(HostPool, OverCapacityCachedSegmentsAreGivenBackFirst) {
  PoolOptions o = small_options();
  o.capacity = 1 * MiB;
  Fixture f(o);
  f.pool->deallocate(f.pool->allocate(100).host);  // a cached 64 KiB small segment
  ASSERT_EQ(f.stats().reserved_bytes, 64 * KiB);
  // A 1 MiB large segment fits only once the cached one is gone.
  const auto a = f.pool->allocate(128 * KiB);
  auto s = f.stats();
  EXPECT_EQ(s.system_frees, 1u);
  EXPECT_EQ(s.reserved_bytes, 1 * MiB);
  EXPECT_EQ(f.mem->live_segments(), 1u);
  EXPECT_EQ(segment_bytes(*f.mem, a.host), 1 * MiB);
  f.pool->deallocate(a.host);
  f.pool->check_invariants();
}

TEST(HostPool, UnderCapacityPressureASegmentIsSizedToTheRequest) {
  PoolOptions o = small_options();
  o.capacity = 512 * KiB;  // no room for a 1 MiB large segment
  Fixture f(o);
  const auto a = f.pool->allocate(128 * KiB);
  EXPECT_EQ(segment_bytes(*f.mem, a.host), 128 * KiB);
  EXPECT_EQ(f.stats().reserved_bytes, 128 * KiB);
  f.pool->deallocate(a.host);
  f.pool->check_invariants();
}

// The transfer engine may hold blocks for copies that completed but were not
// polled yet: an allocation over the capacity asks it to let go first.
TEST(HostPool, OverCapacityTheReclaimerIsAskedBeforeTheAllocationFails) {
  PoolOptions o = small_options();
  o.capacity = 1 * MiB;
  Fixture f(o);
  void* held = f.pool->allocate(600 * KiB).host;  // an own segment: most of the capacity
  int calls = 0;
  f.pool->set_reclaimer([&]() -> std::size_t {
    ++calls;
    if (held == nullptr) return 0;
    f.pool->deallocate(held);  // the reclaimer frees blocks of this very pool (no lock is held)
    held = nullptr;
    return 1;
  });
  const auto small = f.pool->allocate(100);  // fits: the reclaimer is not asked
  EXPECT_EQ(calls, 0);
  const auto a = f.pool->allocate(700 * KiB);  // fits only once the held block is let go of
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(f.stats().reclaims, 1u);
  EXPECT_THROW(f.pool->allocate(900 * KiB), PoolCapacityError);  // nothing left to let go of: a real error
  EXPECT_EQ(calls, 2) << "asked once per allocation";
  f.pool->deallocate(a.host);
  f.pool->deallocate(small.host);
  f.pool->set_reclaimer(nullptr);
  f.pool->check_invariants();
}

TEST(HostPool, CapacityErrorNamesRequestAndCapacityAndLeavesThePoolUsable) {
  PoolOptions o = small_options();
  o.capacity = 1 * MiB;
  Fixture f(o);
  const auto a = f.pool->allocate(128 * KiB);  // a 1 MiB large segment: the whole capacity
  write_pattern(a.host, 128 * KiB, 1);
  const auto before = f.stats();
  try {
    f.pool->allocate(921600);  // 900 KiB: own segment of 960 KiB
    FAIL() << "expected PoolCapacityError";
  } catch (const PoolCapacityError& e) {
    EXPECT_TRUE(contains(e.what(), "921600")) << e.what();
    EXPECT_TRUE(contains(e.what(), "1048576")) << e.what();
  }
  f.pool->check_invariants();
  const auto after = f.stats();
  EXPECT_EQ(after.reserved_bytes, before.reserved_bytes);
  EXPECT_EQ(after.live_blocks, 1u);
  EXPECT_EQ(after.requested_bytes, 128 * KiB);
  EXPECT_EQ(find_pattern_damage(a.host, 128 * KiB, 1), -1);
  // Still usable: a medium block from the segment's free space, then, with
  // everything freed, the whole capacity at once.
  const auto b = f.pool->allocate(200 * KiB);
  f.pool->deallocate(b.host);
  f.pool->deallocate(a.host);
  const auto all = f.pool->allocate(1 * MiB);
  EXPECT_LE(f.stats().reserved_bytes, 1 * MiB);
  f.pool->deallocate(all.host);
  f.pool->check_invariants();
}

// --- reserve -------------------------------------------------------------------

TEST(HostPool, ReserveIsPreallocatedServesEverySizeClassAndSurvivesTrim) {
  PoolOptions o = small_options();
  o.reserve_bytes = 1 * MiB + 100;  // rounded up to the 64 KiB granule
  Fixture f(o);
  const std::size_t reserve = 1 * MiB + 64 * KiB;
  auto s = f.stats();
  EXPECT_EQ(s.reserved_bytes, reserve);
  EXPECT_EQ(s.system_allocs, 1u);
  EXPECT_EQ(s.cached_free_bytes, reserve);
  ASSERT_EQ(f.mem->live_segments(), 1u);
  ASSERT_EQ(f.mem->live_bytes(), reserve);

  const auto m = f.pool->allocate(128 * KiB);
  const auto seg = f.mem->segment_of(m.host);
  ASSERT_TRUE(seg);
  EXPECT_EQ(seg->bytes, reserve);  // carved from the reserve
  EXPECT_EQ(f.stats().system_allocs, 1u);
  EXPECT_EQ(f.stats().cache_hits, 1u);
  const auto small = f.pool->allocate(100);  // no small segment has room: the reserve serves it too
  EXPECT_EQ(segment_bytes(*f.mem, small.host), reserve);
  EXPECT_EQ(f.stats().system_allocs, 1u);
  const auto small2 = f.pool->allocate(100);
  f.pool->deallocate(m.host);
  f.pool->deallocate(small.host);
  f.pool->deallocate(small2.host);
  f.pool->deallocate(f.pool->allocate(200 * KiB).host);  // the reserve again (it merged back)
  EXPECT_EQ(f.stats().system_allocs, 1u);
  f.pool->deallocate(f.pool->allocate(100 * KiB + 2 * MiB).host);  // larger than the reserve: an own segment

  EXPECT_EQ(f.pool->trim(), 2 * MiB + 128 * KiB);  // the own segment, not the reserve
  EXPECT_EQ(f.pool->trim(), 0u);
  EXPECT_EQ(f.stats().reserved_bytes, reserve);
  EXPECT_EQ(f.mem->live_segments(), 1u);
  f.pool->close();
  EXPECT_EQ(f.stats().reserved_bytes, 0u);
  EXPECT_EQ(f.mem->live_segments(), 0u);
  f.pool->check_invariants();
}

TEST(HostPool, ReserveAboveTheCapacityThrowsAndAReserveOfAllOfItServesSmallBlocks) {
  auto mem = FakeMemory::make();
  auto streams = FakeStreams::make();
  PoolOptions o = small_options();
  o.capacity = 1 * MiB;
  o.reserve_bytes = 1 * MiB + 1;
  EXPECT_THROW(HostPool(mem->provider(), streams->source(), o), PoolCapacityError);
  EXPECT_EQ(mem->allocs(), 0u);

  // The reserve counts against the capacity, and serves every size class: a
  // reserve of all of it serves small blocks too (it did not, once).
  o.reserve_bytes = 1 * MiB;
  HostPool pool(mem->provider(), streams->source(), o);
  const auto s = pool.allocate(100);
  const auto m = pool.allocate(200 * KiB);
  EXPECT_EQ(pool.stats().system_allocs, 1u);
  pool.deallocate(s.host);
  pool.deallocate(m.host);
  pool.check_invariants();
}

// Rounding a huge reserve up to the granule must not wrap around to 0.
TEST(HostPool, HugeReserveThrowsCapacityError) {
  auto mem = FakeMemory::make();
  auto streams = FakeStreams::make();
  PoolOptions o = small_options();
  o.capacity = 1 * MiB;
  o.reserve_bytes = SIZE_MAX;
  EXPECT_THROW(HostPool(mem->provider(), streams->source(), o), PoolCapacityError);
  EXPECT_EQ(mem->allocs(), 0u);
}

TEST(HostPool, InvalidOptionsThrowPoolErrorBeforeAllocating) {
  auto mem = FakeMemory::make();
  auto streams = FakeStreams::make();
  const auto bad = [](auto change) {
    PoolOptions o = small_options();
    o.reserve_bytes = 64 * KiB;  // nothing may be allocated before the options are checked
    change(o);
    return o;
  };
  const std::vector<std::pair<const char*, PoolOptions>> cases = {
      {"capacity < 256", bad([](PoolOptions& o) { o.capacity = 255; })},
      {"small_max 0", bad([](PoolOptions& o) { o.small_max = 0; })},
      {"small_max not a multiple of 256", bad([](PoolOptions& o) { o.small_max = 1000; })},
      {"small segment < small_max", bad([](PoolOptions& o) { o.small_segment_bytes = 2 * KiB; })},
      {"threshold == small_max", bad([](PoolOptions& o) { o.own_segment_threshold = o.small_max; })},
      {"large segment < threshold", bad([](PoolOptions& o) { o.large_segment_bytes = 128 * KiB; })},
      {"small segment not a multiple of 256", bad([](PoolOptions& o) { o.small_segment_bytes = 64 * KiB + 1; })},
      {"large segment not a multiple of 256", bad([](PoolOptions& o) { o.large_segment_bytes = MiB + 1; })},
  };
  for (const auto& [what, o] : cases) {
    SCOPED_TRACE(what);
    EXPECT_THROW(HostPool(mem->provider(), streams->source(), o), PoolError);
  }
  EXPECT_THROW(HostPool(nullptr, streams->source(), small_options()), PoolError);
  EXPECT_THROW(HostPool(mem->provider(), nullptr, small_options()), PoolError);
  EXPECT_EQ(mem->allocs(), 0u);

  // The boundaries themselves are valid.
  PoolOptions edge = small_options();
  edge.small_segment_bytes = edge.small_max;
  edge.large_segment_bytes = edge.own_segment_threshold;
  edge.capacity = kAlignment;
  HostPool pool(mem->provider(), streams->source(), edge);
  pool.deallocate(pool.allocate(1).host);
}

// --- giving memory back --------------------------------------------------------

TEST(HostPool, FullyFreeSegmentsBeyondMaxCachedBytesGoBackOnFree) {
  {
    PoolOptions o = small_options();
    o.max_cached_bytes = 64 * KiB;  // one small segment
    Fixture f(o);
    std::vector<void*> blocks;
    for (int i = 0; i < 17; ++i) blocks.push_back(f.pool->allocate(4 * KiB).host);  // 16 fill a segment
    ASSERT_EQ(f.mem->live_segments(), 2u);
    const void* last = blocks.back();
    blocks.pop_back();
    for (void* p : blocks) f.pool->deallocate(p);
    EXPECT_EQ(f.stats().system_frees, 0u);  // one fully free segment: within the cap
    EXPECT_EQ(f.mem->live_segments(), 2u);
    f.pool->deallocate(const_cast<void*>(last));
    auto s = f.stats();
    EXPECT_EQ(s.system_frees, 1u);
    EXPECT_EQ(s.reserved_bytes, 64 * KiB);
    EXPECT_EQ(s.cached_free_bytes, 64 * KiB);
    EXPECT_EQ(f.mem->live_segments(), 1u);
    f.pool->check_invariants();
  }
  {
    PoolOptions o = small_options();
    o.max_cached_bytes = 0;
    Fixture f(o);
    f.pool->deallocate(f.pool->allocate(100).host);
    EXPECT_EQ(f.stats().reserved_bytes, 0u);
    EXPECT_EQ(f.mem->live_segments(), 0u);
    f.pool->check_invariants();
  }
}

TEST(HostPool, TrimGivesBackFullyFreeSegmentsOnly) {
  Fixture f;
  std::vector<void*> blocks;
  for (int i = 0; i < 16; ++i) blocks.push_back(f.pool->allocate(4 * KiB).host);  // one full small segment
  const auto keep = f.pool->allocate(4 * KiB);                                    // a second one
  write_pattern(keep.host, 4 * KiB, 42);
  for (void* p : blocks) f.pool->deallocate(p);
  f.pool->deallocate(f.pool->allocate(128 * KiB).host);  // a cached large segment
  ASSERT_EQ(f.stats().reserved_bytes, 64 * KiB + 64 * KiB + 1 * MiB);

  EXPECT_EQ(f.pool->trim(), 64 * KiB + 1 * MiB);
  const auto s = f.stats();
  EXPECT_EQ(s.reserved_bytes, 64 * KiB);
  EXPECT_EQ(s.system_frees, 2u);
  EXPECT_EQ(f.mem->live_segments(), 1u);
  EXPECT_EQ(f.mem->live_bytes(), 64 * KiB);
  EXPECT_EQ(find_pattern_damage(keep.host, 4 * KiB, 42), -1);
  EXPECT_EQ(f.pool->trim(), 0u);
  f.pool->deallocate(keep.host);
  f.pool->check_invariants();
}

// trim() polls events first; what that poll gives back is also released by
// trim and must be in its result.
TEST(HostPool, TrimCountsSegmentsReleasedByItsOwnEventPoll) {
  PoolOptions o = small_options();
  o.max_cached_bytes = 0;
  Fixture f(o);
  const auto a = f.pool->allocate(100);
  f.free_in_use(a.host, kS0);
  f.streams->complete(kS0);
  const std::size_t before = f.stats().reserved_bytes;
  const std::size_t released = f.pool->trim();
  const std::size_t after = f.stats().reserved_bytes;
  EXPECT_EQ(after, 0u);
  EXPECT_EQ(released, before - after);
}

// --- stream-ordered reuse -------------------------------------------------------

TEST(HostPool, BlockIsNotReusedUntilItsStreamCompletes) {
  Fixture f;
  const auto a = f.pool->allocate(4 * KiB);
  f.free_in_use(a.host, kS0);  // a copy into the block, not done yet
  EXPECT_EQ(f.streams->records(), 1u);
  auto s = f.stats();
  EXPECT_EQ(s.waiting_blocks, 1u);
  EXPECT_EQ(s.waiting_bytes, 4 * KiB);
  EXPECT_EQ(s.allocated_bytes, 4 * KiB);  // still taken
  EXPECT_EQ(s.live_blocks, 0u);
  EXPECT_FALSE(f.pool->owns(a.host));

  const auto b = f.pool->allocate(4 * KiB);
  EXPECT_FALSE(overlaps(b, a.host, a.size));
  EXPECT_EQ(f.pool->process_events(), 0u);
  EXPECT_EQ(f.stats().waiting_blocks, 1u);
  EXPECT_EQ(f.streams->synchronizes(), 0u);  // no capacity pressure: the pool never blocks

  f.streams->complete(kS0);
  EXPECT_EQ(f.pool->process_events(), 1u);
  s = f.stats();
  EXPECT_EQ(s.waiting_blocks, 0u);
  EXPECT_EQ(s.waiting_bytes, 0u);
  EXPECT_EQ(s.allocated_bytes, 4 * KiB);  // b only
  EXPECT_EQ(f.streams->live_events(), 0u);
  const auto c = f.pool->allocate(4 * KiB);
  EXPECT_EQ(c.host, a.host);
  f.pool->deallocate(b.host);
  f.pool->deallocate(c.host);
  f.pool->check_invariants();
}

TEST(HostPool, BlockUsedOnTwoStreamsWaitsForBoth) {
  for (bool first_stream_first : {true, false}) {
    SCOPED_TRACE(first_stream_first ? "s0 completes first" : "s1 completes first");
    Fixture f;
    const auto a = f.pool->allocate(4 * KiB);
    f.pool->record_use(a.host, kS0);
    f.pool->record_use(a.host, kS1);
    f.streams->enqueue(kS0);
    f.streams->enqueue(kS1);
    f.pool->deallocate(a.host);
    EXPECT_EQ(f.streams->records(), 2u);
    f.streams->complete(first_stream_first ? kS0 : kS1);
    EXPECT_EQ(f.pool->process_events(), 0u);
    const auto b = f.pool->allocate(4 * KiB);
    EXPECT_FALSE(overlaps(b, a.host, a.size));
    f.streams->complete(first_stream_first ? kS1 : kS0);
    EXPECT_EQ(f.pool->process_events(), 1u);
    EXPECT_EQ(f.pool->allocate(4 * KiB).host, a.host);
    f.pool->check_invariants();
  }
}

// A cache hit makes no runtime call; a miss first polls parked blocks.
TEST(HostPool, ParkedBlocksArePolledOnACacheMissOnly) {
  Fixture f;
  const auto a = f.pool->allocate(4 * KiB);
  f.free_in_use(a.host, kS0);
  f.streams->complete(kS0);
  const auto hit = f.pool->allocate(4 * KiB);  // the rest of the small segment
  EXPECT_EQ(f.streams->queries(), 0u);
  EXPECT_EQ(f.stats().waiting_blocks, 1u);
  const auto miss = f.pool->allocate(128 * KiB);  // needs a large segment
  EXPECT_GE(f.streams->queries(), 1u);
  EXPECT_EQ(f.stats().waiting_blocks, 0u);
  f.pool->deallocate(hit.host);
  f.pool->deallocate(miss.host);
  f.pool->check_invariants();
}

TEST(HostPool, RecordUseTwiceOnAStreamRecordsOneEvent) {
  Fixture f;
  const auto a = f.pool->allocate(4 * KiB);
  f.pool->record_use(a.host, kS0);
  f.pool->record_use(a.host, kS0);
  f.pool->record_use(a.host, FakeStreams::stream(0, /*device=*/1));  // same handle, other device
  f.pool->deallocate(a.host);
  EXPECT_EQ(f.streams->records(), 2u);
  // A stream with nothing queued is done at once, but only a poll notices.
  EXPECT_EQ(f.stats().waiting_blocks, 1u);
  EXPECT_EQ(f.pool->process_events(), 1u);
  f.pool->check_invariants();
}

TEST(HostPool, OverCapacityAllocateWaitsForParkedBlocks) {
  PoolOptions o = small_options();
  o.capacity = 512 * KiB;
  Fixture f(o);
  const auto a = f.pool->allocate(512 * KiB);  // an own segment: the whole capacity
  f.pool->record_use(a.host, kS0);
  f.streams->enqueue(kS0, 3);
  f.pool->deallocate(a.host);
  f.streams->complete_all_after_queries(1000);  // ends the loop of a pool that only polls
  // Only the parked block can serve this: the pool blocks on its event.
  const auto b = f.pool->allocate(512 * KiB);
  EXPECT_EQ(b.host, a.host);
  EXPECT_EQ(f.streams->synchronizes(), 1u);
  EXPECT_LT(f.streams->queries(), 100u);
  EXPECT_TRUE(f.streams->idle(kS0));
  auto s = f.stats();
  EXPECT_EQ(s.system_allocs, 1u);
  EXPECT_EQ(s.waiting_blocks, 0u);
  EXPECT_EQ(s.live_blocks, 1u);
  f.pool->deallocate(b.host);
  f.pool->check_invariants();
}

// An event whose query keeps failing never completes; an allocation that
// could only be served by its block must fail, not spin. The fake's query
// starts answering after 1000 failures, so a spinning pool ends the test
// (with a failure) instead of hanging it.
TEST(HostPool, OverCapacityAllocateDoesNotSpinOnAFailingEvent) {
  PoolOptions o = small_options();
  o.capacity = 512 * KiB;
  Fixture f(o);
  const auto a = f.pool->allocate(512 * KiB);
  f.free_in_use(a.host, kS0);
  f.streams->fail_queries(1000);
  f.streams->complete_all_after_queries(2000);  // a pool that neither synchronizes nor gives up
  try {
    const auto b = f.pool->allocate(512 * KiB);
    ADD_FAILURE() << "allocate succeeded after " << f.streams->queries() << " failed event queries";
    f.pool->deallocate(b.host);
  } catch (const PoolError&) {
  }
  EXPECT_LT(f.streams->queries(), 100u);
  f.streams->fail_queries(0);
  f.pool->process_events();
  f.pool->check_invariants();
}

// --- misuse --------------------------------------------------------------------

TEST(HostPool, BadInputThrowsPoolErrorAndChangesNothing) {
  Fixture f;
  const auto a = f.pool->allocate(3000);
  const auto b = f.pool->allocate(100 * KiB);
  write_pattern(a.host, 3000, 1);
  write_pattern(b.host, 100 * KiB, 2);
  const auto freed = f.pool->allocate(200);
  f.pool->deallocate(freed.host);
  const auto parked = f.pool->allocate(300);
  f.free_in_use(parked.host, kS0);
  const auto before = f.stats();

  int local = 0;
  void* heap = std::malloc(64);
  const auto rejected = [&](const char* what, auto call) {
    SCOPED_TRACE(what);
    bad_input_error(call);
    EXPECT_NO_THROW(f.pool->check_invariants());
    EXPECT_EQ(find_pattern_damage(a.host, 3000, 1), -1);
    EXPECT_EQ(find_pattern_damage(b.host, 100 * KiB, 2), -1);
    expect_same_holdings(f.stats(), before);
    EXPECT_EQ(f.mem->allocs(), 2u);
  };
  rejected("allocate(0)", [&] { f.pool->allocate(0); });
  rejected("allocate(2^48 + 1)", [&] { f.pool->allocate(kMaxRequestBytes + 1); });
  rejected("allocate(SIZE_MAX)", [&] { f.pool->allocate(SIZE_MAX); });
  rejected("deallocate(nullptr)", [&] { f.pool->deallocate(nullptr); });
  rejected("deallocate(stack)", [&] { f.pool->deallocate(&local); });
  rejected("deallocate(malloc)", [&] { f.pool->deallocate(heap); });
  rejected("deallocate(inside a block)", [&] { f.pool->deallocate(static_cast<char*>(a.host) + 256); });
  rejected("double deallocate", [&] { f.pool->deallocate(freed.host); });
  rejected("deallocate of a parked block", [&] { f.pool->deallocate(parked.host); });
  rejected("record_use after free", [&] { f.pool->record_use(freed.host, kS0); });
  rejected("record_use of a parked block", [&] { f.pool->record_use(parked.host, kS1); });
  rejected("record_use inside a block", [&] { f.pool->record_use(static_cast<char*>(b.host) + 256, kS0); });
  std::free(heap);
  EXPECT_TRUE(f.pool->owns(a.host));
  EXPECT_FALSE(f.pool->owns(freed.host));
  EXPECT_FALSE(f.pool->owns(static_cast<char*>(a.host) + 256));
  f.pool->deallocate(a.host);
  f.pool->deallocate(b.host);
  f.streams->complete_all();
}

TEST(HostPool, CloseRefusesAllocationsAndReleasesBlocksAsTheyAreFreed) {
  PoolOptions o = small_options();
  o.reserve_bytes = 128 * KiB;
  Fixture f(o);
  const auto medium = f.pool->allocate(128 * KiB);  // the reserve, all of it
  const auto small = f.pool->allocate(100);         // a small segment (the reserve is full)
  ASSERT_EQ(segment_bytes(*f.mem, medium.host), 128 * KiB);
  ASSERT_EQ(segment_bytes(*f.mem, small.host), 64 * KiB);
  f.pool->deallocate(f.pool->allocate(200 * KiB).host);  // a cached large segment
  const auto parked = f.pool->allocate(2000);            // the small segment, parked on s0
  f.free_in_use(parked.host, kS0);
  write_pattern(small.host, 100, 1);
  write_pattern(medium.host, 128 * KiB, 2);
  ASSERT_EQ(f.mem->live_segments(), 3u);

  f.pool->close();
  EXPECT_TRUE(f.pool->closed());
  try {
    f.pool->allocate(100);
    ADD_FAILURE() << "allocate on a closed pool";
  } catch (const PoolError& e) {
    EXPECT_TRUE(contains(e.what(), "closed")) << e.what();
  }
  EXPECT_EQ(f.mem->live_segments(), 2u);  // the cached segment went at once
  EXPECT_EQ(f.stats().system_frees, 1u);
  // Live blocks stay valid.
  EXPECT_EQ(find_pattern_damage(small.host, 100, 1), -1);
  EXPECT_EQ(find_pattern_damage(medium.host, 128 * KiB, 2), -1);
  write_pattern(medium.host, 128 * KiB, 3);
  EXPECT_EQ(find_pattern_damage(medium.host, 128 * KiB, 3), -1);

  f.pool->deallocate(medium.host);  // the reserve goes back with its last block
  EXPECT_EQ(f.mem->live_segments(), 1u);
  f.pool->deallocate(small.host);  // the small segment still holds the parked block
  EXPECT_EQ(f.mem->live_segments(), 1u);
  f.streams->complete(kS0);
  EXPECT_EQ(f.pool->process_events(), 1u);
  EXPECT_EQ(f.mem->live_segments(), 0u);
  f.pool->close();  // idempotent
  const auto s = f.stats();
  EXPECT_EQ(s.reserved_bytes, 0u);
  EXPECT_EQ(s.segments, 0u);
  f.pool->check_invariants();
  EXPECT_TRUE(f.mem->all_released());
}

// --- failures of the provider and the event source -------------------------------

TEST(HostPool, ProviderFailureIsReportedAndHoldsNoCapacity) {
  PoolOptions o = small_options();
  o.capacity = 1 * MiB;
  Fixture f(o);
  f.mem->fail_next_allocate("injected: out of pinned memory");
  try {
    f.pool->allocate(128 * KiB);
    ADD_FAILURE() << "no exception";
  } catch (const PoolCapacityError& e) {
    ADD_FAILURE() << "not a capacity problem: " << e.what();
  } catch (const PoolError& e) {
    EXPECT_TRUE(contains(e.what(), "injected: out of pinned memory")) << e.what();
    EXPECT_TRUE(contains(e.what(), "fake host memory")) << e.what();
  }
  f.pool->check_invariants();
  EXPECT_EQ(f.stats().reserved_bytes, 0u);
  EXPECT_EQ(f.stats().live_blocks, 0u);
  // The capacity set aside for the failed call was given back: all of it fits.
  const auto a = f.pool->allocate(1 * MiB);
  f.pool->deallocate(a.host);
  f.pool->check_invariants();
}

TEST(HostPool, EventRecordFailureKeepsTheBlockOutOfUse) {
  Fixture f;
  const auto a = f.pool->allocate(4 * KiB);
  f.pool->record_use(a.host, kS0);
  f.streams->fail_next_record("injected: event record failed");
  try {
    f.pool->deallocate(a.host);
    ADD_FAILURE() << "no exception";
  } catch (const PoolError& e) {
    EXPECT_TRUE(contains(e.what(), "injected: event record failed")) << e.what();
  }
  EXPECT_FALSE(f.pool->owns(a.host));
  EXPECT_EQ(f.stats().waiting_blocks, 1u);
  f.pool->check_invariants();
  EXPECT_THROW(f.pool->deallocate(a.host), PoolError);

  // Whatever happens next, nothing overlaps the block.
  f.streams->complete_all();
  f.pool->process_events();
  f.pool->trim();
  std::vector<void*> blocks;
  for (int i = 0; i < 40; ++i) {
    const auto b = f.pool->allocate(4 * KiB);
    EXPECT_FALSE(overlaps(b, a.host, a.size));
    blocks.push_back(b.host);
  }
  for (void* p : blocks) f.pool->deallocate(p);
  f.pool->trim();
  EXPECT_TRUE(f.mem->segment_of(a.host));  // its segment stays until the pool goes
  f.pool->check_invariants();
}

TEST(HostPool, DestructorWaitsForParkedBlocksBeforeReleasingMemory) {
  auto mem = FakeMemory::make();
  auto streams = FakeStreams::make();
  std::map<std::uintptr_t, std::uint64_t> needed;  // segment -> stream work its block waits for
  std::vector<std::string> early;
  FakeStreams* st = streams.get();
  mem->on_release([&](const FakeMemory::Segment& s) {
    if (st->completed(kS0) < needed[s.host]) early.push_back("segment released while a stream still used it");
  });
  {
    HostPool pool(mem->provider(), streams->source(), small_options());
    // One parked block in each kind of segment: small, large, own.
    for (std::size_t n : {std::size_t{100}, 200 * KiB, 1 * MiB}) {
      const auto a = pool.allocate(n);
      pool.record_use(a.host, kS0);
      streams->enqueue(kS0, 5);
      needed[segment_start(*mem, a.host)] = streams->queued(kS0);
      pool.deallocate(a.host);
    }
    EXPECT_EQ(streams->synchronizes(), 0u);
    EXPECT_EQ(pool.stats().waiting_blocks, 3u);
  }
  EXPECT_EQ(streams->synchronizes(), 3u);
  EXPECT_TRUE(streams->idle(kS0));
  EXPECT_TRUE(early.empty()) << early.front();
  EXPECT_EQ(mem->releases(), 3u);
  EXPECT_EQ(streams->live_events(), 0u);
  EXPECT_TRUE(mem->all_released());
  mem->on_release(nullptr);
}

// The Note: the pool's lock is never held across a call into the provider or
// the event source (such calls can take milliseconds and driver-wide locks).
// Each such call here has another thread use the pool; that thread would block
// for good on a held lock, so the probe waits for it (a deadlock guard, not a
// timing check) and aborts with a message instead of hanging the suite.
TEST(HostPool, NoLockIsHeldAcrossProviderAndEventCalls) {
  PoolOptions o = small_options();
  o.capacity = 512 * KiB;
  Fixture f(o);
  std::map<std::string, int> probed;
  bool probing = true;
  HostPool* pool = f.pool.get();
  const auto probe = [&](const std::string& where) {
    if (!probing) return;
    ++probed[where];
    auto done = std::make_shared<std::promise<void>>();
    auto ready = done->get_future();
    std::thread([pool, done] {
      (void)pool->stats();
      done->set_value();
    }).detach();
    if (ready.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
      std::fprintf(stderr, "HostPool: lock held across the %s call\n", where.c_str());
      std::abort();
    }
  };
  f.mem->on_allocate([&](std::size_t) { probe("provider allocate"); });
  f.mem->on_release([&](const FakeMemory::Segment&) { probe("provider release"); });
  f.streams->on_call([&](const char* what) { probe(what); });

  const auto a = f.pool->allocate(512 * KiB);   // provider allocate
  f.free_in_use(a.host, kS0);                   // record
  EXPECT_EQ(f.pool->process_events(), 0u);      // query
  f.streams->complete_all_after_queries(1000);  // see OverCapacityAllocateWaitsForParkedBlocks
  const auto b = f.pool->allocate(512 * KiB);   // over capacity: synchronize, query
  f.pool->deallocate(b.host);
  EXPECT_EQ(f.pool->trim(), 512 * KiB);  // provider release
  probing = false;
  for (const char* call : {"provider allocate", "provider release", "record", "query", "synchronize"})
    EXPECT_GT(probed[call], 0) << call;
  f.mem->on_allocate(nullptr);
  f.mem->on_release(nullptr);
  f.streams->on_call(nullptr);
}

}  // namespace
}  // namespace hipferry::pool
