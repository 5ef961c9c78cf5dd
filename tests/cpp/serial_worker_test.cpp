// The serial worker ("CPU stream"): order, waiting, errors, and events the
// pinned pool uses to keep a block out of reuse until the worker's tasks that
// use it have run.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <stdexcept>
#include <thread>
#include <vector>

#include "csrc/core/host_pool/host_pool.h"
#include "csrc/core/transfer/serial_worker.h"

namespace hipferry::transfer {
namespace {

TEST(SerialWorker, RunsTasksInSubmissionOrder) {
  std::vector<int> order;
  {
    SerialWorker w("test");
    for (int i = 0; i < 200; ++i) w.submit([&order, i] { order.push_back(i); });
  }  // the destructor runs what was submitted
  ASSERT_EQ(order.size(), 200u);
  for (int i = 0; i < 200; ++i) EXPECT_EQ(order[i], i);
}

TEST(SerialWorker, WaitBlocksUntilTheTicketHasRun) {
  SerialWorker w("test");
  std::promise<void> gate;
  std::shared_future<void> open = gate.get_future().share();
  std::atomic<bool> ran{false};
  const auto blocker = w.submit([open] { open.wait(); });
  const auto t = w.submit([&ran] { ran = true; });
  EXPECT_EQ(w.last_submitted(), t);
  EXPECT_FALSE(w.reached(blocker));
  EXPECT_FALSE(w.reached(t));
  gate.set_value();
  w.wait(t);
  EXPECT_TRUE(ran);
  EXPECT_TRUE(w.reached(blocker) && w.reached(t));
  EXPECT_THROW(w.wait(t + 1), std::invalid_argument);
}

TEST(SerialWorker, AFailingTaskReportsToItsWaiterOnlyAndLaterTasksRun) {
  SerialWorker w("test");
  const auto bad = w.submit([] { throw std::runtime_error("copy failed"); });
  std::atomic<bool> ran{false};
  const auto good = w.submit([&ran] { ran = true; });
  w.wait(good);  // a later ticket does not carry the earlier error
  EXPECT_TRUE(ran);
  try {
    w.wait(bad);
    FAIL() << "expected the task's error";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "copy failed");
  }
  EXPECT_NO_THROW(w.wait(bad));  // consumed
  EXPECT_THROW(w.submit(nullptr), std::invalid_argument);
}

TEST(SerialWorker, TasksMaySubmitMoreWork) {
  SerialWorker w("test");
  std::atomic<int> n{0};
  std::promise<std::uint64_t> inner;
  w.submit([&] { inner.set_value(w.submit([&n] { ++n; })); });
  const auto t = inner.get_future().get();
  w.wait(t);
  EXPECT_EQ(n.load(), 1);
}

TEST(SerialWorker, PoolBlockWaitsForTheWorkerTasksThatUseIt) {
  auto* source = new WorkerEventSource;
  pool::HostPool pool(std::make_unique<pool::AlignedHostMemoryProvider>(),
                      std::unique_ptr<pool::UseEventSource>(source));
  SerialWorker w("copy");
  std::promise<void> gate;
  std::shared_future<void> open = gate.get_future().share();
  const auto block = pool.allocate(4096);
  std::atomic<int> seen{0};
  auto* bytes = static_cast<unsigned char*>(block.host);
  bytes[0] = 42;
  const auto t = w.submit([open, bytes, &seen] {
    open.wait();
    seen = bytes[0];  // the task still reads the block after the caller freed it
  });
  pool.record_use(block.host, WorkerEventSource::use_of(w));
  pool.deallocate(block.host);
  EXPECT_EQ(pool.stats().waiting_blocks, 1u);
  const auto other = pool.allocate(4096);
  EXPECT_NE(other.host, block.host) << "reused while the worker still reads it";
  gate.set_value();
  w.wait(t);
  EXPECT_EQ(seen.load(), 42);
  EXPECT_EQ(pool.process_events(), 1u);
  const auto again = pool.allocate(4096);
  EXPECT_EQ(again.host, block.host);
  pool.deallocate(other.host);
  pool.deallocate(again.host);
  pool.check_invariants();
}

}  // namespace
}  // namespace hipferry::transfer
