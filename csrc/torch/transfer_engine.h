// The transfer engine: asynchronous host<->device copies of many tensors,
// behind the `Transfer` handle that hipferry.prefetch / hipferry.offload return.
//
// Note [hipferry transfer engine]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Where the work runs:
//   * per GPU, a host->device and a device->host copy stream (both directions
//     overlap compute and each other), and a staging stream that only the
//     worker uses (so its copies never queue behind later transfers' waits).
//     Every transfer's streams first wait for an event recorded on the
//     caller's current stream: the copy is ordered after the work that
//     produced the sources (and after earlier uses of the memory it writes,
//     which is allocated before that event);
//   * one serial worker thread for host-side work: packing pageable tensors
//     into pinned staging blocks and staging large pageable tensors through a
//     small ring of pool blocks (the caller never waits for a host memcpy), and
//     host->host copies (device "cpu", the CPU-only build) above 256 KiB;
//     smaller ones are done on the calling thread at once.
// What runs where (see transfer_paths.cpp):
//   host->device  small pinned tensors: one gather/scatter kernel reading mapped memory
//                 (or the runtime's batched copy, when configured and available);
//                 small pageable: worker packs into one pool block, one copy, one scatter kernel;
//                 large pinned: one async copy (or one copy_cast kernel when converting);
//                 large pageable: worker stages chunks through a ring of pool blocks.
//   device->host  small: one kernel writing every destination's mapped address;
//                 large: one async copy (or one copy_cast kernel) per tensor.
// Invariants (design principle 4, stream-ordered lifetimes, no record_stream
// for our own memory):
//   * a transfer is complete when its worker ticket has run AND its completion
//     event has passed; the event is recorded after all of its stream work,
//     by the worker when the worker is involved (also after a failure);
//   * sources, device scratch and (until .wait()) results are held by the
//     handle; a handle dropped or waited on hands what it holds to the engine's
//     release list, which lets go of it only once the completion is observed
//     by the host -- never guessed from stream order; after a failure the
//     streams are synchronized first; when the runtime cannot answer, the
//     holdings are kept (a leak, never a use after free);
//   * pool blocks used by a copy go back through HostPool::record_use, so the
//     pool reuses them only after the copy;
//   * device results are torch's memory, not ours: when wait() hands them to
//     another stream than the one they were allocated on, it says so and the
//     Python wrapper records them on the consumer's stream (t.record_stream(
//     torch.cuda.current_stream(t.device)), python/hipferry/transfer.py) --
//     the only record_stream, and never on memory we allocated;
//   * the worker never owns a Tensor (dropping one may need the GIL that a
//     waiting caller holds); it sees raw pointers that the handle keeps
//     valid, and reports errors through an Outcome every waiter reads;
//   * no lock is held across a runtime call, a worker wait, or while tensors
//     die; the Python bindings release the GIL around every call that may
//     block or let go of tensors (tensors cross into and out of Python with
//     the GIL held, before and after).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "csrc/core/schedule/outcome.h"
#include "csrc/core/transfer/serial_worker.h"
#include "csrc/engine/engine.h"
#include "csrc/torch/stable.h"
#include "hip/runtime.h"

namespace hipferry {

enum class TransferKind { kPrefetch, kOffload };

struct TransferRequest {
  TransferKind kind = TransferKind::kPrefetch;
  std::vector<Tensor> sources;
  Device device{DeviceType::CPU};   // prefetch: the destination; offload: ignored
  std::optional<ScalarType> dtype;  // nullopt: keep each source's dtype
  std::int64_t pool_id = 0;         // staging blocks and offload destinations
  // Whether a source may carry torch's negative bit (torch._neg_view): the
  // stable ABI cannot read the bit, and resolving it costs a dispatcher call
  // per source, so a caller that knows no source has it says false.
  bool may_have_negative_views = true;
  // What errors call source i, e.g. "tensors['w'][1]" (the caller's structure);
  // empty: "tensors[i]". Called only while start_transfer runs, on a failed check.
  std::function<std::string(std::size_t)> source_name;
};

using engine::Completion;  // when a transfer's work is done (csrc/engine/engine.h)

class Transfer {
 public:
  Transfer() = default;
  ~Transfer();
  Transfer(const Transfer&) = delete;
  Transfer& operator=(const Transfer&) = delete;

  // All three may be called from several threads at once; none holds the
  // handle's lock while it blocks or while tensors die (a dying tensor may
  // need the GIL, which the Python bindings release around these calls).
  // True once the copy has finished (or failed; wait() then says why). Never blocks.
  bool ready();
  // Blocks the calling thread until the copy has finished; throws its error.
  void synchronize();
  struct Waited {
    std::vector<Tensor> results;
    // Device results allocated on another stream than the caller's current
    // one: the caller must record each on its current stream
    // (t.record_stream(torch.cuda.current_stream(t.device))) before using
    // them, so that torch's allocator reuses their memory only after that
    // stream's work (the stable ABI has no record_stream).
    bool record_on_current_stream = false;
  };
  // Hands the results over, once. Device results: the caller's current stream
  // waits for the copy (the host waits only for the worker's staging of
  // pageable sources). Host results: the host waits.
  Waited wait();

  Device device() const { return device_; }
  std::size_t nbytes() const { return nbytes_; }
  std::size_t num_tensors() const { return results_count_; }

 private:
  friend std::shared_ptr<Transfer> start_transfer(struct TransferRequest request);
  enum class State { kPending, kWaited, kFailed };
  // After the worker part: marks the transfer failed if the worker said so,
  // moving what it held into `dropped` (the caller lets go of it unlocked).
  void settle_locked(std::vector<Tensor>& dropped);
  void sync_streams_quietly() const;                // after a failure, before letting go of anything
  void check_same_process(const char* what) const;  // throws in a forked child
  // start_transfer's last stage on a GPU: queues `items` on the copy stream of
  // `device` (prefetch: host->device, else device->host) and records the
  // completion event; after a failure, the streams idle and the handle failed.
  void dispatch_on_gpu(engine::PathContext& ctx, std::vector<engine::CopyItem> items, int device, bool prefetch);

  // Set by start_transfer, then read-only:
  std::uint64_t generation_ = 0;  // fork_generation() when started
  Completion completion_;
  std::shared_ptr<schedule::Outcome> outcome_;  // the worker part's error, if any
  int copy_device_ = -1;                        // GPU of the copy, -1 for the host path
  rt::StreamHandle copy_stream_ = nullptr;      // hipferry's stream of this direction
  rt::StreamHandle staging_stream_ = nullptr;   // the worker's stream (prefetch)
  rt::StreamHandle alloc_stream_ = nullptr;     // where device results were allocated
  Device device_{DeviceType::CPU};
  std::size_t nbytes_ = 0;
  std::size_t results_count_ = 0;

  std::mutex mutex_;  // guards the fields below
  State state_ = State::kPending;
  std::string error_;  // why it failed
  std::vector<Tensor> results_;
  std::vector<Tensor> keepalive_;  // sources and scratch, until complete
};

std::shared_ptr<Transfer> start_transfer(TransferRequest request);

// Counts the forks between the first process that used the engine and this
// one: a forked child gets an engine of its own, and the parent's transfers
// (which did not run in the child) refuse to be used there.
std::uint64_t fork_generation();

struct TransferStats {
  std::uint64_t transfers = 0;
  std::uint64_t bytes = 0;           // destination bytes written
  std::uint64_t packed_batches = 0;  // gather/scatter launches and packed staging copies
  std::uint64_t packed_tensors = 0;
  std::uint64_t runtime_batches = 0;  // of packed_batches: the runtime's batched copy
  std::uint64_t staged_chunks = 0;    // pageable chunks through pinned blocks
  std::uint64_t direct_copies = 0;    // one copy or copy_cast kernel per tensor
  std::uint64_t worker_tasks = 0;
  std::size_t pending_releases = 0;  // holdings waiting for their completion
};
TransferStats transfer_stats();

// Lets go of released holdings whose transfers have completed; returns how many.
std::size_t poll_transfer_releases();

// How batches of small pinned tensors move: "kernel" (hipferry's batched
// kernel, the default) or "runtime" (the runtime's batched copy where it has
// one, else the kernel). "" changes nothing. Returns the setting in effect.
std::string set_batched_copy(const std::string& mode);

// Blocks until every task queued on the transfer worker so far has run (a
// trace ends with the host copies it saw start).
void drain_transfer_worker();

// The engine's worker thread (the test hooks queue work on it: csrc/testing).
transfer::SerialWorker& transfer_worker();

}  // namespace hipferry
