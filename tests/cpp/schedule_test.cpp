// The copy scheduler's slot ring, in-flight window and error delivery,
// against fake streams whose completion is adversarial (fake_device.h):
// random schedules must keep every ordering rule, and deliberately broken
// schedulers must be caught.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "csrc/core/schedule/in_flight_window.h"
#include "csrc/core/schedule/outcome.h"
#include "csrc/core/schedule/slot_ring.h"
#include "tests/cpp/fake_device.h"

namespace hipferry::schedule {
namespace {

using fake::FakeDevice;

// --- broken schedulers: each drops one rule --------------------------------
class RingWithoutAcquireWait : public SlotRing {  // refills a slot without waiting for its release
 public:
  using SlotRing::SlotRing;
  void acquire(std::size_t, Stream&) override {}
};
class RingWithoutPassWait : public SlotRing {  // the next stage does not wait for the one before
 public:
  using SlotRing::SlotRing;
  void pass(std::size_t, Stream&, Stream&) override {}
};
class RingReleasedAtFill : public SlotRing {  // the slot counts as free once filled, not once consumed
 public:
  using SlotRing::SlotRing;
  void acquire(std::size_t k, Stream& first) override {
    SlotRing::acquire(k, first);
    pending_fill_ = k;
    first_ = &first;
  }
  void pass(std::size_t k, Stream& from, Stream& to) override {
    if (first_ == &from && pending_fill_ == k) {
      released_[k] = from.record();
      first_ = nullptr;
    }
    SlotRing::pass(k, from, to);
  }
  void release(std::size_t, Stream&) override {}

 private:
  std::size_t pending_fill_ = 0;
  Stream* first_ = nullptr;
};
class WindowThatNeverWaits : public InFlightWindow {  // settles what completed, never blocks
 public:
  using InFlightWindow::InFlightWindow;
  void admit(std::size_t) override { settle(); }
};

enum class RingKind { kCorrect, kNoAcquireWait, kNoPassWait, kReleasedAtFill };

std::unique_ptr<SlotRing> make_ring(RingKind kind, std::size_t slots) {
  switch (kind) {
    case RingKind::kNoAcquireWait: return std::make_unique<RingWithoutAcquireWait>(slots);
    case RingKind::kNoPassWait: return std::make_unique<RingWithoutPassWait>(slots);
    case RingKind::kReleasedAtFill: return std::make_unique<RingReleasedAtFill>(slots);
    default: return std::make_unique<SlotRing>(slots);
  }
}

std::uint8_t pattern(int chunk, std::size_t i) { return static_cast<std::uint8_t>(chunk * 31 + i * 7 + 1); }

struct PipelineResult {
  std::vector<std::string> hazards;
  int wrong_chunks = 0;  // outputs that differ from what the chunk's input implies
  std::size_t pending = 0;
  bool threw = false;
};

// One random ring pipeline: each chunk is copied into a slot (fill), read and
// transformed in place by a consumer, then copied out (drain) -- or, with two
// stages, read by the consumer straight into the output. Streams are shared
// between stages at random. The host waits on random events as it goes.
PipelineResult run_pipeline(std::uint64_t seed, RingKind kind, bool threaded = false) {
  std::mt19937_64 rng(seed);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  FakeDevice dev(FakeDevice::Options{seed, 0, threaded, 5});
  const int slots = pick(1, 4), chunks = pick(1, 40), stages = pick(2, 3);
  const std::size_t bytes = static_cast<std::size_t>(pick(1, 64));
  std::vector<std::unique_ptr<Stream>> streams;
  for (int i = 0; i < 3; ++i) streams.push_back(dev.stream("stream " + std::to_string(i)));
  Stream& fill = *streams[0];
  Stream& use = *streams[pick(0, 2) == 0 ? 0 : 1];  // sometimes the same stream as fill
  Stream& drain = *streams[pick(0, 1) == 0 ? 2 : 0];
  std::vector<std::uint8_t> ring_memory(static_cast<std::size_t>(slots) * bytes), in(chunks * bytes),
      out(chunks * bytes, 0);
  for (int c = 0; c < chunks; ++c) {
    for (std::size_t i = 0; i < bytes; ++i) in[c * bytes + i] = pattern(c, i);
  }
  auto ring = make_ring(kind, static_cast<std::size_t>(slots));
  std::vector<std::shared_ptr<Event>> marks;
  for (int c = 0; c < chunks; ++c) {
    const std::size_t k = ring->next_slot();
    std::uint8_t* slot = ring_memory.data() + k * bytes;
    std::uint8_t* dst = out.data() + c * bytes;
    ring->acquire(k, fill);
    fill.copy(slot, in.data() + c * bytes, bytes, Label{"fill " + std::to_string(c)});
    ring->pass(k, fill, use);
    Work consume;
    consume.label = Label{"consume " + std::to_string(c), "kernel"};
    if (stages == 3) {
      consume.on_host = [slot, bytes] {
        for (std::size_t i = 0; i < bytes; ++i) slot[i] = static_cast<std::uint8_t>(slot[i] + 1);
      };
      consume.reads = {{slot, bytes}};
      consume.writes = {{slot, bytes}};
      use.enqueue(std::move(consume));
      ring->pass(k, use, drain);
      drain.copy(dst, slot, bytes, Label{"drain " + std::to_string(c)});
      ring->release(k, drain);
    } else {
      consume.on_host = [slot, dst, bytes] {
        for (std::size_t i = 0; i < bytes; ++i) dst[i] = static_cast<std::uint8_t>(slot[i] + 1);
      };
      consume.reads = {{slot, bytes}};
      consume.writes = {{dst, bytes}};
      use.enqueue(std::move(consume));
      ring->release(k, use);
    }
    if (pick(0, 3) == 0) marks.push_back(streams[pick(0, 2)]->record());
    if (!marks.empty() && pick(0, 4) == 0) marks[pick(0, static_cast<int>(marks.size()) - 1)]->synchronize();
  }
  PipelineResult r;
  try {
    ring->synchronize();
  } catch (...) {
    r.threw = true;
  }
  for (auto& m : marks) m->synchronize();
  dev.run_all();
  dev.host_reads(out.data(), out.size());
  for (int c = 0; c < chunks; ++c) {
    for (std::size_t i = 0; i < bytes; ++i) {
      if (out[c * bytes + i] != static_cast<std::uint8_t>(pattern(c, i) + 1)) {
        ++r.wrong_chunks;
        break;
      }
    }
  }
  r.hazards = dev.hazards();
  r.pending = dev.pending();
  return r;
}

TEST(SlotRing, RejectsZeroSlotsAndForeignSlots) {
  EXPECT_THROW(SlotRing(0), std::invalid_argument);
  FakeDevice dev(FakeDevice::Options{});
  auto s = dev.stream("s");
  SlotRing ring(2);
  EXPECT_THROW(ring.acquire(2, *s), std::out_of_range);
  EXPECT_THROW(ring.release(5, *s), std::out_of_range);
  EXPECT_TRUE(ring.idle());
  ring.synchronize();  // nothing used: nothing to wait for
}

TEST(SlotRing, RoundRobinSlots) {
  SlotRing ring(3);
  std::vector<std::size_t> seen;
  for (int i = 0; i < 7; ++i) seen.push_back(ring.next_slot());
  EXPECT_EQ(seen, (std::vector<std::size_t>{0, 1, 2, 0, 1, 2, 0}));
}

TEST(SlotRing, IdleOnlyOnceTheLastStagePassed) {
  FakeDevice dev(FakeDevice::Options{});
  auto a = dev.stream("a"), b = dev.stream("b");
  SlotRing ring(1);
  std::uint8_t src = 5, slot = 0, dst = 0;
  ring.acquire(0, *a);
  a->copy(&slot, &src, 1, Label{"fill"});
  ring.pass(0, *a, *b);
  b->copy(&dst, &slot, 1, Label{"drain"});
  ring.release(0, *b);
  EXPECT_FALSE(ring.idle());  // nothing has run: the device runs work only when the host waits
  ring.synchronize();
  EXPECT_TRUE(ring.idle());
  EXPECT_EQ(dst, 5);
}

TEST(SlotRingProperty, RandomSchedulesKeepEveryOrderingRule) {
  for (std::uint64_t seed = 1; seed <= 400; ++seed) {
    const PipelineResult r = run_pipeline(seed, RingKind::kCorrect);
    ASSERT_TRUE(r.hazards.empty()) << "seed " << seed << ": " << r.hazards.front();
    ASSERT_EQ(r.wrong_chunks, 0) << "seed " << seed;
    ASSERT_EQ(r.pending, 0u) << "seed " << seed;
    ASSERT_FALSE(r.threw) << "seed " << seed;
  }
  EXPECT_EQ(FakeDevice::live_events(), 0) << "events outlived their ring and device";
}

TEST(SlotRingProperty, ThreadedDeviceKeepsEveryOrderingRule) {
  for (std::uint64_t seed = 1; seed <= 30; ++seed) {
    const PipelineResult r = run_pipeline(seed, RingKind::kCorrect, /*threaded=*/true);
    ASSERT_TRUE(r.hazards.empty()) << "seed " << seed << ": " << r.hazards.front();
    ASSERT_EQ(r.wrong_chunks, 0) << "seed " << seed;
  }
}

// The suite can fail: each broken ring is caught by the same property test.
void expect_caught(RingKind kind, const char* what) {
  int caught = 0, wrong = 0;
  for (std::uint64_t seed = 1; seed <= 200; ++seed) {
    const PipelineResult r = run_pipeline(seed, kind);
    caught += !r.hazards.empty();
    wrong += r.wrong_chunks > 0;
  }
  EXPECT_GT(caught, 20) << what << ": the hazard check missed it";
  EXPECT_GT(wrong, 0) << what << ": never produced a wrong result (the data check is blind)";
}

TEST(SlotRingBroken, RefillWithoutWaitingForTheReleaseIsCaught) {
  expect_caught(RingKind::kNoAcquireWait, "no wait in acquire");
}
TEST(SlotRingBroken, ConsumerNotWaitingForTheCopyIsCaught) { expect_caught(RingKind::kNoPassWait, "no wait in pass"); }
TEST(SlotRingBroken, SlotReleasedWhenFilledIsCaught) { expect_caught(RingKind::kReleasedAtFill, "released at fill"); }

// --- in-flight window --------------------------------------------------------
struct WindowResult {
  bool over_bound = false;
  std::size_t settled = 0, added = 0, peak = 0;
  std::vector<std::string> hazards;
};

WindowResult run_window(std::uint64_t seed, InFlightWindow& window) {
  std::mt19937_64 rng(seed);
  FakeDevice dev(FakeDevice::Options{seed});
  auto a = dev.stream("a"), b = dev.stream("b");
  std::vector<std::vector<std::uint8_t>> src, dst;
  const int n = std::uniform_int_distribution<int>(1, 60)(rng);
  WindowResult r;
  src.reserve(n);
  dst.reserve(n);
  for (int i = 0; i < n; ++i) {
    const std::size_t bytes = std::uniform_int_distribution<std::size_t>(1, 3 * window.max_bytes() / 2)(rng);
    src.emplace_back(bytes, static_cast<std::uint8_t>(i));
    dst.emplace_back(bytes, 0);
    window.admit(bytes);
    // Bytes in flight once this copy is queued: within the bound (or it runs alone).
    if (dev.unrun_copy_bytes() + bytes > std::max(window.max_bytes(), bytes)) r.over_bound = true;
    Stream& s = (rng() & 1) ? *a : *b;
    s.copy(dst.back().data(), src.back().data(), bytes, Label{"copy " + std::to_string(i)});
    window.add(s.record(), bytes, [&r] { ++r.settled; });
    ++r.added;
  }
  window.drain();
  r.peak = window.peak_bytes();
  r.hazards = dev.hazards();
  return r;
}

TEST(InFlightWindowProperty, BytesInFlightStayWithinTheBound) {
  for (std::uint64_t seed = 1; seed <= 300; ++seed) {
    std::mt19937_64 size_rng(seed * 977);
    InFlightWindow window(std::uniform_int_distribution<std::size_t>(1, 256)(size_rng));
    const WindowResult r = run_window(seed, window);
    ASSERT_FALSE(r.over_bound) << "seed " << seed;
    ASSERT_EQ(r.settled, r.added) << "seed " << seed << ": every entry is settled once";
    ASSERT_EQ(window.bytes(), 0u);
    ASSERT_EQ(window.entries(), 0u);
    ASSERT_TRUE(r.hazards.empty());
  }
}

TEST(InFlightWindowBroken, AWindowThatNeverWaitsIsCaught) {
  int caught = 0;
  for (std::uint64_t seed = 1; seed <= 100; ++seed) {
    WindowThatNeverWaits window(64);
    caught += run_window(seed, window).over_bound;
  }
  EXPECT_GT(caught, 50);
}

// Withdrawals out of order, against a model: a withdrawn entry no longer
// counts and its callback never runs; every other entry settles exactly once,
// oldest first; the bound holds for what is still counted.
TEST(InFlightWindowProperty, WithdrawnEntriesLeaveAndTheRestSettleInOrder) {
  for (std::uint64_t seed = 1; seed <= 200; ++seed) {
    std::mt19937_64 rng(seed);
    FakeDevice dev(FakeDevice::Options{seed});
    auto a = dev.stream("a"), b = dev.stream("b");
    InFlightWindow window(std::uniform_int_distribution<std::size_t>(8, 128)(rng));
    const int n = std::uniform_int_distribution<int>(1, 50)(rng);
    std::vector<std::vector<std::uint8_t>> src(n), dst(n);
    std::vector<std::uint64_t> ids;
    std::vector<int> settled_order, runs(n, 0);
    std::vector<bool> withdrawn(n, false);
    std::vector<std::size_t> sizes(n);
    for (int i = 0; i < n; ++i) {
      sizes[i] = std::uniform_int_distribution<std::size_t>(1, window.max_bytes())(rng);
      src[i].assign(sizes[i], 1);
      dst[i].assign(sizes[i], 0);
      window.admit(sizes[i]);
      ASSERT_LE(window.bytes() + sizes[i], std::max(window.max_bytes(), sizes[i])) << "seed " << seed;
      Stream& s = (rng() & 1) ? *a : *b;
      s.copy(dst[i].data(), src[i].data(), sizes[i], Label{"copy " + std::to_string(i)});
      ids.push_back(window.add(s.record(), sizes[i], [&, i] {
        ++runs[i];
        settled_order.push_back(i);
      }));
      if (rng() % 3 == 0) {  // take back a random earlier entry
        const int k = std::uniform_int_distribution<int>(0, i)(rng);
        const bool was_counted = !withdrawn[k] && runs[k] == 0;
        ASSERT_EQ(window.withdraw(ids[k]), was_counted) << "seed " << seed << " entry " << k;
        withdrawn[k] = withdrawn[k] || was_counted;
      }
      std::size_t counted = 0;
      for (int k = 0; k <= i; ++k) counted += (!withdrawn[k] && runs[k] == 0) ? sizes[k] : 0;
      ASSERT_EQ(window.bytes(), counted) << "seed " << seed;
    }
    window.drain();
    for (int i = 0; i < n; ++i) ASSERT_EQ(runs[i], withdrawn[i] ? 0 : 1) << "seed " << seed << " entry " << i;
    ASSERT_TRUE(std::is_sorted(settled_order.begin(), settled_order.end())) << "seed " << seed;
    ASSERT_EQ(window.bytes(), 0u);
    ASSERT_FALSE(window.withdraw(ids.back()));
  }
}

TEST(InFlightWindow, ACallbackMayWithdrawAnotherEntry) {
  FakeDevice dev(FakeDevice::Options{});
  auto s = dev.stream("s");
  std::vector<std::uint8_t> a(8, 1), b(8, 0), c(8, 0);
  InFlightWindow window(16);
  int second_runs = 0;
  std::uint64_t second = 0;
  s->copy(b.data(), a.data(), 8, Label{"copy 1"});
  window.add(s->record(), 8, [&] { EXPECT_TRUE(window.withdraw(second)); });
  s->copy(c.data(), a.data(), 8, Label{"copy 2"});
  second = window.add(s->record(), 8, [&] { ++second_runs; });
  window.drain();
  EXPECT_EQ(second_runs, 0);
  EXPECT_EQ(window.bytes(), 0u);
  EXPECT_EQ(window.entries(), 0u);
}

TEST(InFlightWindow, AnErrorSettlesTheEntryAndReachesTheCaller) {
  FakeDevice dev(FakeDevice::Options{});
  auto s = dev.stream("s");
  std::vector<std::uint8_t> a(8, 1), b(8, 0);
  InFlightWindow window(8);
  int settled = 0;
  dev.fail_work(1);
  s->copy(b.data(), a.data(), 8, Label{"copy"});
  window.add(s->record(), 8, [&] { ++settled; });
  EXPECT_THROW(window.admit(8), std::runtime_error);  // had to wait for the failed copy
  EXPECT_EQ(settled, 1);
  EXPECT_EQ(window.bytes(), 0u);
  window.admit(8);  // still usable
  EXPECT_EQ(window.waits(), 1u);
}

// --- errors reach every waiter ----------------------------------------------
TEST(ScheduleErrors, AFailureReachesEveryLaterEventOnEveryStreamThatWaited) {
  FakeDevice dev(FakeDevice::Options{});
  auto a = dev.stream("a"), b = dev.stream("b"), c = dev.stream("c");
  std::uint8_t x = 1, y = 0, z = 0;
  auto before = a->record();
  a->copy(&y, &x, 1, Label{"first"});  // work 1: fails
  dev.fail_work(1);
  auto after_a = a->record();
  b->wait(after_a);
  b->copy(&z, &y, 1, Label{"second"});
  auto after_b = b->record();
  auto unrelated = c->record();
  EXPECT_NO_THROW(before->synchronize());
  EXPECT_NO_THROW(unrelated->synchronize());
  for (int waiter = 0; waiter < 3; ++waiter) {  // every waiter, not only the first
    EXPECT_THROW(after_a->synchronize(), std::runtime_error);
    EXPECT_THROW(after_b->synchronize(), std::runtime_error);
  }
  EXPECT_EQ(z, 0) << "work after a failure must not run";
  try {
    after_b->synchronize();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("first"), std::string::npos) << e.what();
  }
}

TEST(ScheduleErrors, ConcurrentWaitersAllSeeTheError) {
  FakeDevice dev(FakeDevice::Options{7, 0, /*threaded=*/true, 50});
  auto a = dev.stream("a");
  std::vector<std::uint8_t> x(64, 1), y(64, 0);
  dev.fail_work(3);
  for (int i = 0; i < 5; ++i) a->copy(y.data(), x.data(), 64, Label{"copy"});
  auto done = a->record();
  std::vector<std::thread> waiters;
  std::vector<int> saw(6, 0);
  for (int t = 0; t < 6; ++t) {
    waiters.emplace_back([&, t] {
      try {
        done->synchronize();
      } catch (const std::runtime_error&) {
        saw[t] = 1;
      }
    });
  }
  for (auto& w : waiters) w.join();
  EXPECT_EQ(std::count(saw.begin(), saw.end(), 1), 6);
}

TEST(ScheduleErrorsProperty, RandomFailuresAlwaysReachTheRingsWaiter) {
  int failed_runs = 0;
  for (std::uint64_t seed = 1; seed <= 200; ++seed) {
    std::mt19937_64 rng(seed);
    FakeDevice dev(FakeDevice::Options{seed, 0.03});
    auto fill = dev.stream("fill"), use = dev.stream("use");
    SlotRing ring(2);
    std::vector<std::uint8_t> mem(2 * 16), in(16, 3), out(16);
    const int chunks = std::uniform_int_distribution<int>(1, 30)(rng);
    for (int c = 0; c < chunks; ++c) {
      const std::size_t k = ring.next_slot();
      ring.acquire(k, *fill);
      fill->copy(mem.data() + k * 16, in.data(), 16, Label{"fill"});
      ring.pass(k, *fill, *use);
      use->copy(out.data(), mem.data() + k * 16, 16, Label{"use"});
      ring.release(k, *use);
    }
    // The host's last word: an event after everything on the consumer stream.
    auto end = use->record();
    bool threw = false;
    try {
      end->synchronize();
    } catch (const std::runtime_error&) {
      threw = true;
    }
    dev.run_all();
    const bool failed = dev.failures() > 0;
    failed_runs += failed;
    ASSERT_EQ(threw, failed) << "seed " << seed << ": a failure must reach the end, and only a failure";
    bool ring_threw = false;
    try {
      ring.synchronize();
    } catch (const std::runtime_error&) {
      ring_threw = true;
    }
    ASSERT_EQ(ring_threw, failed) << "seed " << seed;
  }
  EXPECT_GT(failed_runs, 20);
}

TEST(Outcome, KeepsTheFirstErrorForEveryReader) {
  Outcome o;
  EXPECT_FALSE(o.failed());
  o.run("staging", [] { throw std::runtime_error("no memory"); });
  o.run("copying", [] { throw std::runtime_error("later"); });
  o.run("fine", [] {});
  EXPECT_TRUE(o.failed());
  EXPECT_EQ(o.error(), "staging: no memory");
  EXPECT_EQ(o.error(), "staging: no memory");
}

}  // namespace
}  // namespace hipferry::schedule
