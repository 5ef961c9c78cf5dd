// A serial task worker (see serial_worker.h).
#include "csrc/core/transfer/serial_worker.h"

#include <stdexcept>

namespace hipferry::transfer {
namespace {

class WorkerEvent : public pool::UseEvent {
 public:
  WorkerEvent(SerialWorker* worker, std::uint64_t ticket) : worker_(worker), ticket_(ticket) {}
  bool query() override { return worker_->reached(ticket_); }
  void synchronize() override {
    try {
      worker_->wait(ticket_);
    } catch (...) {  // the task's error belongs to whoever submitted it
    }
  }

 private:
  SerialWorker* worker_;
  std::uint64_t ticket_;
};

}  // namespace

SerialWorker::SerialWorker(std::string name) : name_(std::move(name)), thread_([this] { run(); }) {}

SerialWorker::~SerialWorker() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  work_ready_.notify_all();
  thread_.join();
}

std::uint64_t SerialWorker::submit(std::function<void()> task) {
  if (!task) throw std::invalid_argument("SerialWorker::submit: task is empty");
  std::uint64_t ticket;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) throw std::logic_error("SerialWorker::submit: worker '" + name_ + "' is stopping");
    ticket = ++submitted_;
    tasks_.emplace_back(ticket, std::move(task));
  }
  work_ready_.notify_one();
  return ticket;
}

std::uint64_t SerialWorker::last_submitted() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return submitted_;
}

bool SerialWorker::reached(std::uint64_t ticket) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_ >= ticket;
}

void SerialWorker::wait(std::uint64_t ticket) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (ticket > submitted_) {
    throw std::invalid_argument("SerialWorker::wait: ticket " + std::to_string(ticket) + " was never submitted");
  }
  progressed_.wait(lock, [&] { return done_ >= ticket; });
  auto it = errors_.find(ticket);
  if (it != errors_.end()) {
    std::exception_ptr e = it->second;
    errors_.erase(it);
    std::rethrow_exception(e);
  }
}

void SerialWorker::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    work_ready_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
    if (tasks_.empty()) return;  // stopping, and everything has run
    auto [ticket, task] = std::move(tasks_.front());
    tasks_.pop_front();
    lock.unlock();  // tasks run without the lock: they may submit or query
    std::exception_ptr error;
    try {
      task();
    } catch (...) {
      error = std::current_exception();
    }
    task = nullptr;  // captured state dies before the ticket is reported done
    lock.lock();
    if (error) errors_.emplace(ticket, error);
    done_ = ticket;
    progressed_.notify_all();
  }
}

std::unique_ptr<pool::UseEvent> WorkerEventSource::record(const pool::StreamUse& use) {
  if (use.device != -1 || use.stream == nullptr) {
    throw std::invalid_argument("WorkerEventSource: expected a serial worker's stream use (device -1)");
  }
  auto* worker = static_cast<SerialWorker*>(use.stream);
  return std::make_unique<WorkerEvent>(worker, worker->last_submitted());
}

}  // namespace hipferry::transfer
