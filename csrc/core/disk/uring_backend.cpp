// The io_uring backend (liburing): one ring of depth() entries driven from
// one thread. Built only where CMake found liburing (HIPFERRY_HAVE_LIBURING);
// elsewhere make_uring_backend refuses and the threads backend takes over.
#include "csrc/core/disk/io_backend.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef HIPFERRY_HAVE_LIBURING
#include <liburing.h>
#endif

namespace hipferry::disk {

#ifdef HIPFERRY_HAVE_LIBURING
namespace {

// "EPERM (Operation not permitted)": the name is what users search for.
std::string describe_errno(int error) {
  std::string text = std::strerror(error);
#if defined(__GLIBC__) && defined(__GLIBC_PREREQ)
#if __GLIBC_PREREQ(2, 32)
  if (const char* name = strerrorname_np(error)) text = std::string(name) + " (" + text + ")";
#endif
#endif
  return text;
}

// Linux moves at most this much in one read or write (MAX_RW_COUNT); larger
// requests are cut here, as pread would cut them: a short transfer.
constexpr std::size_t kMaxRequestBytes = 0x7ffff000;

class UringBackend final : public IoBackend {
 public:
  explicit UringBackend(std::size_t depth) : depth_(depth), batch_(depth) {}

  // The ring lives in this object from the start (liburing's struct is not
  // documented as copyable). Returns 0 or -errno.
  int init() {
    const unsigned entries = static_cast<unsigned>(depth_ > 0xFFFFFFFFu ? 0xFFFFFFFFu : depth_);
    const int ret = io_uring_queue_init(entries, &ring_, 0);
    initialized_ = ret == 0;
    return ret;
  }

  ~UringBackend() override {
    if (!initialized_) return;
    // Never leave the kernel a buffer: wait for everything in flight first.
    while (in_flight_ > 0) {
      const int ret = io_uring_submit_and_wait(&ring_, 1);
      if (ret < 0 && ret != -EINTR && ret != -EAGAIN) break;  // the ring is broken: nothing more to wait for
      take(batch_scratch(), depth_);
    }
    io_uring_queue_exit(&ring_);
  }

  const char* name() const override { return "io_uring"; }
  std::size_t depth() const override { return depth_; }

  void submit(const IoRequest& r) override {
    if (in_flight_ >= depth_) {
      throw std::logic_error("io_uring backend: submit beyond depth " + std::to_string(depth_));
    }
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (sqe == nullptr) {  // entries the kernel has not taken yet fill the queue
      flush();
      sqe = io_uring_get_sqe(&ring_);
      if (sqe == nullptr) throw std::runtime_error("io_uring backend: the submission queue stays full");
    }
    const auto bytes = static_cast<unsigned>(r.bytes < kMaxRequestBytes ? r.bytes : kMaxRequestBytes);
    if (r.op == IoOp::kRead) {
      io_uring_prep_read(sqe, r.fd, r.buffer, bytes, r.offset);
    } else {
      io_uring_prep_write(sqe, r.fd, r.buffer, bytes, r.offset);
    }
    sqe->user_data = r.tag;  // (the field itself: io_uring_sqe_set_data64 is liburing >= 2.2)
    ++in_flight_;
    // Submitted at once, one system call per request: the interface has no
    // "flush", and callers compute between submit and reap (ChunkPipeline),
    // so a request left in the queue would wait idle. Against a 1 MiB
    // transfer the call costs about a microsecond. Requests the kernel
    // defers (EAGAIN) go with the next reap.
    flush();
  }

  std::size_t reap(IoCompletion* out, std::size_t max, std::size_t min_complete) override {
    if (min_complete > in_flight_ || min_complete > max) {
      throw std::logic_error("io_uring backend: reap of " + std::to_string(min_complete) + " completions with " +
                             std::to_string(in_flight_) + " in flight and room for " + std::to_string(max));
    }
    std::size_t n = take(out, max);
    while (n < min_complete) {
      // Submits what is left in the queue and waits, in one io_uring_enter.
      const int ret = io_uring_submit_and_wait(&ring_, static_cast<unsigned>(min_complete - n));
      if (ret < 0 && ret != -EINTR && ret != -EAGAIN && ret != -EBUSY) {
        throw std::runtime_error("io_uring_enter: " + describe_errno(-ret));
      }
      n += take(out + n, max - n);
    }
    return n;
  }

 private:
  void flush() {
    for (;;) {
      const int ret = io_uring_submit(&ring_);
      if (ret >= 0 || ret == -EAGAIN || ret == -EBUSY) return;  // deferred ones go with the next reap
      if (ret != -EINTR) throw std::runtime_error("io_uring_submit: " + describe_errno(-ret));
    }
  }

  // Copies up to `max` completions that have arrived, without waiting.
  std::size_t take(IoCompletion* out, std::size_t max) {
    std::size_t n = 0;
    while (n < max) {
      const unsigned want = static_cast<unsigned>(std::min(max - n, batch_.size()));
      const unsigned got = io_uring_peek_batch_cqe(&ring_, batch_.data(), want);
      if (got == 0) break;
      for (unsigned i = 0; i < got; ++i) out[n + i] = IoCompletion{batch_[i]->user_data, batch_[i]->res};
      io_uring_cq_advance(&ring_, got);
      n += got;
      in_flight_ -= got;
    }
    return n;
  }

  IoCompletion* batch_scratch() {
    scratch_.resize(depth_);
    return scratch_.data();
  }

  io_uring ring_{};
  bool initialized_ = false;
  const std::size_t depth_;
  std::size_t in_flight_ = 0;
  std::vector<io_uring_cqe*> batch_;
  std::vector<IoCompletion> scratch_;
};

}  // namespace

std::unique_ptr<IoBackend> make_uring_backend(std::size_t depth, std::string* refused) {
  if (depth == 0) throw std::invalid_argument("make_uring_backend: depth must be at least 1, got 0");
  auto backend = std::make_unique<UringBackend>(depth);
  const int ret = backend->init();
  if (ret < 0) {
    if (refused) *refused = "io_uring_queue_init: " + describe_errno(-ret);
    return nullptr;
  }
  return backend;
}

#else  // !HIPFERRY_HAVE_LIBURING

std::unique_ptr<IoBackend> make_uring_backend(std::size_t depth, std::string* refused) {
  if (depth == 0) throw std::invalid_argument("make_uring_backend: depth must be at least 1, got 0");
  if (refused) *refused = "built without liburing";
  return nullptr;
}

#endif

}  // namespace hipferry::disk
