// Long random operation sequences on the pinned pool, checked after every
// operation against the pool's own invariants and a shadow model of what the
// caller knows: which blocks are live (they must never overlap and must keep
// their contents), what was requested, what the provider holds, and which
// freed blocks still wait on stream work (their memory must not come back
// before that work is done).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "csrc/core/host_pool/host_pool.h"
#include "csrc/core/host_pool/size_classes.h"
#include "tests/cpp/fake_host_memory.h"

namespace hipferry::pool {
namespace {

using testing::FakeMemory;
using testing::FakeStreams;
using testing::find_pattern_damage;
using testing::write_pattern;

constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr int kStreams = 3;

struct Variant {
  const char* name;
  std::size_t max_cached_bytes;
  std::size_t reserve_bytes;
  bool numa = false;          // requests name devices 0 and 1 (nodes 0, 1) or none (node 2)
  bool page_aligned = false;  // a third of the requests ask for kPageAlignment
};

// Small segments and a 64 MiB cap, so requests of 1 B..64 MiB hit every kind
// of segment and the capacity often.
PoolOptions options_for(const Variant& v) {
  PoolOptions o;
  o.small_max = 4 * KiB;
  o.small_segment_bytes = 64 * KiB;
  o.own_segment_threshold = 256 * KiB;
  o.large_segment_bytes = 1 * MiB;
  o.capacity = 64 * MiB;
  o.max_cached_bytes = v.max_cached_bytes;
  o.reserve_bytes = v.reserve_bytes;
  if (v.numa) {
    o.numa_node = 2;
    o.device_nodes = {0, 1};
  }
  return o;
}

// Log-uniform over 1 B..64 MiB, and now and then a size at an edge: class,
// segment, threshold, reserve and capacity boundaries.
std::size_t draw_size(std::mt19937_64& rng, const PoolOptions& o) {
  if (rng() % 16 == 0) {
    const std::size_t edges[] = {1,
                                 kAlignment - 1,
                                 kAlignment,
                                 kAlignment + 1,
                                 kPageAlignment - 1,
                                 kPageAlignment,
                                 kPageAlignment + 1,
                                 o.small_max - 1,
                                 o.small_max,
                                 o.small_max + 1,
                                 o.small_segment_bytes,
                                 o.own_segment_threshold,
                                 o.own_segment_threshold + 1,
                                 o.large_segment_bytes - 1,
                                 o.large_segment_bytes,
                                 o.large_segment_bytes + 1,
                                 4 * MiB,
                                 o.capacity / 2,
                                 o.capacity - kOwnSegmentGranule,
                                 o.capacity,
                                 o.capacity + 1};
    return edges[rng() % (sizeof edges / sizeof edges[0])];
  }
  const double e = std::uniform_real_distribution<double>(0.0, 26.0)(rng);
  return std::max<std::size_t>(1, static_cast<std::size_t>(std::exp2(e)));
}

std::size_t stride_for(std::size_t bytes) { return bytes <= 16 * KiB ? 8 : testing::sparse_stride(bytes); }

void run_sequence(std::uint64_t seed, const Variant& variant, int ops) {
  const PoolOptions o = options_for(variant);
  const std::size_t reserve = variant.reserve_bytes == 0 ? 0 : round_up(variant.reserve_bytes, kOwnSegmentGranule);
  auto mem = FakeMemory::make();
  auto streams = FakeStreams::make();
  auto pool = std::make_unique<HostPool>(mem->provider(), streams->source(), o);
  std::mt19937_64 rng(seed);
  // The reserve, the one segment made at construction, serves every node.
  const std::uintptr_t reserve_host = reserve == 0 ? 0 : mem->segment_hosts().at(0);

  struct Live {
    std::size_t size, bytes;  // block, request
    std::uint64_t tag;
    std::vector<StreamUse> uses;
  };
  std::map<std::uintptr_t, Live> live;  // by host address
  // Live addresses in an order that depends only on the operations, so that
  // a seed replays the same run whatever addresses the memory has.
  std::vector<std::uintptr_t> order;
  struct Parked {
    std::uintptr_t end;
    std::vector<std::pair<StreamUse, std::uint64_t>> waits;  // stream, work queued when freed
  };
  std::map<std::uintptr_t, Parked> parked;  // freed with uses, not yet reused or met; disjoint
  std::size_t requested = 0;
  std::uint64_t tag = 0, allocations = 0, capacity_errors = 0;
  int op = 0;
  const char* what = "";
  const auto at = [&] { return "op " + std::to_string(op) + " (" + what + ")"; };

  const auto met = [&](const Parked& p) {
    for (const auto& [s, target] : p.waits)
      if (streams->completed(s) < target) return false;
    return true;
  };
  // Streams only move forward, so a met entry stays met: drop it.
  const auto unmet_parked = [&] {
    for (auto it = parked.begin(); it != parked.end();) it = met(it->second) ? parked.erase(it) : std::next(it);
    return parked.size();
  };
  const auto free_block = [&](std::map<std::uintptr_t, Live>::iterator it) {
    void* host = reinterpret_cast<void*>(it->first);
    const Live& l = it->second;
    ASSERT_EQ(find_pattern_damage(host, l.bytes, l.tag, stride_for(l.bytes)), -1) << at() << ": block overwritten";
    if (!l.uses.empty()) {
      Parked p{it->first + l.size, {}};
      for (const StreamUse& s : l.uses) p.waits.emplace_back(s, streams->queued(s));
      parked[it->first] = std::move(p);
    }
    requested -= l.bytes;
    *std::find(order.begin(), order.end(), it->first) = order.back();
    order.pop_back();
    live.erase(it);
    pool->deallocate(host);
  };
  const auto random_live = [&] { return live.find(order[rng() % order.size()]); };

  for (op = 0; op < ops; ++op) {
    const unsigned r = rng() % 100;
    if (r < 40 && live.size() < 64) {
      what = "allocate";
      const std::size_t bytes = draw_size(rng, o);
      const int device = variant.numa ? static_cast<int>(rng() % 4) - 1 : -1;  // 2: beyond device_nodes
      const std::size_t alignment = variant.page_aligned && rng() % 3 == 0 ? kPageAlignment : kAlignment;
      // A page-aligned block is whole pages (Note [hipferry pinned pool]).
      const std::size_t cls = size_class(round_up(bytes, alignment), o.own_segment_threshold);
      HostPool::Allocation a;
      // A pool that polls parked blocks in a loop instead of waiting for them
      // would hang here; the fake streams then finish all work and the
      // assertion below reports it.
      const std::uint64_t queries_before = streams->queries();
      streams->complete_all_after_queries(100000);
      try {
        a = pool->allocate(bytes, device, alignment);
      } catch (const PoolCapacityError&) {
        ++capacity_errors;
        // Only after everything was tried: parked blocks waited for, cached
        // segments given back, and no segment of the block's own size fits.
        const PoolStats s = pool->stats();
        ASSERT_EQ(s.waiting_blocks, 0u) << at() << ": gave up with blocks still parked";
        ASSERT_GT(cls, o.capacity - s.reserved_bytes)
            << at() << ": " << bytes << " bytes would have fit in a new segment";
        ASSERT_EQ(pool->trim(), 0u) << at() << ": gave up with cached segments left";
        a.host = nullptr;
      }
      ASSERT_LT(streams->queries() - queries_before, 100000u) << at() << ": allocate spun on stream events";
      if (a.host != nullptr) {
        ++allocations;
        const auto b = reinterpret_cast<std::uintptr_t>(a.host), e = b + a.size;
        ASSERT_EQ(b % alignment, 0u) << at() << ": " << bytes << " bytes asked with alignment " << alignment;
        ASSERT_EQ(a.size % alignment, 0u) << at();
        ASSERT_TRUE(a.size >= cls && a.size - cls <= a.size / 8) << at() << ": " << a.size << " for " << bytes;
        const auto seg = mem->segment_of(a.host);
        ASSERT_TRUE(seg && e <= seg->host + seg->bytes) << at() << ": block outside its segment";
        ASSERT_EQ(reinterpret_cast<std::uintptr_t>(a.device), seg->device + (b - seg->host)) << at();
        const int want_node = device == 0 || device == 1 ? device : o.numa_node;
        ASSERT_TRUE(seg->numa_node == want_node || seg->host == reserve_host)
            << at() << ": a block for device " << device << " from node " << seg->numa_node << ", expected "
            << want_node;
        ASSERT_EQ(pool->node_of_block(a.host), seg->numa_node) << at();
        auto next = live.lower_bound(b);
        ASSERT_TRUE(next == live.end() || next->first >= e) << at() << ": overlaps a live block";
        ASSERT_TRUE(next == live.begin() || std::prev(next)->first + std::prev(next)->second.size <= b)
            << at() << ": overlaps a live block";
        auto p = parked.lower_bound(b);
        if (p != parked.begin() && std::prev(p)->second.end > b) --p;
        while (p != parked.end() && p->first < e) {
          ASSERT_TRUE(met(p->second)) << at() << ": memory came back before its stream finished with it";
          p = parked.erase(p);
        }
        write_pattern(a.host, bytes, ++tag, stride_for(bytes));
        live.emplace(b, Live{a.size, bytes, tag, {}});
        order.push_back(b);
        requested += bytes;
      }
    } else if (r < 65 && !live.empty()) {
      what = "deallocate";
      ASSERT_NO_FATAL_FAILURE(free_block(random_live()));
    } else if (r < 80 && !live.empty()) {
      what = "record_use";
      const auto it = random_live();
      const StreamUse s = FakeStreams::stream(static_cast<int>(rng() % kStreams));
      pool->record_use(reinterpret_cast<void*>(it->first), s);
      auto& uses = it->second.uses;
      if (std::find(uses.begin(), uses.end(), s) == uses.end()) uses.push_back(s);
      if (rng() % 10 < 7) streams->enqueue(s, 1 + rng() % 3);  // work on the block, not done yet
    } else if (r < 90) {
      what = "advance";
      const StreamUse s = FakeStreams::stream(static_cast<int>(rng() % kStreams));
      if (rng() % 3 == 0) {
        streams->complete(s);
      } else {
        streams->advance(s, 1 + rng() % 3);
      }
    } else if (r < 95) {
      what = "process_events";
      pool->process_events();
      ASSERT_EQ(pool->stats().waiting_blocks, unmet_parked()) << at() << ": a completed block is still parked";
    } else if (r < 98) {
      what = "trim";
      const PoolStats before = pool->stats();
      const std::size_t released = pool->trim();
      const PoolStats after = pool->stats();
      // With parked blocks, trim's own poll may free segments past
      // max_cached_bytes too (see HostPool.TrimCountsSegmentsReleasedByItsOwnEventPoll).
      if (before.waiting_blocks == 0) {
        ASSERT_EQ(released, before.reserved_bytes - after.reserved_bytes) << at();
      } else {
        ASSERT_LE(released, before.reserved_bytes - after.reserved_bytes) << at();
      }
      ASSERT_EQ(pool->trim(), 0u) << at();
    } else {
      what = "verify";
      for (const auto& [b, l] : live)
        ASSERT_EQ(find_pattern_damage(reinterpret_cast<void*>(b), l.bytes, l.tag, stride_for(l.bytes)), -1)
            << at() << ": block overwritten";
    }

    try {
      pool->check_invariants();
    } catch (const std::logic_error& e) {
      FAIL() << at() << ": " << e.what();
    }
    const PoolStats s = pool->stats();
    ASSERT_EQ(s.requested_bytes, requested) << at();
    ASSERT_EQ(s.live_blocks, live.size()) << at();
    ASSERT_LE(s.reserved_bytes, o.capacity) << at();
    ASSERT_EQ(s.reserved_bytes, mem->live_bytes()) << at() << ": the pool and the provider disagree";
    ASSERT_EQ(s.segments, mem->live_segments()) << at();
    ASSERT_GE(s.reserved_bytes, reserve) << at();
    ASSERT_GE(s.waiting_blocks, unmet_parked()) << at() << ": a block left before its stream finished";
  }
  what = "teardown";
  std::printf("[          ] %s: %llu allocations, %llu capacity errors, %llu event syncs, %llu system allocs\n",
              variant.name, static_cast<unsigned long long>(allocations),
              static_cast<unsigned long long>(capacity_errors),
              static_cast<unsigned long long>(streams->synchronizes()), static_cast<unsigned long long>(mem->allocs()));

  while (!live.empty()) ASSERT_NO_FATAL_FAILURE(free_block(live.find(order.back())));
  streams->complete_all();
  pool->process_events();
  EXPECT_EQ(pool->stats().waiting_blocks, 0u);
  pool->trim();
  PoolStats s = pool->stats();
  EXPECT_EQ(s.reserved_bytes, reserve);
  EXPECT_EQ(s.allocated_bytes, 0u);
  EXPECT_EQ(mem->live_bytes(), reserve);
  EXPECT_EQ(mem->live_segments(), reserve == 0 ? 0u : 1u);
  // Nothing is lost to fragmentation or leaked capacity: half the cap fits.
  const auto half = pool->allocate(o.capacity / 2);
  pool->deallocate(half.host);
  pool->close();
  EXPECT_EQ(pool->stats().reserved_bytes, 0u);
  EXPECT_EQ(mem->live_segments(), 0u);
  pool->check_invariants();
  pool.reset();
  EXPECT_TRUE(mem->all_released());
  EXPECT_EQ(streams->live_events(), 0u);
}

TEST(HostPoolProperty, RandomOperationsKeepInvariantsAndTheShadowModel) {
  const Variant variants[] = {
      {"plain", SIZE_MAX, 0},
      {"max_cached 2 MiB", 2 * MiB, 0},
      {"reserve 4 MiB + 100 B, max_cached 8 MiB", 8 * MiB, 4 * MiB + 100},
      {"max_cached 0", 0, 0},
      {"three NUMA nodes", SIZE_MAX, 0, true},
      {"three NUMA nodes, reserve 4 MiB, max_cached 2 MiB", 2 * MiB, 4 * MiB, true},
  };
  for (std::uint64_t seed : {11u, 12u, 13u, 14u, 15u, 16u, 17u, 18u, 19u, 20u}) {
    const Variant& v = variants[seed % 6];
    SCOPED_TRACE("seed " + std::to_string(seed) + ", " + v.name);
    run_sequence(seed, v, 20000);
    if (HasFatalFailure()) return;
  }
}

// The same with a third of the requests page aligned: their heads split off,
// merge back, and serve small requests among everything else.
TEST(HostPoolProperty, RandomOperationsWithPageAlignedRequests) {
  const Variant variants[] = {
      {"plain, page aligned", SIZE_MAX, 0, false, true},
      {"max_cached 2 MiB, page aligned", 2 * MiB, 0, false, true},
      {"reserve 4 MiB + 100 B, max_cached 8 MiB, page aligned", 8 * MiB, 4 * MiB + 100, false, true},
      {"max_cached 0, page aligned", 0, 0, false, true},
      {"three NUMA nodes, page aligned", SIZE_MAX, 0, true, true},
      {"three NUMA nodes, reserve 4 MiB, max_cached 2 MiB, page aligned", 2 * MiB, 4 * MiB, true, true},
  };
  for (std::uint64_t seed : {21u, 22u, 23u, 24u, 25u, 26u, 27u, 28u, 29u, 30u}) {
    const Variant& v = variants[seed % 6];
    SCOPED_TRACE("seed " + std::to_string(seed) + ", " + v.name);
    run_sequence(seed, v, 20000);
    if (HasFatalFailure()) return;
  }
}

}  // namespace
}  // namespace hipferry::pool
