// The threads backend: `depth` threads, each doing one blocking pread/pwrite
// at a time, so up to depth() requests reach the disk at once where io_uring
// is refused.
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "csrc/core/disk/io_backend.h"

namespace hipferry::disk {
namespace {

// One system call, as the interface asks: a short transfer comes back as it
// is (IoQueue resubmits the rest). EINTR is no transfer at all, so it retries.
std::int64_t perform(const IoRequest& r) {
  const auto offset = static_cast<off_t>(r.offset);
  for (;;) {
    const ssize_t n =
        r.op == IoOp::kRead ? ::pread(r.fd, r.buffer, r.bytes, offset) : ::pwrite(r.fd, r.buffer, r.bytes, offset);
    if (n >= 0) return n;
    if (errno != EINTR) return -static_cast<std::int64_t>(errno);
  }
}

class ThreadBackend final : public IoBackend {
 public:
  explicit ThreadBackend(std::size_t depth) : depth_(depth) {
    workers_.reserve(depth);
    try {
      for (std::size_t i = 0; i < depth; ++i) workers_.emplace_back([this] { work(); });
    } catch (const std::system_error&) {
      // A pid or thread limit: fewer threads still move every request (they
      // queue); none at all cannot.
      if (workers_.empty()) throw;
    }
  }

  ~ThreadBackend() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    requests_ready_.notify_all();
    // Workers finish what was submitted first: no buffer is touched after this returns.
    for (std::thread& t : workers_) t.join();
  }

  const char* name() const override { return "threads"; }
  std::size_t depth() const override { return depth_; }

  void submit(const IoRequest& r) override {
    if (in_flight_ >= depth_) throw std::logic_error("threads backend: submit beyond depth " + std::to_string(depth_));
    ++in_flight_;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      requests_.push_back(r);
    }
    requests_ready_.notify_one();
  }

  std::size_t reap(IoCompletion* out, std::size_t max, std::size_t min_complete) override {
    if (min_complete > in_flight_ || min_complete > max) {  // would wait forever
      throw std::logic_error("threads backend: reap of " + std::to_string(min_complete) + " completions with " +
                             std::to_string(in_flight_) + " in flight and room for " + std::to_string(max));
    }
    std::unique_lock<std::mutex> lock(mutex_);
    completions_ready_.wait(lock, [&] { return completions_.size() >= min_complete; });
    std::size_t n = 0;
    while (n < max && !completions_.empty()) {
      out[n++] = completions_.front();
      completions_.pop_front();
    }
    in_flight_ -= n;
    return n;
  }

 private:
  void work() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      requests_ready_.wait(lock, [&] { return stopping_ || !requests_.empty(); });
      if (requests_.empty()) return;  // stopping, and nothing left to do
      const IoRequest r = requests_.front();
      requests_.pop_front();
      lock.unlock();
      const IoCompletion done{r.tag, perform(r)};
      lock.lock();
      completions_.push_back(done);
      // notify_all: reap() waits for a count, and only one thread reaps.
      completions_ready_.notify_all();
    }
  }

  const std::size_t depth_;
  std::size_t in_flight_ = 0;  // submitted, not yet reaped: the driving thread's alone
  std::mutex mutex_;
  std::condition_variable requests_ready_;
  std::condition_variable completions_ready_;
  std::deque<IoRequest> requests_;
  std::deque<IoCompletion> completions_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;  // last: started after every member above exists
};

}  // namespace

std::unique_ptr<IoBackend> make_thread_backend(std::size_t depth) {
  if (depth == 0) throw std::invalid_argument("make_thread_backend: depth must be at least 1, got 0");
  return std::make_unique<ThreadBackend>(depth);
}

}  // namespace hipferry::disk
