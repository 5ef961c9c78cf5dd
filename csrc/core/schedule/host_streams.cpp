// CPU streams (see host_streams.h).
#include "csrc/core/schedule/host_streams.h"

#include <cstring>
#include <stdexcept>
#include <utility>

namespace hipferry::schedule {
namespace {

// An event of a WorkerStream: the worker has run every task up to `ticket`.
class WorkerEvent : public Event {
 public:
  WorkerEvent(transfer::SerialWorker& worker, std::uint64_t ticket, std::uint64_t seq,
              std::shared_ptr<WorkerStream::Failure> failure)
      : worker_(worker), ticket_(ticket), seq_(seq), failure_(std::move(failure)) {}
  bool query() override { return worker_.reached(ticket_); }
  bool of_stream(const std::shared_ptr<WorkerStream::Failure>& failure) const { return failure_ == failure; }
  void synchronize() override {
    try {
      worker_.wait(ticket_);
    } catch (...) {  // tasks never throw (submit catches); an error here is the worker's own
    }
    std::lock_guard<std::mutex> lock(failure_->mutex);
    if (failure_->seq != 0 && failure_->seq <= seq_) throw std::runtime_error(failure_->error);
  }

 private:
  transfer::SerialWorker& worker_;
  std::uint64_t ticket_;  // the worker's last task when recorded
  std::uint64_t seq_;     // the stream's last work when recorded
  std::shared_ptr<WorkerStream::Failure> failure_;
};

std::string what_of(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown error";
  }
}

void timed(SpanSink* spans, const Label& label, const std::string& track, const std::function<void()>& f) {
  if (spans == nullptr || !spans->active()) {
    f();
    return;
  }
  const std::int64_t t0 = spans->now_ns();
  f();
  spans->add(label, track, t0, spans->now_ns());
}

}  // namespace

void CompletedEvent::synchronize() {
  if (!error_.empty()) throw std::runtime_error(error_);
}

void ImmediateStream::run(const Label& label, const std::function<void()>& f) {
  if (!error_.empty()) return;  // sticky: nothing runs after a failure
  try {
    timed(spans_, label, track_, f);
  } catch (...) {
    error_ = what_of(std::current_exception());
    throw;
  }
}

void ImmediateStream::copy(void* dst, const void* src, std::size_t bytes, const Label& label) {
  run(label, [&] { std::memcpy(dst, src, bytes); });
}

void ImmediateStream::enqueue(Work work) {
  if (!work.on_host) throw std::invalid_argument("ImmediateStream: work '" + work.label.name + "' has no host form");
  run(work.label, work.on_host);
}

std::shared_ptr<Event> ImmediateStream::record() { return std::make_shared<CompletedEvent>(error_); }

void ImmediateStream::wait(const std::shared_ptr<Event>& event) {
  if (!event || !error_.empty()) return;
  try {
    event->synchronize();
  } catch (...) {
    error_ = what_of(std::current_exception());
  }
}

WorkerStream::WorkerStream(transfer::SerialWorker& worker, std::string track, SpanSink* spans)
    : worker_(worker), track_(std::move(track)), spans_(spans) {}

void WorkerStream::submit(Label label, std::function<void()> f, bool traced) {
  auto failure = failure_;
  SpanSink* spans = traced ? spans_ : nullptr;
  std::lock_guard<std::mutex> lock(mutex_);  // sequence numbers in queue order; the worker never calls back
  const std::uint64_t seq = ++queued_;
  worker_.submit([failure, spans, track = track_, label = std::move(label), f = std::move(f), seq] {
    {
      std::lock_guard<std::mutex> lock(failure->mutex);
      if (failure->seq != 0) return;  // sticky: nothing runs after a failure
    }
    try {
      timed(spans, label, track, f);
    } catch (...) {
      const std::string why = what_of(std::current_exception());
      std::lock_guard<std::mutex> lock(failure->mutex);
      if (failure->seq == 0) {
        failure->seq = seq;
        failure->error = why;
      }
    }
  });
}

void WorkerStream::copy(void* dst, const void* src, std::size_t bytes, const Label& label) {
  submit(
      label, [dst, src, bytes] { std::memcpy(dst, src, bytes); }, true);
}

void WorkerStream::enqueue(Work work) {
  if (!work.on_host) throw std::invalid_argument("WorkerStream: work '" + work.label.name + "' has no host form");
  submit(std::move(work.label), std::move(work.on_host), true);
}

std::shared_ptr<Event> WorkerStream::record() {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::make_shared<WorkerEvent>(worker_, worker_.last_submitted(), queued_, failure_);
}

void WorkerStream::wait(const std::shared_ptr<Event>& event) {
  if (!event) return;
  // This stream's own event: queue order already has it, and its failure is this stream's.
  if (auto* own = dynamic_cast<WorkerEvent*>(event.get()); own != nullptr && own->of_stream(failure_)) return;
  // The worker waits when it gets there (at once for another stream's event
  // on this worker: it runs in order), and a failed event fails this stream.
  submit(
      Label{"wait", "wait", 0}, [event] { event->synchronize(); }, /*traced=*/false);
}

}  // namespace hipferry::schedule
