// How the transfer engine executes one transfer, per direction (see
// Note [hipferry transfer engine] in transfer_engine.h). Raw addresses only:
// the engine resolves tensors into CopyItems and keeps them alive.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/element_type.h"
#include "host_pool/host_pool.h"
#include "runtime.h"
#include "transfer/serial_worker.h"

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
  std::atomic<std::uint64_t> transfers{0}, bytes{0}, packed_batches{0}, packed_tensors{0}, staged_chunks{0},
      direct_copies{0}, worker_tasks{0};
};

struct PathContext {
  transfer::SerialWorker& worker;
  Counters& counters;
  std::shared_ptr<pool::HostPool> pool;  // staging blocks and job tables
};

// Each function enqueues the copy and returns the worker ticket that ends it
// (0 when the worker is not involved). `done` is recorded on `stream` after
// all of the transfer's stream work (by the worker when it is involved).
// Device buffers the copy needs are appended to `scratch` (keep them alive
// until completion). Throws before enqueueing anything for bad input; a
// throw after partial enqueueing leaves `done` unrecorded (the caller records it).

// Host -> device on `stream` of `device`, which already waits for the producer.
std::uint64_t run_host_to_device(PathContext& ctx, std::vector<CopyItem> items, int device,
                                 rt::StreamHandle stream, std::shared_ptr<rt::Event> done,
                                 std::vector<at::Tensor>& scratch);
// Device -> host on `stream` of `device`, which already waits for the producer.
void run_device_to_host(PathContext& ctx, std::vector<CopyItem> items, int device, rt::StreamHandle stream,
                        std::shared_ptr<rt::Event> done);
// Host -> host (CPU-only build, device "cpu"): one task on the worker, or,
// up to kInlineHostBytes in all, done on the calling thread at once (a
// hand-off to the worker and back costs tens of microseconds on an idle core,
// as much as copying this much; there is nothing worth overlapping).
constexpr std::size_t kInlineHostBytes = std::size_t{256} << 10;
std::uint64_t run_on_worker(PathContext& ctx, std::vector<CopyItem> items);

}  // namespace hipferry::engine
