// A fake device for the copy scheduler's tests (Note [copy scheduler]):
// streams whose queued work runs when the device decides, in an adversarial
// order -- any stream may run ahead of the others as far as its waits allow,
// work may be delayed arbitrarily, and work may fail.
//
// It checks ordering by memory, not by expectations: every piece of work
// declares the bytes it reads and writes, and when one runs before an
// earlier-queued piece that touches the same bytes (a read of what a queued
// copy has not written yet, a write over what a queued reader has not read
// yet), that is a hazard, recorded with both labels. The host's own accesses
// are checked the same way (host_reads / host_writes).
//
// Two modes: single-threaded (the host pumps the device whenever it waits:
// deterministic for a seed, reports deadlocks), and threaded (a device
// thread runs work with random pauses, for ThreadSanitizer).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "csrc/core/schedule/stream.h"

namespace hipferry::fake {

class FakeDevice {
 public:
  struct Options {
    std::uint64_t seed = 1;
    double fail_probability = 0;  // each piece of work fails with this probability
    bool threaded = false;
    int max_pause_us = 20;  // threaded: random pause between pieces of work
  };
  explicit FakeDevice(Options options);
  ~FakeDevice();
  FakeDevice(const FakeDevice&) = delete;
  FakeDevice& operator=(const FakeDevice&) = delete;

  std::unique_ptr<schedule::Stream> stream(const std::string& name);

  // Single-threaded mode: runs queued work (random order, within the rules)
  // until nothing is left. Throws std::logic_error on a deadlock.
  void run_all();
  // The piece of work queued as number `n` (1, 2, ... over all streams) fails.
  void fail_work(std::uint64_t n);

  void host_reads(const void* p, std::size_t bytes);
  void host_writes(void* p, std::size_t bytes);

  std::vector<std::string> hazards() const;
  std::size_t pending() const;           // queued operations not yet run
  std::size_t unrun_copy_bytes() const;  // bytes of queued copies not yet run
  std::uint64_t work_queued() const;
  std::uint64_t failures() const;  // pieces of work that failed
  static long live_events();       // event states alive in this process

  // --- used by FakeStream / FakeEvent ---
  struct EventState;
  struct Op;
  struct StreamState;
  void queue(StreamState* s, Op op);
  void wait_for(const std::shared_ptr<EventState>& e);  // pumps (single-threaded) or blocks (threaded)
  bool done(const std::shared_ptr<EventState>& e) const;
  std::string error_of(const std::shared_ptr<EventState>& e) const;
  StreamState* add_stream(const std::string& name);

 private:
  bool run_one_locked();  // false: nothing runnable
  void check_locked(const Op& op, const StreamState* at);
  void device_loop();

  Options options_;
  mutable std::mutex mutex_;         // guards everything below
  std::condition_variable changed_;  // an operation ran, or was queued
  std::mt19937_64 rng_;
  std::vector<std::unique_ptr<StreamState>> streams_;
  std::vector<std::string> hazards_;
  std::set<std::uint64_t> fail_;  // work numbers that fail
  std::uint64_t ops_ = 0;         // operations queued (their order number)
  std::uint64_t work_ = 0;        // work queued
  std::uint64_t failures_ = 0;
  bool stopping_ = false;
  std::thread thread_;  // threaded mode only; last
};

}  // namespace hipferry::fake
