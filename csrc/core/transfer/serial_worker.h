// A "CPU stream": one thread that runs submitted tasks in order. On a
// CPU-only build (or for staging pageable memory) the transfer engine runs
// its copies here, so a copy still overlaps with the caller's work, and the
// same stream-ordered rules apply: an event recorded on the worker completes
// when every task submitted before it has run.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "csrc/core/host_pool/host_memory_provider.h"

namespace hipferry::transfer {

class SerialWorker {
 public:
  explicit SerialWorker(std::string name);
  // Runs what was submitted, then joins.
  ~SerialWorker();
  SerialWorker(const SerialWorker&) = delete;
  SerialWorker& operator=(const SerialWorker&) = delete;

  // Queues `task`; returns its ticket (1, 2, ...). A task that throws is
  // recorded against its ticket; later tasks still run.
  std::uint64_t submit(std::function<void()> task);
  // The ticket the next event would wait for: the last one submitted.
  std::uint64_t last_submitted() const;
  // True once every task up to `ticket` has run.
  bool reached(std::uint64_t ticket) const;
  // Blocks until every task up to `ticket` has run, then rethrows the error
  // of task `ticket` itself, if it failed (once: the error is consumed).
  void wait(std::uint64_t ticket);
  const std::string& name() const { return name_; }

 private:
  void run();

  const std::string name_;
  mutable std::mutex mutex_;                    // guards every field below
  std::condition_variable work_ready_;          // tasks_ non-empty or stopping_
  mutable std::condition_variable progressed_;  // done_ advanced
  std::deque<std::pair<std::uint64_t, std::function<void()>>> tasks_;
  std::map<std::uint64_t, std::exception_ptr> errors_;  // failed tickets not yet waited
  std::uint64_t submitted_ = 0;
  std::uint64_t done_ = 0;
  bool stopping_ = false;
  std::thread thread_;  // last: starts after the fields above exist
};

// Events on serial workers, for the pinned pool: StreamUse{device = -1,
// stream = the SerialWorker*} means "used by tasks submitted so far".
class WorkerEventSource : public pool::UseEventSource {
 public:
  std::unique_ptr<pool::UseEvent> record(const pool::StreamUse& use) override;
  static pool::StreamUse use_of(SerialWorker& worker) { return {-1, &worker}; }
};

}  // namespace hipferry::transfer
