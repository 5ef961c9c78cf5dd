// The transfer engine's execution paths (see transfer_paths.h).
#include "csrc/engine/transfer_paths.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "csrc/core/copy_cast_cpu.h"
#include "csrc/core/schedule/host_streams.h"
#include "csrc/core/schedule/slot_ring.h"
#include "csrc/core/transfer/transfer_plan.h"
#include "hip/batched_copy_kernel.h"
#include "hip/copy_cast_kernel.h"
#include "hip/gpu_stream.h"
#include "hip/trace_session.h"

namespace hipferry::engine {
namespace {

using transfer::Chunk;
using transfer::PackedBatch;
using transfer::TransferItem;

constexpr std::size_t kAlign = 256;
constexpr std::size_t kStagingRing = 3;  // pageable chunks in flight per transfer

std::size_t round_up(std::size_t n, std::size_t m) { return (n + m - 1) / m * m; }

// Host side of one item's elements [first, first + n) into `out` (dst dtype).
void host_copy(const CopyItem& it, std::int64_t first, std::int64_t n, void* out) {
  const char* src = static_cast<const char*>(it.src) + first * static_cast<std::int64_t>(it.src_element_bytes);
  if (it.convert) {
    copy_cast_cpu(src, it.src_type, out, it.dst_type, 0, n);
  } else {
    std::memcpy(out, src, static_cast<std::size_t>(n) * it.src_element_bytes);
  }
}

// The same on the host's thread pool, for staging pageable memory towards a
// GPU. (The CPU path stays on one thread: there the caller's compute needs the cores.)
constexpr std::int64_t kParallelGrainBytes = std::int64_t{1} << 20;
void host_copy_parallel(const PathContext& ctx, const CopyItem& it, std::int64_t first, std::int64_t n, void* out) {
  const auto grain = std::max<std::int64_t>(1, kParallelGrainBytes / static_cast<std::int64_t>(it.src_element_bytes));
  const auto piece = [&](std::int64_t begin, std::int64_t end) {
    host_copy(it, first + begin, end - begin, static_cast<char*>(out) + begin * it.dst_element_bytes);
  };
  if (ctx.parallel_for) {
    ctx.parallel_for(n, grain, piece);
  } else {
    piece(0, n);
  }
}

// The trace track of hipferry's copy stream in one direction.
std::string copy_track(int device, bool to_device) {
  return tracing::stream_track(device, to_device ? tracing::CopyStream::kToDevice : tracing::CopyStream::kToHost);
}

char* byte_offset(void* p, std::size_t bytes) { return static_cast<char*>(p) + bytes; }

// A pool block released after `stream` has passed the work enqueued so far.
// If even the event cannot be recorded, the block stays allocated: a leaked
// block is better than one reused while a copy may still read it.
void release_after_stream(pool::HostPool& pool, void* host, int device, rt::StreamHandle stream) {
  try {
    pool.record_use(host, pool::StreamUse{device, stream});
  } catch (...) {
    return;
  }
  pool.deallocate(host);
}

// Plans the items by the bytes that cross the link: destination elements
// when the host converted them already (`wire_is_dst`), else source elements.
transfer::TransferPlan plan_items(const std::vector<CopyItem>& items, bool wire_is_dst) {
  std::vector<TransferItem> planned;
  planned.reserve(items.size());
  for (const CopyItem& it : items) {
    const std::size_t wire = wire_is_dst ? it.dst_element_bytes : it.src_element_bytes;
    planned.push_back({static_cast<std::size_t>(it.elements), wire, wire});
  }
  return transfer::plan_transfer(planned);
}

// One kernel for many jobs; the job table lives in a mapped pool block that
// goes back once the stream has passed the kernel. Returns false, having
// enqueued nothing, when the pool's memory is not mapped (no table possible).
bool launch_jobs(PathContext& ctx, const std::vector<gpu::CopyJobSpec>& jobs, int device, rt::StreamHandle stream,
                 const std::string& track, std::size_t bytes) {
  if (jobs.empty()) return true;
  const pool::HostPool::Allocation table = ctx.pool->allocate(gpu::batched_copy_table_bytes(jobs.size()), device);
  if (table.device == nullptr) {
    ctx.pool->deallocate(table.host);
    return false;
  }
  tracing::StreamSpan span(device, stream, track, "batched copy (" + std::to_string(jobs.size()) + " tensors)",
                           "kernel", bytes);
  try {
    gpu::launch_batched_copy(jobs.data(), jobs.size(), table.host, table.device, stream, device);
  } catch (...) {
    release_after_stream(*ctx.pool, table.host, device, stream);
    throw;
  }
  span.end();
  release_after_stream(*ctx.pool, table.host, device, stream);
  ctx.counters.packed_batches += 1;
  ctx.counters.packed_tensors += jobs.size();
  return true;
}

gpu::CopyJobSpec job_of(const CopyItem& it, const void* src, void* dst) {
  gpu::CopyJobSpec j;
  j.src = src;
  j.dst = dst;
  j.convert = it.convert;
  j.src_type = it.src_type;
  j.dst_type = it.dst_type;
  j.count = it.convert ? it.elements : static_cast<std::int64_t>(it.dst_bytes());
  return j;
}

// Host -> device of pageable items, on the worker: small ones packed into one
// pool block (converted on the host while packing), one copy into device
// scratch, one scatter kernel; large ones through a ring of pool blocks.
struct StagedJob {
  std::vector<CopyItem> items;
  transfer::TransferPlan plan;
  std::vector<std::size_t> scratch_offsets;  // per batch, into scratch
  void* scratch = nullptr;
};

void stage_batches(PathContext& ctx, const StagedJob& job, int device, rt::StreamHandle stream) {
  for (std::size_t b = 0; b < job.plan.batches.size(); ++b) {
    const PackedBatch& batch = job.plan.batches[b];
    const std::size_t table_offset = round_up(batch.staging_bytes, kAlign);
    const pool::HostPool::Allocation block =
        ctx.pool->allocate(table_offset + gpu::batched_copy_table_bytes(batch.slots.size()), device);
    try {
      const std::int64_t t0 = tracing::now_ns();
      const auto pack = [&](std::int64_t lo, std::int64_t hi) {
        for (std::int64_t k = lo; k < hi; ++k) {
          const transfer::PackedSlot& s = batch.slots[k];
          const CopyItem& it = job.items[s.item];
          host_copy(it, 0, it.elements, byte_offset(block.host, s.staging_offset));
        }
      };
      const auto count = static_cast<std::int64_t>(batch.slots.size());
      if (ctx.parallel_for) {
        ctx.parallel_for(count, 16, pack);
      } else {
        pack(0, count);
      }
      tracing::add_host_span("pack " + std::to_string(batch.slots.size()) + " tensors", "pack", tracing::worker_track(),
                             t0, tracing::now_ns(), batch.staging_bytes);
      char* scratch = byte_offset(job.scratch, job.scratch_offsets[b]);
      const std::string track = tracing::stream_track(device, tracing::CopyStream::kStaging);
      tracing::StreamSpan copy(device, stream, track, "packed copy", "copy", batch.staging_bytes);
      rt::memcpy_async(scratch, block.host, batch.staging_bytes, stream);
      copy.end();
      std::vector<gpu::CopyJobSpec> jobs;
      for (const transfer::PackedSlot& s : batch.slots) {
        CopyItem plain = job.items[s.item];
        plain.convert = false;  // converted while packing
        jobs.push_back(job_of(plain, scratch + s.staging_offset, plain.dst));
      }
      tracing::StreamSpan scatter(device, stream, track, "scatter " + std::to_string(jobs.size()) + " tensors",
                                  "kernel", batch.staging_bytes);
      if (block.device != nullptr) {
        gpu::launch_batched_copy(jobs.data(), jobs.size(), byte_offset(block.host, table_offset),
                                 byte_offset(block.device, table_offset), stream, device);
      } else {
        for (const auto& j : jobs) rt::memcpy_async(j.dst, j.src, static_cast<std::size_t>(j.count), stream);
      }
      scatter.end();
    } catch (...) {
      release_after_stream(*ctx.pool, block.host, device, stream);
      throw;
    }
    release_after_stream(*ctx.pool, block.host, device, stream);
    ctx.counters.packed_batches += 1;
    ctx.counters.packed_tensors += batch.slots.size();
  }
}

// Large pageable items, chunk by chunk through a ring of pool blocks (a
// SlotRing): the worker packs a chunk into a block (the ring's first stage,
// on the host), the staging stream copies it to the device (the last stage);
// a block is packed again only once its previous copy has left it.
void stage_chunks(PathContext& ctx, const StagedJob& job, int device, rt::StreamHandle stream) {
  if (job.plan.chunks.empty()) return;
  std::size_t slot_bytes = 0;
  for (const Chunk& c : job.plan.chunks) {
    slot_bytes = std::max(slot_bytes, c.elements * job.items[c.item].dst_element_bytes);
  }
  const std::size_t slots = std::min(kStagingRing, job.plan.chunks.size());
  schedule::SlotRing ring(slots);
  schedule::ImmediateStream host(tracing::worker_track(), tracing::host_spans());
  gpu::GpuStream staging(device, stream, tracing::stream_track(device, tracing::CopyStream::kStaging));
  std::vector<pool::HostPool::Allocation> blocks;
  try {
    for (const Chunk& c : job.plan.chunks) {
      const std::size_t k = ring.next_slot();
      if (k == blocks.size()) blocks.push_back(ctx.pool->allocate(slot_bytes, device));
      const CopyItem& it = job.items[c.item];
      const std::size_t bytes = c.elements * it.dst_element_bytes;
      void* block = blocks[k].host;
      ring.acquire(k, host);  // its previous chunk has left the block
      schedule::Work pack;
      pack.label = schedule::Label{"stage chunk", "pack", bytes};
      pack.on_host = [&ctx, &it, &c, block] {
        host_copy_parallel(ctx, it, static_cast<std::int64_t>(c.first_element), static_cast<std::int64_t>(c.elements),
                           block);
      };
      host.enqueue(std::move(pack));
      ring.pass(k, host, staging);
      staging.copy(byte_offset(it.dst, c.first_element * it.dst_element_bytes), block, bytes,
                   schedule::Label{"staged copy", "copy", bytes});
      ring.release(k, staging);
      ctx.counters.staged_chunks += 1;
    }
  } catch (...) {
    for (auto& b : blocks) release_after_stream(*ctx.pool, b.host, device, stream);
    throw;
  }
  for (auto& b : blocks) release_after_stream(*ctx.pool, b.host, device, stream);
}

// One copy (or one copy_cast kernel) for a whole large item.
void direct_copy(PathContext& ctx, const CopyItem& it, int device, rt::StreamHandle stream, bool to_device) {
  tracing::StreamSpan span(device, stream, copy_track(device, to_device), it.convert ? "copy_cast" : "copy",
                           it.convert ? "kernel" : "copy", it.dst_bytes());
  if (it.convert) {
    const void* src = to_device ? it.src_mapped : it.src;
    void* dst = to_device ? it.dst : it.dst_mapped;
    gpu::launch_copy_cast(src, it.src_type, dst, it.dst_type, it.elements, stream, device);
  } else {
    rt::memcpy_async(it.dst, it.src, it.dst_bytes(), stream);
  }
  span.end();
  ctx.counters.direct_copies += 1;
}

// One runtime call for a batch of byte copies. False (nothing queued) when a
// tensor converts or the runtime has no batched copy (remembered).
bool runtime_batch(PathContext& ctx, const std::vector<CopyItem>& items, const PackedBatch& batch, int device,
                   rt::StreamHandle stream, bool to_device) {
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<std::size_t> sizes;
  for (const transfer::PackedSlot& s : batch.slots) {
    const CopyItem& it = items[s.item];
    if (it.convert) return false;
    dsts.push_back(it.dst);
    srcs.push_back(it.src);
    sizes.push_back(it.dst_bytes());
  }
  tracing::StreamSpan span(device, stream, copy_track(device, to_device),
                           "runtime batched copy (" + std::to_string(dsts.size()) + " tensors)", "copy",
                           batch.staging_bytes);
  if (!rt::memcpy_batch_async(dsts.data(), srcs.data(), sizes.data(), dsts.size(), stream)) {
    ctx.runtime_batch_works->store(false);
    return false;
  }
  span.end();
  ctx.counters.runtime_batches += 1;
  ctx.counters.packed_tensors += dsts.size();
  return true;
}

// Items whose host side is mapped: small ones by batched kernels (a gather
// or scatter over mapped memory), large ones by one copy each.
void run_direct(PathContext& ctx, const std::vector<CopyItem>& items, int device, rt::StreamHandle stream,
                bool to_device) {
  const transfer::TransferPlan plan = plan_items(items, /*wire_is_dst=*/!to_device);
  for (const PackedBatch& batch : plan.batches) {
    bool all_mapped = true;  // a host side without a device address cannot be reached by a kernel
    for (const transfer::PackedSlot& s : batch.slots) {
      all_mapped = all_mapped && (to_device ? items[s.item].src_mapped : items[s.item].dst_mapped) != nullptr;
    }
    if (!all_mapped || batch.slots.size() == 1) {  // one tensor: a copy needs no job table
      for (const transfer::PackedSlot& s : batch.slots) direct_copy(ctx, items[s.item], device, stream, to_device);
      continue;
    }
    if (ctx.batched == BatchedCopy::kRuntime && ctx.runtime_batch_works->load() &&
        runtime_batch(ctx, items, batch, device, stream, to_device)) {
      continue;
    }
    std::vector<gpu::CopyJobSpec> jobs;
    for (const transfer::PackedSlot& s : batch.slots) {
      const CopyItem& it = items[s.item];
      jobs.push_back(job_of(it, to_device ? it.src_mapped : it.src, to_device ? it.dst : it.dst_mapped));
    }
    const auto track = copy_track(device, to_device);
    if (!launch_jobs(ctx, jobs, device, stream, track, batch.staging_bytes)) {
      for (const transfer::PackedSlot& s : batch.slots) direct_copy(ctx, items[s.item], device, stream, to_device);
    }
  }
  const CopyItem* last = nullptr;
  for (const Chunk& c : plan.chunks) {  // whole items: the copy engine splits them itself
    if (last == &items[c.item]) continue;
    last = &items[c.item];
    direct_copy(ctx, *last, device, stream, to_device);
  }
}

// The copy stream (or, from the worker, the staging stream) waits for the
// producer's work up to `start`.
std::shared_ptr<rt::Event> record_start(int device, const GpuStreams& streams) {
  auto start = std::make_shared<rt::Event>(device);
  start->record(streams.producer);
  start->block_stream(streams.copy);
  return start;
}

}  // namespace

std::uint64_t run_host_to_device(PathContext& ctx, std::vector<CopyItem> items, int device, const GpuStreams& streams,
                                 std::shared_ptr<rt::Event> done,
                                 const std::function<void*(std::size_t)>& allocate_scratch,
                                 std::shared_ptr<TaskOutcome> outcome) {
  rt::DeviceGuard guard(device);
  std::vector<CopyItem> pinned;
  auto job = std::make_shared<StagedJob>();
  for (CopyItem& it : items) (it.src_mapped != nullptr ? pinned : job->items).push_back(it);
  // Scratch first: everything the copy writes exists before `start`, so the
  // copy is ordered after any earlier use of that memory on the producer stream.
  if (!job->items.empty()) {
    job->plan = plan_items(job->items, /*wire_is_dst=*/true);
    std::size_t scratch_bytes = 0;
    for (const PackedBatch& b : job->plan.batches) {
      job->scratch_offsets.push_back(scratch_bytes);
      scratch_bytes = round_up(scratch_bytes + b.staging_bytes, kAlign);
    }
    if (scratch_bytes > 0) job->scratch = allocate_scratch(scratch_bytes);
  }
  auto start = record_start(device, streams);
  run_direct(ctx, pinned, device, streams.copy, /*to_device=*/true);
  if (job->items.empty()) {
    done->record(streams.copy);
    return 0;
  }
  // The worker stages on a stream of its own, so its copies never queue
  // behind the producer waits of transfers started after this one.
  auto direct_done = std::make_shared<rt::Event>(device);
  direct_done->record(streams.copy);
  ctx.counters.worker_tasks += 1;
  PathContext worker_ctx = ctx;
  const rt::StreamHandle staging = streams.staging;
  return ctx.worker.submit([worker_ctx, job, device, staging, start, direct_done, done, outcome]() mutable {
    outcome->run("staging pageable tensors", [&] {
      rt::DeviceGuard worker_guard(device);
      start->block_stream(staging);
      stage_batches(worker_ctx, *job, device, staging);
      stage_chunks(worker_ctx, *job, device, staging);
    });
    outcome->run("recording the completion", [&] {  // also after a failure: it covers what was queued
      rt::DeviceGuard worker_guard(device);
      direct_done->block_stream(staging);
      done->record(staging);
    });
  });
}

void run_device_to_host(PathContext& ctx, std::vector<CopyItem> items, int device, const GpuStreams& streams,
                        std::shared_ptr<rt::Event> done) {
  rt::DeviceGuard guard(device);
  record_start(device, streams);
  run_direct(ctx, items, device, streams.copy, /*to_device=*/false);
  done->record(streams.copy);
}

namespace {

void copy_on_host(const std::vector<CopyItem>& items, const char* track) {
  const std::int64_t t0 = tracing::now_ns();
  std::size_t bytes = 0;
  for (const CopyItem& it : items) {
    host_copy(it, 0, it.elements, it.dst);
    bytes += it.dst_bytes();
  }
  tracing::add_host_span("copy " + std::to_string(items.size()) + " tensors", "copy", track, t0, tracing::now_ns(),
                         bytes);
}

}  // namespace

std::uint64_t run_on_host(PathContext& ctx, std::vector<CopyItem> items, std::shared_ptr<TaskOutcome> outcome,
                          std::shared_ptr<rt::Event> produced) {
  std::size_t bytes = 0;
  for (const CopyItem& it : items) bytes += it.dst_bytes();
  ctx.counters.direct_copies += items.size();
  if (host_copy_runs_inline(bytes)) {  // cheaper than waking the worker and being woken back
    if (produced) produced->synchronize();
    copy_on_host(items, "caller thread");
    return 0;
  }
  ctx.counters.worker_tasks += 1;
  return ctx.worker.submit([items = std::move(items), outcome, produced] {
    outcome->run("copying on the worker", [&] {
      if (produced) produced->synchronize();
      copy_on_host(items, tracing::worker_track());
    });
  });
}

}  // namespace hipferry::engine
