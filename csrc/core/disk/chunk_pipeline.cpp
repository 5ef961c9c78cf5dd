// ChunkPipeline::run (chunk_pipeline.h, Note [chunk window]).
//
// Chunks [written, started) hold a buffer; chunk i may start (plan, reads)
// once i < written + window. Chunks start, compute and count as written in
// order, so "chunk i - window's writes finished" is "written > i - window".
// Transfer tokens are chunk * 2 + (1 for a write), counted down per chunk.
#include "csrc/core/disk/chunk_pipeline.h"

#include <stdexcept>
#include <string>

namespace hipferry::disk {
namespace {

std::uint64_t token_of(std::size_t chunk, bool write) { return std::uint64_t{chunk} * 2 + (write ? 1 : 0); }

class Pass {
 public:
  Pass(IoQueue& queue, const std::vector<void*>& buffers, std::size_t count,
       const std::function<ChunkIo(std::size_t)>& plan, const std::function<void(std::size_t, void*)>& compute,
       std::size_t& computed, std::size_t& written)
      : queue_(queue),
        buffers_(buffers),
        slots_(buffers.size()),
        count_(count),
        plan_(plan),
        compute_(compute),
        computed_(computed),
        written_(written) {}

  void run();
  void abandon();

 private:
  struct Slot {
    ChunkIo io;
    std::size_t reads_left = 0;   // reads of the chunk not finished
    std::size_t writes_left = 0;  // its writes not finished (queued after compute)
  };

  Slot& slot(std::size_t chunk) { return slots_[chunk % slots_.size()]; }
  unsigned char* buffer(std::size_t chunk) const {
    return static_cast<unsigned char*>(buffers_[chunk % buffers_.size()]);
  }
  void start_chunks();
  void pump();
  void take_done();
  void compute_next();

  IoQueue& queue_;
  const std::vector<void*>& buffers_;
  std::vector<Slot> slots_;
  std::size_t count_;
  const std::function<ChunkIo(std::size_t)>& plan_;
  const std::function<void(std::size_t, void*)>& compute_;
  std::size_t& computed_;            // chunks whose compute returned
  std::size_t& written_;             // chunks whose writes all finished (a prefix)
  std::size_t started_ = 0;          // chunks planned and their reads queued
  std::vector<std::uint64_t> done_;  // tokens the queue reported, not yet taken
};

void check_extents(const std::vector<Extent>& extents, std::size_t chunk, const char* kind) {
  for (std::size_t j = 0; j < extents.size(); ++j) {
    if (extents[j].file == nullptr) {
      throw std::invalid_argument("ChunkPipeline: plan(" + std::to_string(chunk) + ")." + kind + "[" +
                                  std::to_string(j) + "].file is null; expected an open file");
    }
  }
}

// Plans and queues the reads of every chunk whose buffer is free.
void Pass::start_chunks() {
  const std::size_t window = slots_.size();
  while (started_ < count_ && started_ < written_ + window) {
    const std::size_t chunk = started_;
    Slot& s = slot(chunk);
    s.io = plan_(chunk);
    check_extents(s.io.reads, chunk, "reads");
    check_extents(s.io.writes, chunk, "writes");
    s.reads_left = s.io.reads.size();
    s.writes_left = s.io.writes.size();
    ++started_;
    for (const Extent& e : s.io.reads) {
      queue_.read(*e.file, e.offset, buffer(chunk) + e.buffer_offset, e.bytes, token_of(chunk, false));
    }
  }
}

// Counts down the finished transfers; advances written_ over the prefix of
// computed chunks whose writes all finished (freeing their buffers).
void Pass::take_done() {
  for (std::uint64_t token : done_) {
    Slot& s = slot(static_cast<std::size_t>(token / 2));
    --((token & 1) ? s.writes_left : s.reads_left);
  }
  done_.clear();
  while (written_ < computed_ && slot(written_).writes_left == 0) ++written_;
}

// Queues and submits everything the window allows without blocking, taking
// completions as they come (each may free a buffer for one more chunk).
void Pass::pump() {
  while (true) {
    start_chunks();
    queue_.poll(false, &done_);
    if (done_.empty()) return;
    take_done();
  }
}

void Pass::compute_next() {
  const std::size_t chunk = computed_;
  compute_(chunk, buffer(chunk));
  ++computed_;
  for (const Extent& e : slot(chunk).io.writes) {
    queue_.write(*e.file, e.offset, buffer(chunk) + e.buffer_offset, e.bytes, token_of(chunk, true));
  }
  take_done();  // a chunk without writes is written at once
}

void Pass::run() {
  while (written_ < count_) {
    pump();
    if (written_ == count_) return;  // the last writes finished in pump
    if (computed_ < started_ && slot(computed_).reads_left == 0) {
      compute_next();
      continue;
    }
    if (queue_.pending() == 0) {
      throw std::logic_error("ChunkPipeline: stalled with nothing in flight at chunk " + std::to_string(computed_));
    }
    queue_.poll(true, &done_);
    take_done();
  }
}

// After an error: start nothing, let the requests in flight finish (the
// queue has already drained after its own failure), count what they finished.
void Pass::abandon() {
  try {
    queue_.cancel(&done_);
  } catch (...) {
    // A broken backend: the first error is the one to report.
  }
  take_done();
}

}  // namespace

ChunkPipeline::ChunkPipeline(IoQueue& queue, std::vector<void*> buffers) : queue_(queue), buffers_(std::move(buffers)) {
  if (buffers_.empty()) throw std::invalid_argument("ChunkPipeline: buffers is empty; expected a window of >= 1");
  for (std::size_t i = 0; i < buffers_.size(); ++i) {
    if (buffers_[i] == nullptr) {
      throw std::invalid_argument("ChunkPipeline: buffers[" + std::to_string(i) + "] is null");
    }
  }
}

void ChunkPipeline::run(std::size_t count, const std::function<ChunkIo(std::size_t)>& plan,
                        const std::function<void(std::size_t, void*)>& compute) {
  if (!plan || !compute) throw std::invalid_argument("ChunkPipeline::run: plan and compute must be callable");
  if (queue_.pending() != 0) {
    throw std::invalid_argument("ChunkPipeline::run: the queue has " + std::to_string(queue_.pending()) +
                                " transfers pending; run() needs it to itself");
  }
  computed_ = 0;
  written_ = 0;
  Pass pass(queue_, buffers_, count, plan, compute, computed_, written_);
  try {
    pass.run();
  } catch (...) {
    pass.abandon();
    throw;
  }
}

}  // namespace hipferry::disk
