// The transfer engine's ATen layer: checks a request, allocates the results,
// resolves tensors into raw copy items and hands them to a path
// (csrc/engine/transfer_paths.cpp); the Transfer handle owns the tensors and
// hands them to the engine's release list (csrc/engine/engine.h).
#include "csrc/torch/transfer_engine.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/COW.h>

#include <atomic>
#include <functional>
#include <string>
#include <utility>

#include "csrc/core/errors.h"
#include "csrc/torch/copy_cast_checks.h"
#include "csrc/torch/current_stream.h"
#include "csrc/torch/pinned_pool.h"
#include "hip/trace_session.h"
#include "csrc/engine/engine.h"
#include "csrc/engine/transfer_paths.h"

namespace hipferry {
namespace {

using engine::Completion;
using engine::Engine;

// What a handle hands the release list: its tensors, type-erased.
std::shared_ptr<void> holding_of(std::vector<at::Tensor> tensors) {
  if (tensors.empty()) return nullptr;
  return std::make_shared<std::vector<at::Tensor>>(std::move(tensors));
}

// The ATen layer's engine context: torch's thread pool.
engine::PathContext context_of(Engine& e, std::shared_ptr<pool::HostPool> pool) {
  return e.context(std::move(pool), [](std::int64_t n, std::int64_t grain,
                                       const std::function<void(std::int64_t, std::int64_t)>& body) {
    at::parallel_for(0, n, grain, body);
  });
}

// "torch.float16", as Python users spell it.
std::string dtype_name(at::ScalarType t) { return "torch." + std::string(c10::getDtypeNames(t).first); }

bool convertible(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// The device address of a host tensor's data when it is pinned and mapped.
void* mapped_address(const at::Tensor& t) {
  if (t.numel() == 0) return nullptr;
  // data(), not mutable_data(): asking must not materialize a copy-on-write storage.
  auto* base = static_cast<const char*>(t.storage().data());
  void* mapped = rt::host_device_pointer_or_null(const_cast<char*>(base));
  if (mapped == nullptr) return nullptr;
  return static_cast<char*>(mapped) + (static_cast<const char*>(t.const_data_ptr()) - base);
}

// A source the copy reads later (on the worker, or on a stream), held so that
// nothing the caller does to its own tensor frees the memory before the copy
// has read it (x.set_(), x.resize_(), x.untyped_storage().resize_(0), or
// dropping x): a tensor of the engine's own over the data.
//   * pageable host memory: a copy-on-write clone. The data and its owner
//     are shared until one side writes: a write by the caller then copies,
//     the copy reads what the source held at prefetch time, and a resize or
//     a free leaves the clone's data in place;
//   * other memory (pinned, device): an alias -- a TensorImpl of its own over
//     the same Storage, which stays alive whatever the caller's tensor then
//     points at (the pool's storages cannot be resized).
// A source made here (made contiguous, conjugate or negation resolved) is
// already the engine's own.
// Built directly (no dispatcher call: this runs for every source of every
// transfer, and a few microseconds matter at 4 KiB).
at::Tensor held_source(const at::Tensor& given, at::Tensor src) {
  if (!src.is_same(given) || !src.has_storage()) return src;
  c10::Storage storage = src.storage();
  if (src.is_cpu()) {
    c10::StorageImpl& impl = *storage.unsafeGetStorageImpl();
    if (c10::impl::cow::has_simple_data_ptr(impl) || c10::impl::cow::is_cow_data_ptr(impl.data_ptr())) {
      if (auto clone = c10::impl::cow::lazy_clone_storage(impl)) storage = c10::Storage(std::move(clone));
    }
  }
  auto held = c10::make_intrusive<c10::TensorImpl>(std::move(storage), src.key_set(), src.dtype());
  held->set_sizes_and_strides(src.sizes(), src.strides(), src.storage_offset());
  return at::Tensor(std::move(held));
}

engine::CopyItem item_of(const at::Tensor& src, const at::Tensor& dst) {
  engine::CopyItem it;
  it.src = src.const_data_ptr();
  it.dst = dst.data_ptr();
  it.elements = src.numel();
  it.src_element_bytes = src.element_size();
  it.dst_element_bytes = dst.element_size();
  it.convert = src.scalar_type() != dst.scalar_type();
  if (it.convert) {
    it.src_type = element_type_of(src);
    it.dst_type = element_type_of(dst);
  }
  return it;
}

}  // namespace

std::uint64_t fork_generation() { return Engine::fork_generation(); }

Transfer::~Transfer() {
  if (state_ != State::kPending) return;
  std::vector<at::Tensor> holdings = std::move(keepalive_);
  for (auto& t : results_) holdings.push_back(std::move(t));
  if (generation_ != fork_generation()) {  // a parent's transfer in a forked child: nothing ran here
    new std::vector<at::Tensor>(std::move(holdings));  // never touched again: no deleter runs in the child
    return;
  }
  try {
    if (outcome_ && outcome_->failed()) {
      sync_streams_quietly();
    } else {
      Engine::get().release_after(completion_, holding_of(std::move(holdings)));
    }
  } catch (...) {  // a destructor must not throw; keep the holdings (a leak, never a use after free)
    new std::vector<at::Tensor>(std::move(holdings));
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

void Transfer::settle_locked(std::vector<at::Tensor>& dropped) {
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
  std::vector<at::Tensor> dropped;
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

std::vector<at::Tensor> Transfer::wait() {
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
  std::vector<at::Tensor> results, holdings;
  std::string error;
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
        // work before reusing them (what t.record_stream(current) does).
        completion_.event->block_stream(alloc_stream_);
        for (const at::Tensor& t : results) record_on_current_stream(t, copy_device_);
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
  return results;
}

std::shared_ptr<Transfer> start_transfer(TransferRequest r) {
  Engine& engine = Engine::get();
  engine.poll();
  const bool prefetch = r.kind == TransferKind::kPrefetch;
  const char* api = prefetch ? "hipferry.prefetch" : "hipferry.offload";

  // --- arguments (nothing is allocated or queued until all are checked) ---
  c10::Device where = prefetch ? r.device : c10::Device(c10::kCPU);
  for (std::size_t i = 0; i < r.sources.size(); ++i) {
    const at::Tensor& t = r.sources[i];
    HF_CHECK_VALUE(t.defined(), api, ": tensors[", i, "] is an undefined tensor; expected a tensor");
    HF_CHECK_VALUE(t.layout() == at::kStrided, api, ": tensors[", i, "] has layout ", t.layout(),
                   "; expected strided (dense) tensors");
    HF_CHECK_VALUE(!t.is_quantized(), api, ": tensors[", i, "] is quantized (", dtype_name(t.scalar_type()),
                   "); expected a plain dtype (move t.int_repr() and the quantization parameters instead)");
    if (prefetch) {
      HF_CHECK_VALUE(t.is_cpu(), api, ": tensors[", i, "] is on ", t.device(),
                     "; expected host (CPU) tensors to move to ", r.device);
    } else {
      HF_CHECK_VALUE(t.is_cpu() || t.is_cuda(), api, ": tensors[", i, "] is on ", t.device(),
                     "; expected tensors on a GPU (or the CPU)");
      if (i == 0) where = t.device();
      HF_CHECK_VALUE(t.device() == where, api, ": tensors[", i, "] is on ", t.device(), " but tensors[0] is on ",
                     where, "; expected every tensor on one device");
    }
    if (r.dtype && *r.dtype != t.scalar_type()) {
      HF_CHECK_VALUE(convertible(t.scalar_type()) && convertible(*r.dtype), api, ": dtype ",
                     dtype_name(*r.dtype), " cannot be produced from tensors[", i, "] of dtype ",
                     dtype_name(t.scalar_type()),
                     "; expected conversions among float32, float16 and bfloat16 (or dtype=None)");
    }
  }
  HF_CHECK_VALUE(where.is_cpu() || where.is_cuda(), api, ": device ", where,
                 " is not supported; expected 'cpu' or a GPU ('cuda', 'cuda:N')");
  const bool gpu = where.is_cuda();
  int device = -1;
  if (gpu) {
    const int count = rt::device_count();
    HF_CHECK_VALUE(rt::build_info().platform != "cpu", api, ": device ", where,
                   " needs a GPU build of hipferry, but this one is CPU-only; expected device='cpu'");
    HF_CHECK_VALUE(count > 0, api, ": device ", where, " does not exist: hipferry sees no GPU here; expected "
                   "device='cpu'");
    device = where.has_index() ? where.index() : current_torch_device();
    HF_CHECK_VALUE(device >= 0 && device < count, api, ": device cuda:", device, " does not exist; hipferry sees ",
                   count, " GPU(s)");
    where = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device));
  }
  auto pool = pinned_pool(r.pool_id);
  HF_CHECK(!pool->closed(), api, ": the pool is closed; expected an open PinnedPool");

  auto handle = std::make_shared<Transfer>();
  handle->generation_ = fork_generation();
  handle->device_ = prefetch ? where : c10::Device(c10::kCPU);
  handle->results_count_ = r.sources.size();

  // --- results; sources made contiguous (on the current stream when on a GPU) ---
  std::vector<at::Tensor> sources, results;
  for (const at::Tensor& t : r.sources) {
    // Lazy conjugate / negative views are materialized: the copy moves bytes.
    at::Tensor src = t.resolve_conj().resolve_neg().contiguous();
    const at::ScalarType out_type = r.dtype.value_or(t.scalar_type());
    // Host results come from the pool: cached blocks, so a copy does not pay
    // for faulting in fresh pages (which costs more than the copy itself).
    at::Tensor dst = gpu && prefetch ? at::empty(t.sizes(), at::TensorOptions().dtype(out_type).device(where))
                                     : pool_empty(r.pool_id, t.sizes(), out_type,  // OutOfMemoryError: nothing queued
                                                  t.is_cpu() ? -1 : t.device().index());
    handle->nbytes_ += dst.nbytes();
    sources.push_back(std::move(src));
    results.push_back(std::move(dst));
  }
  // A small host copy runs before start_transfer returns (the path's own rule,
  // on the same destination bytes): its sources need no holding.
  const bool copied_now = !gpu && engine::host_copy_runs_inline(handle->nbytes_);
  if (!copied_now) {
    for (std::size_t i = 0; i < sources.size(); ++i) sources[i] = held_source(r.sources[i], std::move(sources[i]));
  }
  std::vector<engine::CopyItem> items;
  for (std::size_t i = 0; i < sources.size(); ++i) {
    if (sources[i].numel() == 0) continue;
    engine::CopyItem it = item_of(sources[i], results[i]);
    if (gpu && prefetch) it.src_mapped = mapped_address(sources[i]);
    if (gpu && !prefetch) {
      it.dst_mapped = mapped_address(results[i]);
      HF_CHECK_VALUE(!it.convert || it.dst_mapped != nullptr, api, ": dtype conversion on the way to the host ",
                     "writes pinned memory from a kernel, but the pool's memory is not mapped; expected a "
                     "PinnedPool(mapped=True) (the default) or dtype=None");
    }
    items.push_back(it);
  }

  engine::PathContext ctx = context_of(engine, pool);
  engine.counters().transfers += 1;
  engine.counters().bytes += handle->nbytes_;
  handle->outcome_ = std::make_shared<schedule::Outcome>();
  if (!gpu) {
    // Pinned sources may still be written by a device->host copy queued on the
    // current stream: the host copy waits for it (pageable memory cannot be).
    std::shared_ptr<rt::Event> produced;
    bool any_pinned = false;
    if (rt::device_count() > 0) {  // 0 on the CPU-only build
      for (const at::Tensor& t : sources) any_pinned = any_pinned || mapped_address(t) != nullptr;
    }
    if (any_pinned) {
      const int current = current_torch_device();
      rt::DeviceGuard guard(current);
      produced = std::make_shared<rt::Event>(current);
      produced->record(current_torch_stream(current));
    }
    handle->completion_.ticket = engine::run_on_host(ctx, std::move(items), handle->outcome_, produced);
  } else {
    rt::DeviceGuard guard(device);  // the producer may be the default stream (nullptr) of `device`
    engine::GpuStreams streams;
    streams.producer = current_torch_stream(device);
    streams.copy = engine.stream(device, prefetch ? tracing::CopyStream::kToDevice : tracing::CopyStream::kToHost);
    if (prefetch) streams.staging = engine.stream(device, tracing::CopyStream::kStaging);
    auto done = std::make_shared<rt::Event>(device);
    handle->copy_device_ = device;
    handle->copy_stream_ = streams.copy;
    handle->staging_stream_ = streams.staging;
    handle->alloc_stream_ = streams.producer;
    handle->completion_.event = done;
    try {
      if (prefetch) {
        std::vector<at::Tensor>& keep = handle->keepalive_;
        const auto scratch = [&keep, device](std::size_t bytes) -> void* {
          // On the current (producer) stream, before the copy's start event: the
          // copy is ordered after earlier uses of this memory.
          keep.push_back(at::empty({static_cast<std::int64_t>(bytes)},
                                   at::TensorOptions().dtype(at::kByte).device(c10::kCUDA, device)));
          return keep.back().data_ptr();
        };
        handle->completion_.ticket = engine::run_host_to_device(ctx, std::move(items), device, streams, done,
                                                                scratch, handle->outcome_);
      } else {
        engine::run_device_to_host(ctx, std::move(items), device, streams, std::move(done));
      }
    } catch (...) {
      // Something may have been queued: let go of the tensors only once the
      // streams are idle (they die with this frame), then rethrow as it came.
      handle->sync_streams_quietly();
      handle->completion_.ticket = 0;
      handle->state_ = Transfer::State::kFailed;
      throw;
    }
  }
  if (!copied_now) {
    for (auto& t : sources) handle->keepalive_.push_back(std::move(t));
  }
  handle->results_ = std::move(results);
  return handle;
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
