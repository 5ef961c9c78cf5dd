// How the transfer engine executes one transfer, per direction (see
// Note [hipferry transfer engine] in csrc/torch/transfer_engine.h). Torch-free:
// raw addresses only; the ATen layer resolves tensors into CopyItems, keeps
// them alive, and lends torch's thread pool and device allocator through
// PathContext. Pageable chunks go through a SlotRing of pool blocks (Note
// [copy scheduler]).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "csrc/core/element_type.h"
#include "csrc/core/host_pool/host_pool.h"
#include "csrc/core/schedule/outcome.h"
#include "csrc/core/transfer/serial_worker.h"
#include "hip/runtime.h"

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
// runtime's batched copy (one call, copy engines; byte copies only). The
// runtime's is CUDA's cudaMemcpyBatchAsync (12.8+); ROCm's hipMemcpyBatchAsync
// (7.1+) is not used: it was a loop of single copies and rejected attributes
// in 7.2 (ROCm/clr#273), so the kernel is the batched path there.
enum class BatchedCopy { kKernel, kRuntime };

// Runs body(begin, end) over [0, n) in pieces of at least `grain` on the
// host's thread pool (torch's: staging one thread copies ~10 GB/s, a host
// link carries 25-55 GB/s). Empty: one piece on the calling thread.
using ParallelFor = std::function<void(std::int64_t n, std::int64_t grain,
                                       const std::function<void(std::int64_t, std::int64_t)>& body)>;

struct PathContext {
  transfer::SerialWorker& worker;
  Counters& counters;
  std::shared_ptr<pool::HostPool> pool;  // staging blocks and job tables
  BatchedCopy batched = BatchedCopy::kKernel;
  std::atomic<bool>* runtime_batch_works = nullptr;  // cleared when the runtime says it has none
  ParallelFor parallel_for;                          // the host's thread pool (see ParallelFor)
};

// What a worker task reports: every waiter of a transfer sees the same error.
using TaskOutcome = schedule::Outcome;

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
// when it is involved). Device buffers the copy needs come from
// `allocate_scratch(bytes)` (device memory the caller keeps until
// completion, allocated in the producer stream's order). Errors before anything is queued
// throw; a throw after that leaves `done` unrecorded (synchronize the
// streams before letting go of anything); worker errors go to `outcome`.

// Host -> device.
std::uint64_t run_host_to_device(PathContext& ctx, std::vector<CopyItem> items, int device, const GpuStreams& streams,
                                 std::shared_ptr<rt::Event> done,
                                 const std::function<void*(std::size_t)>& allocate_scratch,
                                 std::shared_ptr<TaskOutcome> outcome);
// Device -> host (the destinations are host addresses, mapped where possible).
void run_device_to_host(PathContext& ctx, std::vector<CopyItem> items, int device, const GpuStreams& streams,
                        std::shared_ptr<rt::Event> done);
// Host -> host (CPU-only build, device "cpu"): one task on the worker, or,
// up to kInlineHostBytes in all, done on the calling thread at once (a
// hand-off to the worker and back costs tens of microseconds on an idle core,
// as much as copying this much; there is nothing worth overlapping).
constexpr std::size_t kInlineHostBytes = std::size_t{256} << 10;
// True when run_on_host copies `bytes` before it returns: the caller then
// need not hold the sources past the call.
constexpr bool host_copy_runs_inline(std::size_t bytes) { return bytes <= kInlineHostBytes; }
// `produced` (may be nullptr): an event on the producer stream the copy waits for first.
std::uint64_t run_on_host(PathContext& ctx, std::vector<CopyItem> items, std::shared_ptr<TaskOutcome> outcome,
                          std::shared_ptr<rt::Event> produced);

}  // namespace hipferry::engine
