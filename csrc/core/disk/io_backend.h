// Asynchronous file I/O behind one small interface, so the disk state store's
// ordering (csrc/core/disk/io_queue.h, chunk_pipeline.h) runs against fakes in
// the C++ tests: fakes complete requests out of order, short, or with errors.
//
// Two real backends:
//  - io_uring (liburing): one ring, up to depth() requests in flight from one
//    thread; the kernel moves the bytes (O_DIRECT: straight into the buffer).
//  - threads: depth() threads doing pread/pwrite, where io_uring is refused
//    (an old kernel, a seccomp filter that blocks io_uring_setup, a build
//    without liburing).
// A backend does one request as asked: no splitting, no retry of a short
// transfer (IoQueue does those). Not thread-safe: one IoQueue drives one
// backend from one thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace hipferry::disk {

enum class IoOp : std::uint8_t { kRead, kWrite };

struct IoRequest {
  IoOp op = IoOp::kRead;
  int fd = -1;
  std::uint64_t offset = 0;
  void* buffer = nullptr;  // page aligned when the file was opened with O_DIRECT
  std::size_t bytes = 0;
  std::uint64_t tag = 0;  // handed back in the completion
};

struct IoCompletion {
  std::uint64_t tag = 0;
  std::int64_t result = 0;  // bytes moved (fewer than asked: a short transfer) or -errno
};

class IoBackend {
 public:
  virtual ~IoBackend() = default;
  // "io_uring", "threads", or a fake's name: what doctor and memory_stats report.
  virtual const char* name() const = 0;
  // The most requests in flight at once; the caller never submits more.
  virtual std::size_t depth() const = 0;
  // Queues `r`. Errors of the transfer itself come back in its completion;
  // throws std::runtime_error only when the backend itself is broken.
  virtual void submit(const IoRequest& r) = 0;
  // Blocks until at least `min_complete` requests have completed
  // (min_complete <= requests in flight), then writes up to `max` completions
  // to `out`, in any order. Returns how many it wrote (>= min_complete).
  virtual std::size_t reap(IoCompletion* out, std::size_t max, std::size_t min_complete) = 0;
};

// io_uring with `depth` entries, or nullptr with *refused saying why (the
// errno of io_uring_queue_init, or "built without liburing").
std::unique_ptr<IoBackend> make_uring_backend(std::size_t depth, std::string* refused);

// `depth` threads doing pread/pwrite.
std::unique_ptr<IoBackend> make_thread_backend(std::size_t depth);

// wanted: "auto" (io_uring where the kernel allows it, else threads),
// "io_uring" (throws std::runtime_error with the reason where refused) or
// "threads". *note says which runs and why (e.g. "io_uring refused: EPERM
// (Operation not permitted); threads take over").
std::unique_ptr<IoBackend> make_backend(const std::string& wanted, std::size_t depth, std::string* note);

}  // namespace hipferry::disk
