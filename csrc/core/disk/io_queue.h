// Transfers of any size over an IoBackend: split into requests of
// request_bytes (DeepSpeed's aio and fio use 1 MiB), kept depth() deep, a
// short transfer resubmitted for the rest, a failure reported with the file
// and offset. Torch-free; tests drive it with adversarial fake backends.
//
// Note [no I/O after a failure returns]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Buffers are the caller's (pool blocks). Once a transfer fails, the queue
// issues nothing new, waits for every request still in flight, and only then
// throws: when the exception reaches the caller, the kernel writes into no
// buffer and reads from none, so the caller may free or reuse them at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <stdexcept>
#include <string>
#include <vector>

#include "csrc/core/disk/io_backend.h"

namespace hipferry::disk {

// An open file: its descriptor and the path that error messages name.
struct FileRef {
  int fd = -1;
  std::string path;
};

// A transfer that failed: the message names the operation, the file, the
// offset of the failed request, and the cause (strerror, "short write" ...).
struct IoFailure : std::runtime_error {
  IoFailure(const std::string& message, std::string path, std::uint64_t offset, int error)
      : std::runtime_error(message), path(std::move(path)), offset(offset), error(error) {}
  std::string path;
  std::uint64_t offset;
  int error;  // errno, or 0 for "end of file" (a read of a truncated file)
};

struct IoCounters {
  std::uint64_t bytes_read = 0;
  std::uint64_t bytes_written = 0;
  std::uint64_t requests = 0;           // requests submitted, resubmissions included
  std::uint64_t short_transfers = 0;    // completions that moved fewer bytes than asked
  std::size_t max_in_flight = 0;        // the deepest the backend was kept
};

class IoQueue {
 public:
  // request_bytes > 0; a multiple of 4096 for O_DIRECT files.
  IoQueue(IoBackend& backend, std::size_t request_bytes = std::size_t{1} << 20);
  IoQueue(const IoQueue&) = delete;
  IoQueue& operator=(const IoQueue&) = delete;
  // Waits for requests in flight (never leaves the kernel a buffer).
  ~IoQueue();

  // Queues a transfer of `bytes` at `offset` of `file` (which must outlive
  // it) from/to `buffer`; poll() reports `token` once every byte moved. A
  // read that reaches the end of the file fails ("truncated").
  void read(const FileRef& file, std::uint64_t offset, void* buffer, std::size_t bytes, std::uint64_t token);
  void write(const FileRef& file, std::uint64_t offset, const void* buffer, std::size_t bytes,
             std::uint64_t token);

  // Submits what the backend's depth allows and, with `wait` and something in
  // flight, blocks for at least one completion. Appends the tokens of the
  // transfers that finished to `done`. After a failure: Note [no I/O after a
  // failure returns], then throws the first IoFailure.
  void poll(bool wait, std::vector<std::uint64_t>* done);

  // Transfers queued or in flight.
  std::size_t pending() const;
  const IoCounters& counters() const { return counters_; }
  IoBackend& backend() { return backend_; }

 private:
  struct Transfer;
  struct Piece;
  void submit_ready();
  void complete(const IoCompletion& c, std::vector<std::uint64_t>* done);
  void drain_after_failure();

  IoBackend& backend_;
  std::size_t request_bytes_;
  IoCounters counters_;
  // Implementation state is private to io_queue.cpp's author.
  std::deque<Piece*> ready_;                 // requests not yet submitted
  std::vector<Transfer*> transfers_;         // indexed by the tag's transfer slot
  std::size_t in_flight_ = 0;
  bool failed_ = false;
  std::string failure_message_;
  std::string failure_path_;
  std::uint64_t failure_offset_ = 0;
  int failure_error_ = 0;
};

}  // namespace hipferry::disk
