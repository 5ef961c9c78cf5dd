// The transfer engine's process-wide machinery, torch-free: the worker
// thread, the copy streams of each GPU, the counters, the batched-copy
// setting and the release list (Note [hipferry transfer engine] in
// csrc/torch/transfer_engine.h). The ATen layer (csrc/torch/transfer_engine.*)
// turns tensors into CopyItems and holdings and hands them here.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "csrc/core/schedule/release_list.h"
#include "csrc/core/transfer/serial_worker.h"
#include "csrc/engine/transfer_paths.h"
#include "hip/runtime.h"
#include "hip/trace_session.h"

namespace hipferry::engine {

// When a transfer's work is done. Both parts are optional.
struct Completion {
  std::uint64_t ticket = 0;          // worker task (0: none)
  std::shared_ptr<rt::Event> event;  // after all stream work (nullptr: none)
  bool done() const;                 // never blocks; throws when the runtime cannot say
};

class Engine {
 public:
  // Never destroyed: handles may outlive static destruction, and the worker
  // and streams must not be torn down under them at exit. A forked child
  // (a DataLoader worker) has no worker thread: it gets an engine of its own.
  static Engine& get();
  // Forks between the first process that used the engine and this one.
  static std::uint64_t fork_generation();

  transfer::SerialWorker& worker() { return worker_; }
  Counters& counters() { return counters_; }
  PathContext context(std::shared_ptr<pool::HostPool> pool, ParallelFor parallel_for);

  void set_batched_copy(BatchedCopy mode) { batched_.store(mode); }
  // "kernel", "runtime", or "kernel (the runtime has no batched copy)" once it said so.
  std::string batched_copy() const;

  // One of the engine's streams on `device`, created on first use.
  rt::StreamHandle stream(int device, tracing::CopyStream kind);

  // Lets go of `holding` once `completion` is done (now, or at a later poll).
  void release_after(const Completion& completion, std::shared_ptr<void> holding);
  std::size_t poll() { return releases_.poll(); }
  std::size_t pending() const { return releases_.pending(); }

  // Blocks until every task queued on the worker so far has run.
  void drain_worker();

 private:
  Engine() = default;

  transfer::SerialWorker worker_{"hipferry transfer worker"};
  Counters counters_;
  std::atomic<BatchedCopy> batched_{BatchedCopy::kKernel};
  std::atomic<bool> runtime_batch_works_{true};  // until the runtime says otherwise
  schedule::ReleaseList releases_;
  std::mutex streams_mutex_;                          // guards streams_; never held across a runtime call
  std::vector<std::unique_ptr<rt::Stream>> streams_;  // [device * 3 + CopyStream]
};

}  // namespace hipferry::engine
