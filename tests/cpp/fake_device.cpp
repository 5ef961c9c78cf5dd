// The fake device (see fake_device.h).
#include "tests/cpp/fake_device.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <utility>

namespace hipferry::fake {
namespace {

std::atomic<long> event_states{0};

bool overlap(const schedule::Range& a, const schedule::Range& b) {
  if (a.bytes == 0 || b.bytes == 0) return false;
  auto a0 = reinterpret_cast<std::uintptr_t>(a.begin), b0 = reinterpret_cast<std::uintptr_t>(b.begin);
  return a0 < b0 + b.bytes && b0 < a0 + a.bytes;
}

bool any_overlap(const std::vector<schedule::Range>& xs, const std::vector<schedule::Range>& ys) {
  for (const auto& x : xs) {
    for (const auto& y : ys) {
      if (overlap(x, y)) return true;
    }
  }
  return false;
}

}  // namespace

struct FakeDevice::EventState {
  EventState() { event_states.fetch_add(1); }
  ~EventState() { event_states.fetch_sub(1); }
  bool done = false;  // its record has run
  std::string error;  // the stream's error when it ran
};

struct FakeDevice::Op {
  enum Kind { kWork, kRecord, kWait } kind = kWork;
  std::uint64_t order = 0;  // queue order over all streams
  std::uint64_t work = 0;   // work number (kWork)
  bool copy = false;
  schedule::Work body;
  std::shared_ptr<EventState> event;  // kRecord, kWait
};

struct FakeDevice::StreamState {
  std::string name;
  std::deque<Op> ops;
  std::string error;  // sticky
};

namespace {

class FakeEvent : public schedule::Event {
 public:
  FakeEvent(FakeDevice* device, std::shared_ptr<FakeDevice::EventState> state)
      : device_(device), state_(std::move(state)) {}
  bool query() override { return device_->done(state_); }
  void synchronize() override {
    device_->wait_for(state_);
    const std::string error = device_->error_of(state_);
    if (!error.empty()) throw std::runtime_error(error);
  }
  FakeDevice* device() const { return device_; }
  const std::shared_ptr<FakeDevice::EventState>& state() const { return state_; }

 private:
  FakeDevice* device_;
  std::shared_ptr<FakeDevice::EventState> state_;
};

class FakeStream : public schedule::Stream {
 public:
  FakeStream(FakeDevice* device, FakeDevice::StreamState* state) : device_(device), state_(state) {}
  void copy(void* dst, const void* src, std::size_t bytes, const schedule::Label& label) override {
    FakeDevice::Op op;
    op.kind = FakeDevice::Op::kWork;
    op.copy = true;
    op.body.label = label;
    op.body.on_host = [dst, src, bytes] { std::memcpy(dst, src, bytes); };
    op.body.reads.push_back({src, bytes});
    op.body.writes.push_back({dst, bytes});
    device_->queue(state_, std::move(op));
  }
  void enqueue(schedule::Work work) override {
    if (!work.on_host) throw std::invalid_argument("FakeStream: work without a host form");
    FakeDevice::Op op;
    op.kind = FakeDevice::Op::kWork;
    op.body = std::move(work);
    device_->queue(state_, std::move(op));
  }
  std::shared_ptr<schedule::Event> record() override {
    FakeDevice::Op op;
    op.kind = FakeDevice::Op::kRecord;
    op.event = std::make_shared<FakeDevice::EventState>();
    auto event = std::make_shared<FakeEvent>(device_, op.event);
    device_->queue(state_, std::move(op));
    return event;
  }
  void wait(const std::shared_ptr<schedule::Event>& event) override {
    if (!event) return;
    auto* fake = dynamic_cast<FakeEvent*>(event.get());
    FakeDevice::Op op;
    op.kind = FakeDevice::Op::kWait;
    if (fake != nullptr && fake->device() == device_) {
      op.event = fake->state();
    } else {  // another kind of stream's event (the host's): the host waits for it now
      op.event = std::make_shared<FakeDevice::EventState>();
      op.event->done = true;
      try {
        event->synchronize();
      } catch (const std::exception& e) {
        op.event->error = e.what();
      }
    }
    device_->queue(state_, std::move(op));
  }
  std::string track() const override { return state_->name; }

 private:
  FakeDevice* device_;
  FakeDevice::StreamState* state_;
};

}  // namespace

FakeDevice::FakeDevice(Options options) : options_(options), rng_(options.seed) {
  if (options_.threaded) thread_ = std::thread([this] { device_loop(); });
}

FakeDevice::~FakeDevice() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  if (thread_.joinable()) thread_.join();
}

long FakeDevice::live_events() { return event_states.load(); }

FakeDevice::StreamState* FakeDevice::add_stream(const std::string& name) {
  std::lock_guard<std::mutex> lock(mutex_);
  streams_.push_back(std::make_unique<StreamState>());
  streams_.back()->name = name;
  return streams_.back().get();
}

std::unique_ptr<schedule::Stream> FakeDevice::stream(const std::string& name) {
  return std::make_unique<FakeStream>(this, add_stream(name));
}

void FakeDevice::queue(StreamState* s, Op op) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    op.order = ++ops_;
    if (op.kind == Op::kWork) op.work = ++work_;
    s->ops.push_back(std::move(op));
  }
  changed_.notify_all();
}

void FakeDevice::fail_work(std::uint64_t n) {
  std::lock_guard<std::mutex> lock(mutex_);
  fail_.insert(n);
}

void FakeDevice::check_locked(const Op& op, const StreamState* at) {
  for (const auto& s : streams_) {
    for (const Op& earlier : s->ops) {
      if (earlier.kind != Op::kWork || earlier.order >= op.order || &earlier == &op) continue;
      const bool raw = any_overlap(op.body.reads, earlier.body.writes);
      const bool war = any_overlap(op.body.writes, earlier.body.reads);
      const bool waw = any_overlap(op.body.writes, earlier.body.writes);
      if (raw || war || waw) {
        hazards_.push_back(std::string(raw   ? "read-after-write"
                                       : war ? "write-after-read"
                                             : "write-after-write") +
                           ": '" + op.body.label.name + "' on " + at->name + " ran before '" + earlier.body.label.name +
                           "' on " + s->name + " that was queued before it");
      }
    }
  }
}

bool FakeDevice::run_one_locked() {
  std::vector<StreamState*> runnable;
  for (const auto& s : streams_) {
    if (s->ops.empty()) continue;
    const Op& front = s->ops.front();
    if (front.kind == Op::kWait && !front.event->done) continue;
    runnable.push_back(s.get());
  }
  if (runnable.empty()) return false;
  StreamState* s = runnable[std::uniform_int_distribution<std::size_t>(0, runnable.size() - 1)(rng_)];
  Op& op = s->ops.front();
  switch (op.kind) {
    case Op::kWork: {
      check_locked(op, s);
      if (!s->error.empty()) break;  // sticky: work after a failure does not run
      const bool fail =
          fail_.count(op.work) != 0 || (options_.fail_probability > 0 &&
                                        std::uniform_real_distribution<double>(0, 1)(rng_) < options_.fail_probability);
      if (fail) {
        ++failures_;
        s->error = "fake failure of '" + op.body.label.name + "' on " + s->name;
        break;
      }
      op.body.on_host();
      break;
    }
    case Op::kRecord:
      op.event->error = s->error;
      op.event->done = true;
      break;
    case Op::kWait:
      if (s->error.empty() && !op.event->error.empty()) s->error = op.event->error;
      break;
  }
  s->ops.pop_front();  // the work's captures die here, under the lock (they own nothing of the device)
  return true;
}

void FakeDevice::run_all() {
  std::unique_lock<std::mutex> lock(mutex_);
  if (options_.threaded) {
    changed_.wait(
        lock, [&] { return std::all_of(streams_.begin(), streams_.end(), [](auto& s) { return s->ops.empty(); }); });
    return;
  }
  while (run_one_locked()) {
  }
  for (const auto& s : streams_) {
    if (!s->ops.empty())
      throw std::logic_error("fake device: deadlock: " + s->name + " waits for an event never recorded");
  }
}

void FakeDevice::wait_for(const std::shared_ptr<EventState>& e) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (options_.threaded) {
    if (!changed_.wait_for(lock, std::chrono::seconds(30), [&] { return e->done; })) {
      throw std::logic_error("fake device: an event did not complete in 30 s (deadlock)");
    }
    return;
  }
  while (!e->done) {
    if (!run_one_locked())
      throw std::logic_error("fake device: deadlock: the host waits for an event that cannot complete");
  }
}

bool FakeDevice::done(const std::shared_ptr<EventState>& e) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return e->done;
}

std::string FakeDevice::error_of(const std::shared_ptr<EventState>& e) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return e->error;
}

void FakeDevice::device_loop() {
  std::mt19937_64 pause_rng(options_.seed ^ 0x9e3779b97f4a7c15ull);
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    if (stopping_) return;
    if (!run_one_locked()) {
      changed_.wait(lock);
      continue;
    }
    changed_.notify_all();
    if (options_.max_pause_us > 0) {
      const int us = std::uniform_int_distribution<int>(0, options_.max_pause_us)(pause_rng);
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::microseconds(us));
      lock.lock();
    }
  }
}

void FakeDevice::host_reads(const void* p, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  const std::vector<schedule::Range> r{{p, bytes}};
  for (const auto& s : streams_) {
    for (const Op& op : s->ops) {
      if (op.kind == Op::kWork && any_overlap(r, op.body.writes)) {
        hazards_.push_back("the host read what '" + op.body.label.name + "' on " + s->name + " has not written yet");
      }
    }
  }
}

void FakeDevice::host_writes(void* p, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  const std::vector<schedule::Range> r{{p, bytes}};
  for (const auto& s : streams_) {
    for (const Op& op : s->ops) {
      if (op.kind == Op::kWork && (any_overlap(r, op.body.writes) || any_overlap(r, op.body.reads))) {
        hazards_.push_back("the host wrote what '" + op.body.label.name + "' on " + s->name + " still uses");
      }
    }
  }
}

std::vector<std::string> FakeDevice::hazards() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return hazards_;
}

std::size_t FakeDevice::pending() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::size_t n = 0;
  for (const auto& s : streams_) n += s->ops.size();
  return n;
}

std::size_t FakeDevice::unrun_copy_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::size_t n = 0;
  for (const auto& s : streams_) {
    for (const Op& op : s->ops) {
      if (op.kind == Op::kWork && op.copy) n += op.body.writes[0].bytes;
    }
  }
  return n;
}

std::uint64_t FakeDevice::work_queued() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return work_;
}

std::uint64_t FakeDevice::failures() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return failures_;
}

}  // namespace hipferry::fake
