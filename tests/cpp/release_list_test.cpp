// The release list (csrc/core/schedule/release_list.h) against fake streams
// whose completion is adversarial: a holding is the memory a queued copy reads,
// and letting go of it is a host write (the allocator hands the memory to
// someone else). The fake device flags any such write before the copy has
// read the bytes, so a list that drops a holding early is caught.
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

#include "csrc/core/schedule/release_list.h"
#include "tests/cpp/fake_device.h"

namespace hipferry::schedule {
namespace {

using fake::FakeDevice;

// Memory a copy reads; its death is a host write over it (reuse by another
// owner). The bytes live in the test's arena, so a broken list is caught by
// the fake device, not by a real use after free.
struct Buffer {
  Buffer(FakeDevice& dev, std::atomic<int>& alive, std::vector<unsigned char>& bytes)
      : dev(dev), alive(alive), bytes(bytes) {
    ++alive;
  }
  ~Buffer() {
    dev.host_writes(bytes.data(), bytes.size());
    --alive;
  }
  FakeDevice& dev;
  std::atomic<int>& alive;
  std::vector<unsigned char>& bytes;
};

// Queues `copies` copies out of fresh buffers on random streams, hands each
// buffer to `list` with `done_of(event)`, polls at random; returns the hazards.
std::vector<std::string> run(std::uint64_t seed,
                             const std::function<ReleaseList::Done(std::shared_ptr<Event>)>& done_of, int copies,
                             bool threaded) {
  // Declared before the device: they outlive any copy it runs.
  std::vector<std::vector<unsigned char>> sinks(copies, std::vector<unsigned char>(64));  // one per copy
  std::vector<std::vector<unsigned char>> arena(copies, std::vector<unsigned char>(64, 7));
  FakeDevice dev(FakeDevice::Options{seed, 0, threaded, 30});
  std::vector<std::unique_ptr<Stream>> streams;
  for (int s = 0; s < 3; ++s) streams.push_back(dev.stream("s" + std::to_string(s)));
  std::mt19937_64 rng(seed);
  std::atomic<int> alive{0};
  {
    ReleaseList list;
    for (int i = 0; i < copies; ++i) {
      auto buffer = std::make_shared<Buffer>(dev, alive, arena[i]);
      Stream& s = *streams[rng() % streams.size()];
      s.copy(sinks[i].data(), buffer->bytes.data(), buffer->bytes.size(), Label{"copy", "copy", 64});
      list.release_after(done_of(s.record()), std::move(buffer));
      if (rng() % 3 == 0) list.poll();
      if (!threaded && rng() % 7 == 0) dev.run_all();
    }
    dev.run_all();
    for (auto& s : streams) s->record()->synchronize();
    while (list.pending() > 0) list.poll();
    EXPECT_EQ(list.poll(), 0u);
  }
  EXPECT_EQ(alive.load(), 0) << "a holding leaked";
  return dev.hazards();
}

ReleaseList::Done by_event(std::shared_ptr<Event> e) {
  return [e] { return e->query(); };
}

TEST(ReleaseListProperty, NoHoldingDiesBeforeItsCopy) {
  for (std::uint64_t seed = 1; seed <= 40; ++seed) {
    const auto hazards = run(seed, by_event, 60, /*threaded=*/false);
    ASSERT_TRUE(hazards.empty()) << "seed " << seed << ": " << hazards.front();
  }
}

TEST(ReleaseListProperty, ThreadedDeviceNoHoldingDiesBeforeItsCopy) {
  for (std::uint64_t seed = 1; seed <= 6; ++seed) {
    const auto hazards = run(seed, by_event, 80, /*threaded=*/true);
    ASSERT_TRUE(hazards.empty()) << "seed " << seed << ": " << hazards.front();
  }
}

TEST(ReleaseListBroken, ReleasingOnAGuessIsCaught) {
  // "Queued, so it will have run by the time anyone reuses it": stream order guessed, not observed.
  const auto guess = [](std::shared_ptr<Event>) -> ReleaseList::Done { return [] { return true; }; };
  std::size_t caught = 0;
  for (std::uint64_t seed = 1; seed <= 10; ++seed) caught += run(seed, guess, 30, false).empty() ? 0 : 1;
  EXPECT_GT(caught, 0u) << "the fake device never saw a premature release";
}

TEST(ReleaseList, KeepsAHoldingWhileTheRuntimeCannotSay) {
  ReleaseList list;
  auto holding = std::make_shared<int>(1);
  std::weak_ptr<int> watch = holding;
  bool runtime_up = false;
  list.release_after(
      [&] {
        if (!runtime_up) throw std::runtime_error("device lost");
        return true;
      },
      std::move(holding));
  EXPECT_EQ(list.pending(), 1u);
  EXPECT_EQ(list.poll(), 0u);
  EXPECT_FALSE(watch.expired()) << "dropped although done() could not answer";
  runtime_up = true;
  EXPECT_EQ(list.poll(), 1u);
  EXPECT_TRUE(watch.expired());
  EXPECT_EQ(list.pending(), 0u);
}

TEST(ReleaseList, ADoneHoldingDiesAtOnceAndAnEmptyOneIsIgnored) {
  ReleaseList list;
  auto holding = std::make_shared<int>(1);
  std::weak_ptr<int> watch = holding;
  list.release_after([] { return true; }, std::move(holding));
  EXPECT_TRUE(watch.expired());
  list.release_after([] { return false; }, nullptr);
  EXPECT_EQ(list.pending(), 0u);
}

// A dying holding may call back into the list (a Transfer dying inside
// another's holdings): no deadlock, and the new holding is kept in order.
TEST(ReleaseList, AHoldingThatReleasesAnotherAsItDies) {
  ReleaseList list;
  bool first_done = false, second_done = false;
  auto second = std::make_shared<int>(2);
  std::weak_ptr<int> watch_second = second;
  struct Chained {
    Chained(ReleaseList* list, bool* second_done, std::shared_ptr<int> second)
        : list(list), second_done(second_done), second(std::move(second)) {}
    ReleaseList* list;
    bool* second_done;
    std::shared_ptr<int> second;
    ~Chained() {
      list->release_after([d = second_done] { return *d; }, std::move(second));
    }
  };
  list.release_after([&] { return first_done; }, std::make_shared<Chained>(&list, &second_done, second));
  second.reset();
  first_done = true;
  EXPECT_EQ(list.poll(), 1u);
  EXPECT_EQ(list.pending(), 1u);
  EXPECT_FALSE(watch_second.expired());
  second_done = true;
  EXPECT_EQ(list.poll(), 1u);
  EXPECT_TRUE(watch_second.expired());
}

TEST(ReleaseList, ConcurrentAddersAndPollersDropEveryHoldingOnce) {
  ReleaseList list;
  std::atomic<int> alive{0}, dropped{0};
  struct Counted {
    Counted(std::atomic<int>& alive, std::atomic<int>& dropped) : alive(alive), dropped(dropped) {}
    std::atomic<int>& alive;
    std::atomic<int>& dropped;
    ~Counted() {
      --alive;
      ++dropped;
    }
  };
  std::atomic<bool> open{true};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      for (int i = 0; i < 500; ++i) {
        ++alive;
        const int ready_after = static_cast<int>(rng() % 4);
        auto polls = std::make_shared<std::atomic<int>>(0);
        list.release_after([polls, ready_after, &open] { return !open.load() || polls->fetch_add(1) >= ready_after; },
                           std::make_shared<Counted>(alive, dropped));
        if (i % 5 == 0) list.poll();
      }
    });
  }
  for (auto& th : threads) th.join();
  open = false;
  list.poll();
  EXPECT_EQ(list.pending(), 0u);
  EXPECT_EQ(alive.load(), 0);
  EXPECT_EQ(dropped.load(), 2000);
}

}  // namespace
}  // namespace hipferry::schedule
