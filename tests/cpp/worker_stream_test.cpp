// CPU streams of the copy scheduler (csrc/core/schedule/host_streams.h): the
// worker stream runs work in order on its thread, its events say when, and a
// failure is sticky and reaches every waiter -- also across streams, and
// against a threaded fake device (run under ThreadSanitizer in CI).
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

#include "csrc/core/schedule/host_streams.h"
#include "csrc/core/schedule/slot_ring.h"
#include "tests/cpp/fake_device.h"

namespace hipferry::schedule {
namespace {

class RecordingSink : public SpanSink {
 public:
  bool active() const override { return true; }
  std::int64_t now_ns() const override { return ++clock_; }
  void add(const Label& label, const std::string& track, std::int64_t start, std::int64_t end) override {
    std::lock_guard<std::mutex> lock(mutex_);
    names_.push_back(track + ": " + label.name);
    EXPECT_LE(start, end);
  }
  std::vector<std::string> names() {
    std::lock_guard<std::mutex> lock(mutex_);
    return names_;
  }

 private:
  mutable std::atomic<std::int64_t> clock_{0};
  std::mutex mutex_;
  std::vector<std::string> names_;
};

TEST(WorkerStream, RunsInOrderAndItsEventsSayWhen) {
  transfer::SerialWorker worker("test worker");
  RecordingSink sink;
  WorkerStream s(worker, "cpu worker", &sink);
  std::vector<int> order;
  std::atomic<bool> go{false};
  Work gate;
  gate.label = Label{"gate", "wait"};
  gate.on_host = [&] {
    while (!go.load()) std::this_thread::yield();
  };
  s.enqueue(std::move(gate));
  for (int i = 0; i < 5; ++i) {
    Work w;
    w.label = Label{"w" + std::to_string(i), "kernel"};
    w.on_host = [&order, i] { order.push_back(i); };
    s.enqueue(std::move(w));
  }
  auto e = s.record();
  EXPECT_FALSE(e->query());
  go = true;
  e->synchronize();
  EXPECT_TRUE(e->query());
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3, 4}));
  EXPECT_EQ(sink.names().size(), 6u);
  EXPECT_EQ(sink.names()[1], "cpu worker: w0");
}

TEST(WorkerStream, AFailureIsStickyAndReachesEveryWaiterAndEveryStreamThatWaited) {
  transfer::SerialWorker worker("test worker");
  WorkerStream a(worker, "a"), b(worker, "b");
  auto before = a.record();
  Work bad;
  bad.label = Label{"bad"};
  bad.on_host = [] { throw std::runtime_error("disk on fire"); };
  a.enqueue(std::move(bad));
  int ran = 0;
  Work later;
  later.label = Label{"later"};
  later.on_host = [&] { ++ran; };
  a.enqueue(std::move(later));
  auto after = a.record();
  b.wait(after);
  auto b_after = b.record();
  EXPECT_NO_THROW(before->synchronize());
  std::vector<std::thread> waiters;
  std::atomic<int> saw{0};
  for (int i = 0; i < 4; ++i) {
    waiters.emplace_back([&] {
      try {
        after->synchronize();
      } catch (const std::runtime_error& e) {
        if (std::string(e.what()) == "disk on fire") saw.fetch_add(1);
      }
    });
  }
  for (auto& t : waiters) t.join();
  EXPECT_EQ(saw.load(), 4);
  EXPECT_THROW(b_after->synchronize(), std::runtime_error);
  EXPECT_EQ(ran, 0) << "work after a failure must not run";
}

TEST(WorkerStream, WaitingForItsOwnEventQueuesNothingButAnotherStreamsStillFails) {
  transfer::SerialWorker worker("test worker");
  WorkerStream a(worker, "a"), b(worker, "b");
  auto own = a.record();
  const std::uint64_t before = worker.last_submitted();
  a.wait(own);
  EXPECT_EQ(worker.last_submitted(), before) << "a wait for the stream's own event took a worker hop";
  Work bad;
  bad.label = Label{"bad"};
  bad.on_host = [] { throw std::runtime_error("b failed"); };
  b.enqueue(std::move(bad));
  a.wait(b.record());  // same worker, other stream: its failure must still reach a
  int ran = 0;
  Work later;
  later.label = Label{"later"};
  later.on_host = [&] { ++ran; };
  a.enqueue(std::move(later));
  EXPECT_THROW(a.record()->synchronize(), std::runtime_error);
  EXPECT_EQ(ran, 0);
}

TEST(ImmediateStream, RunsAtOnceAndStaysFailed) {
  ImmediateStream s("host");
  int x = 0;
  Work w;
  w.on_host = [&] { ++x; };
  s.enqueue(w);
  EXPECT_EQ(x, 1);
  EXPECT_TRUE(s.record()->query());
  Work bad;
  bad.label = Label{"bad"};
  bad.on_host = [] { throw std::runtime_error("boom"); };
  EXPECT_THROW(s.enqueue(bad), std::runtime_error);
  s.enqueue(w);
  EXPECT_EQ(x, 1) << "nothing runs after a failure";
  EXPECT_THROW(s.record()->synchronize(), std::runtime_error);
  Work hostless;
  EXPECT_THROW(ImmediateStream("h").enqueue(hostless), std::invalid_argument);
}

// A ring whose first stage is a worker stream (the host packing staging
// blocks) and whose second is a threaded fake device stream (the copy engine).
TEST(WorkerStream, RingAcrossAWorkerAndAThreadedDevice) {
  for (std::uint64_t seed = 1; seed <= 8; ++seed) {
    fake::FakeDevice dev(fake::FakeDevice::Options{seed, 0, /*threaded=*/true, 10});
    transfer::SerialWorker worker("pack worker");
    WorkerStream pack(worker, "pack");
    auto copy = dev.stream("copy");
    SlotRing ring(2);
    constexpr std::size_t kBytes = 32;
    std::vector<std::uint8_t> slots(2 * kBytes), out(40 * kBytes);
    for (int c = 0; c < 40; ++c) {
      const std::size_t k = ring.next_slot();
      std::uint8_t* slot = slots.data() + k * kBytes;
      ring.acquire(k, pack);
      Work fill;
      fill.label = Label{"pack"};
      fill.on_host = [slot, c] { std::memset(slot, c + 1, kBytes); };
      pack.enqueue(std::move(fill));
      ring.pass(k, pack, *copy);
      copy->copy(out.data() + c * kBytes, slot, kBytes, Label{"copy"});
      ring.release(k, *copy);
    }
    ring.synchronize();
    for (int c = 0; c < 40; ++c) ASSERT_EQ(out[c * kBytes + 5], c + 1) << "seed " << seed << " chunk " << c;
  }
}

}  // namespace
}  // namespace hipferry::schedule
