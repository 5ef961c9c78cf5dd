// The pinned pool under many threads at once, against fake memory and fake
// streams (run under TSan by `scripts/dev.sh tsan`).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "csrc/core/host_pool/host_pool.h"
#include "tests/cpp/fake_host_memory.h"
#include "tests/cpp/host_pool_fixture.h"

namespace hipferry::pool {
namespace {

using namespace testing;  // the fixtures: fake_host_memory.h, host_pool_fixture.h

// --- many threads -----------------------------------------------------------------

// Workers allocate, write patterns, record uses on shared streams and free;
// a driver completes stream work, polls, trims and checks invariants. A shared
// shadow checks, under one lock, that no two live blocks overlap and that a
// block parked on a stream comes back only after the stream passed the point
// where the block was freed.
void run_threads(PoolOptions options, int workers, int ops_per_worker, std::uint64_t seed) {
  Fixture f(options);
  // Provider calls take long in real life (page pinning); yielding inside
  // them lets other threads race with allocations in flight.
  f.mem->on_allocate([](std::size_t) { std::this_thread::yield(); });
  f.mem->on_release([](const FakeMemory::Segment&) { std::this_thread::yield(); });
  constexpr int kStreams = 4;
  std::mutex shadow_mu;
  std::map<std::uintptr_t, std::uintptr_t> live;  // begin -> end
  struct Parked {
    std::uintptr_t end;
    std::vector<std::pair<StreamUse, std::uint64_t>> waits;  // stream, queued when freed
  };
  std::map<std::uintptr_t, Parked> parked;  // begin -> ...; disjoint, like live blocks
  std::mutex error_mu;
  std::string first_error;
  std::atomic<int> errors{0};
  const auto fail = [&](const std::string& what) {
    if (errors++ == 0) {
      std::lock_guard<std::mutex> lock(error_mu);
      first_error = what;
    }
  };

  const auto on_allocated = [&](const HostPool::Allocation& a) {
    const auto b = reinterpret_cast<std::uintptr_t>(a.host), e = b + a.size;
    std::lock_guard<std::mutex> lock(shadow_mu);
    auto it = live.lower_bound(b);
    if ((it != live.end() && it->first < e) || (it != live.begin() && std::prev(it)->second > b))
      fail("two live blocks overlap");
    live.emplace(b, e);
    auto p = parked.lower_bound(b);
    if (p != parked.begin() && std::prev(p)->second.end > b) --p;
    while (p != parked.end() && p->first < e) {
      for (const auto& [s, target] : p->second.waits)
        if (f.streams->completed(s) < target) fail("a block came back before its stream finished with it");
      p = parked.erase(p);
    }
  };

  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> capacity_errors{0};
  std::thread driver([&] {
    std::mt19937_64 rng(seed);
    while (!stop.load()) {
      const StreamUse s = FakeStreams::stream(static_cast<int>(rng() % kStreams));
      f.streams->advance(s, 1 + rng() % 4);
      switch (rng() % 8) {
        case 0: f.pool->trim(); break;
        case 1: try { f.pool->check_invariants();
          } catch (const std::exception& e) {
            fail(e.what());
          }
          break;
        default: f.pool->process_events();
      }
      if (f.pool->stats().reserved_bytes > options.capacity) fail("reserved more than the capacity");
      std::this_thread::yield();
    }
  });

  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      std::mt19937_64 rng(seed * 1000 + static_cast<std::uint64_t>(w));
      struct Mine {
        HostPool::Allocation a;
        std::size_t bytes;
        std::uint64_t tag;
        std::vector<StreamUse> uses;
      };
      std::vector<Mine> mine;
      std::uint64_t tag = static_cast<std::uint64_t>(w) << 32;
      const auto free_one = [&](std::size_t i) {
        Mine m = std::move(mine[i]);
        mine[i] = std::move(mine.back());
        mine.pop_back();
        const std::size_t stride = m.bytes <= 16 * KiB ? 8 : testing::sparse_stride(m.bytes);
        if (find_pattern_damage(m.a.host, m.bytes, m.tag, stride) >= 0) fail("a live block was overwritten");
        {
          std::lock_guard<std::mutex> lock(shadow_mu);
          const auto b = reinterpret_cast<std::uintptr_t>(m.a.host);
          live.erase(b);
          if (!m.uses.empty()) {
            Parked p{b + m.a.size, {}};
            for (const StreamUse& s : m.uses) p.waits.emplace_back(s, f.streams->queued(s));
            parked[b] = std::move(p);
          }
        }
        f.pool->deallocate(m.a.host);
      };
      for (int op = 0; op < ops_per_worker && errors.load() == 0; ++op) {
        const unsigned r = rng() % 100;
        if (r < 45 && mine.size() < 12) {
          // 1 B .. 512 KiB, log-uniform: small, medium and own blocks.
          std::size_t bytes = std::size_t{1} << (rng() % 19);
          bytes += rng() % bytes;
          HostPool::Allocation a;
          try {
            a = f.pool->allocate(bytes);
          } catch (const PoolCapacityError&) {
            ++capacity_errors;
            if (!mine.empty()) free_one(rng() % mine.size());
            continue;
          }
          if (reinterpret_cast<std::uintptr_t>(a.host) % kAlignment != 0 || a.size < bytes) fail("bad block");
          on_allocated(a);
          const std::size_t stride = bytes <= 16 * KiB ? 8 : testing::sparse_stride(bytes);
          write_pattern(a.host, bytes, ++tag, stride);
          mine.push_back({a, bytes, tag, {}});
        } else if (r < 65 && !mine.empty()) {
          Mine& m = mine[rng() % mine.size()];
          const StreamUse s = FakeStreams::stream(static_cast<int>(rng() % kStreams));
          f.pool->record_use(m.a.host, s);
          if (std::find(m.uses.begin(), m.uses.end(), s) == m.uses.end()) m.uses.push_back(s);
          f.streams->enqueue(s);  // the work that uses the block
        } else if (!mine.empty()) {
          free_one(rng() % mine.size());
        }
      }
      while (!mine.empty()) free_one(mine.size() - 1);
    });
  }
  for (auto& t : threads) t.join();
  stop = true;
  driver.join();
  ASSERT_EQ(errors.load(), 0) << first_error;

  f.streams->complete_all();
  f.pool->process_events();
  f.pool->check_invariants();
  auto s = f.stats();
  EXPECT_EQ(s.live_blocks, 0u);
  EXPECT_EQ(s.waiting_blocks, 0u);
  EXPECT_EQ(s.requested_bytes, 0u);
  EXPECT_EQ(s.allocated_bytes, 0u);
  EXPECT_LE(s.peak_reserved_bytes, options.capacity);
  f.pool->trim();
  EXPECT_EQ(f.stats().reserved_bytes, 0u);
  EXPECT_EQ(f.mem->live_segments(), 0u);
  f.pool->close();
  f.pool.reset();
  EXPECT_TRUE(f.mem->all_released());
  EXPECT_EQ(f.streams->live_events(), 0u);
  std::printf("[          ] %d workers: %llu capacity errors, %llu event syncs, %llu system allocs\n", workers,
              static_cast<unsigned long long>(capacity_errors.load()),
              static_cast<unsigned long long>(f.streams->synchronizes()),
              static_cast<unsigned long long>(f.mem->allocs()));
}

TEST(HostPoolConcurrency, RandomTrafficFromManyThreads) {
  run_threads(small_options(), /*workers=*/6, /*ops_per_worker=*/3000, /*seed=*/1);
}

// 3 MiB for 4 workers with up to 12 blocks of up to 512 KiB each: threads
// reclaim cached segments, shrink segments and wait on parked blocks, all at once.
TEST(HostPoolConcurrency, RandomTrafficUnderCapacityPressure) {
  PoolOptions o = small_options();
  o.capacity = 3 * MiB;
  run_threads(o, /*workers=*/4, /*ops_per_worker=*/3000, /*seed=*/2);
}

}  // namespace
}  // namespace hipferry::pool
