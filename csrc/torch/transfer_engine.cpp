// The transfer engine's torch layer: the Transfer handle, which owns a
// transfer's tensors and hands them to the engine's release list
// (csrc/engine/engine.h), and the engine's counters. Starting a transfer
// (start_transfer) is in transfer_start.cpp.
#include "csrc/torch/transfer_engine.h"

#include <atomic>
#include <exception>
#include <functional>
#include <string>
#include <utility>

#include "csrc/core/errors.h"
#include "csrc/engine/engine.h"
#include "csrc/engine/transfer_paths.h"
#include "csrc/torch/copy_cast_checks.h"
#include "csrc/torch/current_stream.h"
#include "csrc/torch/pinned_pool.h"
#include "csrc/torch/stable.h"
#include "hip/trace_session.h"

namespace hipferry {
namespace {

using engine::Completion;
using engine::Engine;

// What a handle hands the release list: its tensors, type-erased.
std::shared_ptr<void> holding_of(std::vector<Tensor> tensors) {
  if (tensors.empty()) return nullptr;
  return std::make_shared<std::vector<Tensor>>(std::move(tensors));
}

}  // namespace

std::uint64_t fork_generation() { return Engine::fork_generation(); }

Transfer::~Transfer() {
  if (state_ != State::kPending) return;
  std::vector<Tensor> holdings = std::move(keepalive_);
  for (auto& t : results_) holdings.push_back(std::move(t));
  if (generation_ != fork_generation()) {          // a parent's transfer in a forked child: nothing ran here
    new std::vector<Tensor>(std::move(holdings));  // never touched again: no deleter runs in the child
    return;
  }
  try {
    if (outcome_ && outcome_->failed()) {
      sync_streams_quietly();
    } else {
      Engine::get().release_after(completion_, holding_of(std::move(holdings)));
    }
  } catch (...) {  // a destructor must not throw; keep the holdings (a leak, never a use after free)
    new std::vector<Tensor>(std::move(holdings));
  }
}

void Transfer::check_same_process(const char* what) const {
  HF_CHECK(generation_ == fork_generation(), "hipferry.Transfer.", what,
           ": this transfer was started before the process forked; it did not run in this process "
           "(start transfers in the process that uses them)");
}

void Transfer::sync_streams_quietly() const {
  if (copy_device_ < 0) return;
  for (rt::StreamHandle s : {copy_stream_, staging_stream_}) {
    if (s == nullptr) continue;
    try {
      rt::stream_synchronize(s, copy_device_);
    } catch (...) {
    }
  }
}

void Transfer::settle_locked(std::vector<Tensor>& dropped) {
  if (state_ != State::kPending || !outcome_ || !outcome_->failed()) return;
  state_ = State::kFailed;
  error_ = outcome_->error();
  // Queued work may still touch what we hold: the streams are synchronized
  // (by the caller, unlocked) before `dropped` dies.
  dropped = std::move(keepalive_);
  for (auto& t : results_) dropped.push_back(std::move(t));
  results_.clear();
}

bool Transfer::ready() {
  check_same_process("ready");
  Engine::get().poll();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (state_ == State::kFailed) return true;
  }
  return completion_.done();
}

void Transfer::synchronize() {
  check_same_process("synchronize");
  if (completion_.ticket != 0) Engine::get().worker().wait(completion_.ticket);
  std::vector<Tensor> dropped;
  std::string error;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    settle_locked(dropped);
    if (state_ == State::kFailed) error = error_;
  }
  if (!dropped.empty()) sync_streams_quietly();
  dropped.clear();
  HF_CHECK(error.empty(), "hipferry.Transfer: the copy failed: ", error);
  if (completion_.event) completion_.event->synchronize();
}

Transfer::Waited Transfer::wait() {
  check_same_process("wait");
  {
    std::lock_guard<std::mutex> lock(mutex_);
    HF_CHECK(state_ != State::kWaited,
             "hipferry.Transfer.wait: this transfer was already waited on; wait() hands the results over "
             "once (keep what the first call returned)");
  }
  // Pageable sources: the staging must have queued everything before the
  // completion event means anything.
  if (completion_.ticket != 0) Engine::get().worker().wait(completion_.ticket);
  std::vector<Tensor> results, holdings;
  std::string error;
  bool record = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    HF_CHECK(state_ != State::kWaited,
             "hipferry.Transfer.wait: this transfer was already waited on (by another thread); wait() hands "
             "the results over once");
    settle_locked(holdings);
    if (state_ == State::kFailed) {
      error = error_;
    } else {
      state_ = State::kWaited;  // claimed: a racing wait() gets "already waited"
      results = std::move(results_);
      holdings = std::move(keepalive_);
    }
  }
  if (!error.empty()) {
    sync_streams_quietly();
    holdings.clear();
    HF_CHECK(false, "hipferry.Transfer.wait: the copy failed, its results were discarded: ", error);
  }
  try {
    if (completion_.event && device_.is_cuda()) {
      // The consumer is the current stream: it waits, the host does not.
      rt::DeviceGuard guard(copy_device_);  // a nullptr (default) stream means the current device's
      const rt::StreamHandle current = current_torch_stream(copy_device_);
      completion_.event->block_stream(current);
      if (alloc_stream_ != current) {
        // Results were allocated on the stream current at prefetch(); used
        // on this one, torch's allocator must also wait for this stream's
        // work before reusing them: the caller records them on it
        // (t.record_stream(current), from Python: the stable ABI has none).
        completion_.event->block_stream(alloc_stream_);
        record = true;
      }
    } else if (completion_.event) {
      completion_.event->synchronize();  // the consumer is the host
    }
  } catch (...) {  // nothing handed over: the handle keeps everything, wait() may be called again
    std::lock_guard<std::mutex> lock(mutex_);
    results_ = std::move(results);
    keepalive_ = std::move(holdings);
    state_ = State::kPending;
    throw;
  }
  if (device_.is_cuda()) Engine::get().release_after(completion_, holding_of(std::move(holdings)));
  holdings.clear();
  Engine::get().poll();
  Waited waited;
  waited.results = std::move(results);
  waited.record_on_current_stream = record && !waited.results.empty();
  return waited;
}

TransferStats transfer_stats() {
  Engine& e = Engine::get();
  e.poll();
  const engine::Counters& c = e.counters();
  TransferStats s;
  s.transfers = c.transfers;
  s.bytes = c.bytes;
  s.packed_batches = c.packed_batches;
  s.packed_tensors = c.packed_tensors;
  s.runtime_batches = c.runtime_batches;
  s.staged_chunks = c.staged_chunks;
  s.direct_copies = c.direct_copies;
  s.worker_tasks = c.worker_tasks;
  s.pending_releases = e.pending();
  return s;
}

std::size_t poll_transfer_releases() { return Engine::get().poll(); }

std::string set_batched_copy(const std::string& mode) {
  Engine& e = Engine::get();
  const std::string previous = e.batched_copy();
  if (mode == "kernel") {
    e.set_batched_copy(engine::BatchedCopy::kKernel);
  } else if (mode == "runtime") {
    e.set_batched_copy(engine::BatchedCopy::kRuntime);
  } else {
    HF_CHECK_VALUE(mode.empty(), "hipferry.configure_transfers: batched_copy must be 'kernel' or 'runtime', got '",
                   mode, "'");
  }
  return mode.empty() ? previous : e.batched_copy();
}

void drain_transfer_worker() { Engine::get().drain_worker(); }

transfer::SerialWorker& transfer_worker() { return Engine::get().worker(); }

}  // namespace hipferry
