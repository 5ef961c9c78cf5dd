// How the transfer engine executes one transfer, per direction (see
// Note [hipferry transfer engine] in transfer_engine.h). Raw addresses only:
// the engine resolves tensors into CopyItems and keeps them alive.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "csrc/core/element_type.h"
#include "csrc/core/host_pool/host_pool.h"
#include "hip/runtime.h"
#include "csrc/core/transfer/serial_worker.h"

namespace hipferry::engine {

// One contiguous tensor to move.
struct CopyItem {
  const void* src = nullptr;         // element 0 of the source (host or device address)
  void* dst = nullptr;               // element 0 of the destination
  const void* src_mapped = nullptr;  // device address of a pinned host source, else nullptr
  void* dst_mapped = nullptr;        // device address of a pinned host destination, else nullptr
  std::int64_t elements = 0;
  std::size_t src_element_bytes = 0;
  std::size_t dst_element_bytes = 0;
  bool convert = false;  // src_type -> dst_type; else a byte copy
  ElementType src_type = ElementType::kFloat32;
  ElementType dst_type = ElementType::kFloat32;
  std::size_t dst_bytes() const { return static_cast<std::size_t>(elements) * dst_element_bytes; }
};

struct Counters {
  std::atomic<std::uint64_t> transfers{0}, bytes{0}, packed_batches{0}, packed_tensors{0}, runtime_batches{0},
      staged_chunks{0}, direct_copies{0}, worker_tasks{0};
};

// How a batch of small pinned tensors moves: hipferry's batched kernel (one
// launch, gathering/scattering through mapped memory; converts too), or the
// runtime's batched copy (one call, copy engines; byte copies only).
enum class BatchedCopy { kKernel, kRuntime };

struct PathContext {
  transfer::SerialWorker& worker;
  Counters& counters;
  std::shared_ptr<pool::HostPool> pool;  // staging blocks and job tables
  BatchedCopy batched = BatchedCopy::kKernel;
  std::atomic<bool>* runtime_batch_works = nullptr;  // cleared when the runtime says it has none
};

// What a worker task reports. Tasks never throw into the worker: every waiter
// of a transfer must see the same error (SerialWorker::wait hands a task's
// exception to its first waiter only).
class TaskOutcome {
 public:
  void fail(const std::string& why);  // keeps the first error
  bool failed() const;
  std::string error() const;

 private:
  mutable std::mutex mutex_;  // guards the two below
  bool failed_ = false;
  std::string error_;
};

// The streams of one GPU transfer.
struct GpuStreams {
  rt::StreamHandle producer = nullptr;  // the caller's current stream (nullptr: its default stream)
  rt::StreamHandle copy = nullptr;      // hipferry's stream of this direction
  rt::StreamHandle staging = nullptr;   // worker-only host->device stream (pageable sources)
};

// Each function first records an event on the producer stream and makes the
// copy stream (and, from the worker, the staging stream) wait for it, so the
// copy is ordered after the work that produced the sources. It returns the
// worker ticket that ends the transfer (0 when the worker is not involved);
// `done` is recorded after all of the transfer's stream work (by the worker
// when it is involved). Device buffers the copy needs are appended to
// `scratch` (keep them until completion). Errors before anything is queued
// throw; a throw after that leaves `done` unrecorded (synchronize the
// streams before letting go of anything); worker errors go to `outcome`.

// Host -> device.
std::uint64_t run_host_to_device(PathContext& ctx, std::vector<CopyItem> items, int device, const GpuStreams& streams,
                                 std::shared_ptr<rt::Event> done, std::vector<at::Tensor>& scratch,
                                 std::shared_ptr<TaskOutcome> outcome);
// Device -> host (the destinations are host addresses, mapped where possible).
void run_device_to_host(PathContext& ctx, std::vector<CopyItem> items, int device, const GpuStreams& streams,
                        std::shared_ptr<rt::Event> done);
// Host -> host (CPU-only build, device "cpu"): one task on the worker, or,
// up to kInlineHostBytes in all, done on the calling thread at once (a
// hand-off to the worker and back costs tens of microseconds on an idle core,
// as much as copying this much; there is nothing worth overlapping).
constexpr std::size_t kInlineHostBytes = std::size_t{256} << 10;
// `produced` (may be nullptr): an event on the producer stream the copy waits for first.
std::uint64_t run_on_host(PathContext& ctx, std::vector<CopyItem> items, std::shared_ptr<TaskOutcome> outcome,
                          std::shared_ptr<rt::Event> produced);

}  // namespace hipferry::engine
