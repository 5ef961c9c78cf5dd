// The disk store's pipelined pass: chunk i's reads, then its compute, then its
// writes, with a window of buffers so that while chunk k is computed, chunks
// k+1 .. k+window-1 are read and chunk k-1 (and older) are written.
// Torch-free: compute is a callback (the torch layer runs the fused AdamW
// step on the buffer); the C++ tests drive it with fake backends.
//
// Note [chunk window]
// ~~~~~~~~~~~~~~~~~~~
// Chunk i uses buffer i % window. Invariants:
//  - chunk i's reads start only after chunk i - window's writes finished
//    (the buffer is free), so host memory is the window, never the state;
//  - compute(i) runs on the calling thread after all of chunk i's reads
//    finished, in chunk order (0, 1, 2, ...);
//  - chunk i's writes are queued right after compute(i) returns;
//  - run() returns once every write finished (all bytes handed to the
//    kernel; durability is the caller's fdatasync).
// On an I/O failure or an exception from compute(): nothing new starts, every
// request in flight finishes (Note [no I/O after a failure returns]), then the
// error is rethrown. computed() says how many chunks (0 .. computed()-1) ran
// compute, so the caller can undo what those changed in its own memory;
// written() how many of those had all their writes finished.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "csrc/core/disk/io_queue.h"

namespace hipferry::disk {

// One piece of a chunk's I/O: `bytes` at `offset` of `file`, to/from the
// chunk's buffer at `buffer_offset`.
struct Extent {
  const FileRef* file = nullptr;
  std::uint64_t offset = 0;
  std::size_t buffer_offset = 0;
  std::size_t bytes = 0;
};

struct ChunkIo {
  std::vector<Extent> reads;   // may be empty (a pass that only writes)
  std::vector<Extent> writes;  // may be empty (a pass that only reads)
};

class ChunkPipeline {
 public:
  // `buffers`: the window, each at least as large as any chunk's extents
  // reach (the caller's, page aligned for O_DIRECT).
  ChunkPipeline(IoQueue& queue, std::vector<void*> buffers);

  // Runs chunks 0 .. count-1. plan(i) is called once per chunk, before its
  // reads; compute(i, buffer) once, after them.
  void run(std::size_t count, const std::function<ChunkIo(std::size_t)>& plan,
           const std::function<void(std::size_t, void*)>& compute);

  std::size_t computed() const { return computed_; }
  std::size_t written() const { return written_; }
  std::size_t window() const { return buffers_.size(); }

 private:
  IoQueue& queue_;
  std::vector<void*> buffers_;
  std::size_t computed_ = 0;
  std::size_t written_ = 0;
};

}  // namespace hipferry::disk
