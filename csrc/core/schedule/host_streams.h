// CPU implementations of the scheduler's streams (Note [copy scheduler]).
//   ImmediateStream  runs work on the calling thread as it is queued: the
//                    host mode of the streamed AdamW step, and the host side
//                    of a ring (packing a staging block on the worker);
//   WorkerStream     runs work on a SerialWorker thread in queue order: the
//                    transfer engine's CPU copies, so they overlap the caller.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "csrc/core/schedule/stream.h"
#include "csrc/core/transfer/serial_worker.h"

namespace hipferry::schedule {

// An event that has passed: nothing was pending, or the work ran at once.
// With an error, synchronize() throws it (the work before it failed).
class CompletedEvent : public Event {
 public:
  explicit CompletedEvent(std::string error = "") : error_(std::move(error)) {}
  bool query() override { return true; }
  void synchronize() override;

 private:
  std::string error_;
};

// Runs everything at once on the calling thread. A piece of work that throws
// throws to the caller, and the stream stays failed: later work does not
// run, later events report the error.
class ImmediateStream : public Stream {
 public:
  explicit ImmediateStream(std::string track, SpanSink* spans = nullptr) : track_(std::move(track)), spans_(spans) {}
  void copy(void* dst, const void* src, std::size_t bytes, const Label& label) override;
  void enqueue(Work work) override;
  std::shared_ptr<Event> record() override;
  void wait(const std::shared_ptr<Event>& event) override;  // the host waits (nothing else can)
  std::string track() const override { return track_; }
  bool failed() const { return !error_.empty(); }

 private:
  void run(const Label& label, const std::function<void()>& f);
  std::string track_;
  SpanSink* spans_;
  std::string error_;  // the first failure; not thread-safe, one caller at a time
};

// Runs work on `worker` in queue order (several WorkerStreams may share one
// worker: they are then ordered with each other too). Thread-safe.
class WorkerStream : public Stream {
 public:
  WorkerStream(transfer::SerialWorker& worker, std::string track, SpanSink* spans = nullptr);
  void copy(void* dst, const void* src, std::size_t bytes, const Label& label) override;
  void enqueue(Work work) override;
  std::shared_ptr<Event> record() override;
  // This stream's own events need nothing (queue order has them); others
  // are waited for by the worker thread when it gets there (at once when
  // they are of the same worker), and their failure fails this stream.
  void wait(const std::shared_ptr<Event>& event) override;
  std::string track() const override { return track_; }
  transfer::SerialWorker& worker() const { return worker_; }

  // The first failure of this stream, shared with its events.
  struct Failure {
    std::mutex mutex;       // guards the two below
    std::uint64_t seq = 0;  // the failed work's place in this stream's queue (1, 2, ...; 0: none)
    std::string error;
  };

 private:
  void submit(Label label, std::function<void()> f, bool traced);
  transfer::SerialWorker& worker_;
  std::string track_;
  SpanSink* spans_;
  std::shared_ptr<Failure> failure_ = std::make_shared<Failure>();
  std::mutex mutex_;          // guards queued_, and makes (number, submit) one step
  std::uint64_t queued_ = 0;  // work queued on this stream so far
};

}  // namespace hipferry::schedule
