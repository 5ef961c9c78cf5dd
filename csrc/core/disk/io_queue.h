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
// Transfers that finish while it waits still have their tokens appended to
// poll()'s `done` before the throw (the caller learns which writes landed).
// The queue is then dead: it drops what was queued (pending() == 0), and
// every later poll(), read() or write() throws the same failure.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <stdexcept>
#include <string>
#include <utility>
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
  std::uint64_t requests = 0;         // requests submitted, resubmissions included
  std::uint64_t short_transfers = 0;  // completions that moved fewer bytes than asked
  std::size_t max_in_flight = 0;      // the deepest the backend was kept
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
  void write(const FileRef& file, std::uint64_t offset, const void* buffer, std::size_t bytes, std::uint64_t token);

  // Submits what the backend's depth allows and, with `wait` and something in
  // flight, blocks for at least one completion. Appends the tokens of the
  // transfers that finished to `done`. After a failure: Note [no I/O after a
  // failure returns], then throws the first IoFailure. A failure is a
  // completion with -errno, a read that moves 0 bytes (the end of the file,
  // error 0), a write that moves 0 bytes or one that reports more bytes than
  // asked (EIO), or a backend whose submit() throws (EIO, its message).
  void poll(bool wait, std::vector<std::uint64_t>* done);

  // Abandons the queue's work without failing it, for a caller that hit an
  // error of its own (ChunkPipeline's compute threw) and must start no new
  // I/O, which poll() would: drops every request not yet submitted, waits
  // for those in flight, and appends the tokens of the transfers that
  // finished meanwhile (one with a dropped request never does). Errors of
  // those requests are not reported; the transfers are abandoned anyway.
  // Then pending() == 0 and the queue takes new transfers. Nothing to do on
  // a dead queue (it drained before throwing).
  void cancel(std::vector<std::uint64_t>* done);

  // Transfers queued or in flight.
  std::size_t pending() const;
  const IoCounters& counters() const { return counters_; }
  IoBackend& backend() { return backend_; }

 private:
  // One queued transfer. Piece i covers bytes [i * request_bytes_, ...) of
  // it; moved[i] says how many of those have moved (a short transfer leaves
  // the rest to resubmit). At most one request per piece is in flight, so
  // the tag (slot << 32 | piece) names exactly one request.
  struct Transfer {
    IoOp op = IoOp::kRead;
    const FileRef* file = nullptr;
    std::uint64_t offset = 0;
    unsigned char* buffer = nullptr;
    std::size_t bytes = 0;
    std::uint64_t token = 0;
    std::vector<std::size_t> moved;  // per piece
    std::size_t pieces_left = 0;     // pieces not fully moved
    bool live = false;               // the slot holds a transfer
  };
  struct Piece {
    std::uint32_t slot = 0;
    std::uint32_t index = 0;
  };

  void enqueue(IoOp op, const FileRef& file, std::uint64_t offset, void* buffer, std::size_t bytes,
               std::uint64_t token);
  std::uint32_t take_slot();
  void finish(std::uint32_t slot, std::vector<std::uint64_t>* done);
  void submit_ready();
  void reap(std::size_t min_complete, std::vector<std::uint64_t>* done);
  void complete(const IoCompletion& c, std::vector<std::uint64_t>* done);
  void fail(const Transfer& t, std::uint64_t offset, std::size_t bytes, int error, const std::string& cause);
  void wait_in_flight(std::vector<std::uint64_t>* done);
  void drop_queued();
  [[noreturn]] void throw_failure() const;

  IoBackend& backend_;
  std::size_t request_bytes_;
  std::size_t depth_;  // backend_.depth(), fixed
  IoCounters counters_;
  std::deque<Piece> ready_;          // requests not yet submitted
  std::vector<Transfer> transfers_;  // indexed by the tag's slot
  std::vector<std::uint32_t> free_slots_;
  std::vector<std::uint64_t> empty_done_;  // tokens of 0-byte transfers, reported by the next poll
  std::size_t live_ = 0;                   // transfers queued or in flight
  std::size_t in_flight_ = 0;              // requests the backend holds
  std::vector<IoCompletion> completions_;  // reap's scratch, depth_ long
  bool cancelling_ = false;                // cancel() waits: failures are not recorded
  // The first failure; once set the queue is dead (Note [no I/O after a failure returns]).
  bool failed_ = false;
  std::string failure_message_;
  std::string failure_path_;
  std::uint64_t failure_offset_ = 0;
  int failure_error_ = 0;
};

}  // namespace hipferry::disk
