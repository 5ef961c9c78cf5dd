// Starting a transfer, in stages: check the request (transfer_checks.cpp), make the results, hold
// the sources, build the raw copy items, and hand them to a path
// (csrc/engine/transfer_paths.cpp). The handle is in transfer_engine.cpp.
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "csrc/core/errors.h"
#include "csrc/engine/engine.h"
#include "csrc/engine/transfer_paths.h"
#include "csrc/torch/copy_cast_checks.h"
#include "csrc/torch/current_stream.h"
#include "csrc/torch/pinned_pool.h"
#include "csrc/torch/stable.h"
#include "csrc/torch/transfer_checks.h"
#include "csrc/torch/transfer_engine.h"
#include "hip/trace_session.h"

namespace hipferry {
namespace {

using engine::Engine;

// The torch layer's engine context: torch's thread pool.
engine::PathContext context_of(Engine& e, std::shared_ptr<pool::HostPool> pool) {
  return e.context(std::move(pool),
                   [](std::int64_t n, std::int64_t grain, const std::function<void(std::int64_t, std::int64_t)>& body) {
                     torch::stable::parallel_for(0, n, grain, body);
                   });
}

// Grad mode off on this thread while sources are prepared: the engine's
// tensors are data only (a view, copy or clone made here records no autograd
// graph, as the directly built tensors of the ATen version did not).
class NoGradScope {
 public:
  NoGradScope() : was_(aoti_torch_grad_mode_is_enabled()) {
    if (was_) aoti_torch_grad_mode_set_enabled(false);
  }
  ~NoGradScope() {
    if (was_) aoti_torch_grad_mode_set_enabled(true);
  }
  NoGradScope(const NoGradScope&) = delete;
  NoGradScope& operator=(const NoGradScope&) = delete;

 private:
  bool was_;
};

// The device address of a host tensor's data when it is pinned and mapped.
void* mapped_address(const Tensor& t) {
  if (t.numel() == 0) return nullptr;
  const char* data = static_cast<const char*>(t.const_data_ptr());
  char* base = storage_start(t);  // the runtime maps whole allocations
  void* mapped = rt::host_device_pointer_or_null(base);
  if (mapped == nullptr) return nullptr;
  return static_cast<char*>(mapped) + (data - base);
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
//     points at (the pool's storages cannot be resized). aten::detach makes
//     it: unlike aten::alias (an autograd view), it keeps no reference to the
//     caller's tensor (whose Python object would then live as long).
// A storage that cannot be cloned lazily (memory with a deleter of its own:
// torch.from_numpy, a file mapping) is aliased, as pinned memory is.
// A source made here (made contiguous, conjugate or negation resolved) is
// already the engine's own: its data is not the given tensor's (the stable
// ABI shows no TensorImpl to compare, the data pointer tells). Called with
// grad mode off (NoGradScope): aten::_lazy_clone records no graph.
// `pinned`: host memory that is page-locked and mapped.
Tensor held_source(const Tensor& given, Tensor src, bool pinned) {
  if (src.numel() == 0 || src.const_data_ptr() != given.const_data_ptr()) return src;  // no data, or ours
  // A pool block has a deleter of its own (pool_empty): known by address, it
  // is aliased without the failed lazy clone's exception.
  if (src.is_cpu() && !pinned && !is_pool_tensor(src)) {
    try {
      return call_aten("aten::_lazy_clone", "", src);
    } catch (const std::exception&) {  // not a simple storage: aliased below
    }
  }
  return call_aten("aten::detach", "", src);
}

// A source as the copy reads it: lazy conjugate / negative views
// materialized (the copy moves bytes), made contiguous. The conjugate bit
// exists only on complex tensors; the negative bit on any (torch._neg_view),
// and the stable ABI cannot ask for it: resolve_neg is called unless the
// caller said no source has the bit (it returns the tensor itself when the
// bit is clear).
Tensor copy_source(const Tensor& t, ScalarType type, bool may_be_negative) {
  const bool complex =
      type == ScalarType::ComplexHalf || type == ScalarType::ComplexFloat || type == ScalarType::ComplexDouble;
  Tensor src = complex ? call_aten("aten::resolve_conj", "", t) : t;
  if (may_be_negative) src = call_aten("aten::resolve_neg", "", src);
  if (!src.is_contiguous()) src = torch::stable::contiguous(src);
  return src;
}

engine::CopyItem item_of(const Tensor& src, const Tensor& dst) {
  engine::CopyItem it;
  it.src = src.const_data_ptr();
  it.dst = dst.mutable_data_ptr();
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

// The tensors of a transfer, as its copy reads and writes them.
struct Prepared {
  std::vector<Tensor> sources;  // contiguous, conjugate / negation resolved; then held (hold_sources)
  std::vector<Tensor> results;
  std::vector<void*> mapped;  // each source's mapped device address (pinned memory) where a path asks; else nullptr
  std::size_t nbytes = 0;     // of the results
  bool copied_now = false;    // a small host copy, done before start_transfer returns
};

// Stage 2: the sources made contiguous (on the current stream when on a GPU)
// and the results allocated. Called with grad mode off (NoGradScope).
Prepared make_results(const TransferRequest& r, const CheckedTransfer& c) {
  Prepared p;
  p.sources.reserve(r.sources.size());
  p.results.reserve(r.sources.size());
  for (std::size_t i = 0; i < r.sources.size(); ++i) {
    const Tensor& t = r.sources[i];
    Tensor src = copy_source(t, c.types[i], r.may_have_negative_views);
    const ScalarType out_type = r.dtype.value_or(c.types[i]);
    // Host results come from the pool: cached blocks, so a copy does not pay
    // for faulting in fresh pages (which costs more than the copy itself).
    Tensor dst = c.gpu() && c.prefetch
                     ? torch::stable::empty(t.sizes(), out_type, std::nullopt, c.where)
                     : pool_empty(r.pool_id, shape_of(t), out_type,  // OutOfMemoryError: nothing queued
                                  t.is_cpu() ? -1 : t.device().index());
    p.nbytes += nbytes_of(dst);
    p.sources.push_back(std::move(src));
    p.results.push_back(std::move(dst));
  }
  return p;
}

// Stage 3: the sources' mapped addresses, and each source the copy reads later
// held (held_source). Called with grad mode off (NoGradScope).
void hold_sources(const TransferRequest& r, const CheckedTransfer& c, Prepared& p) {
  // Host sources: the GPU prefetch reads pinned ones directly; the host
  // path waits for the current stream before reading pinned ones. The
  // CPU-only build (no device) pins nothing.
  p.mapped.assign(p.sources.size(), nullptr);
  if ((c.gpu() && c.prefetch) || (!c.gpu() && rt::device_count() > 0)) {
    for (std::size_t i = 0; i < p.sources.size(); ++i) p.mapped[i] = mapped_address(p.sources[i]);
  }
  // A small host copy runs before start_transfer returns (the path's own rule,
  // on the same destination bytes): its sources need no holding.
  p.copied_now = !c.gpu() && engine::host_copy_runs_inline(p.nbytes);
  if (p.copied_now) return;
  for (std::size_t i = 0; i < p.sources.size(); ++i) {
    p.sources[i] = held_source(r.sources[i], std::move(p.sources[i]), p.mapped[i] != nullptr);
  }
}

// Stage 4: the raw copy items of the non-empty tensors.
std::vector<engine::CopyItem> build_items(const CheckedTransfer& c, const Prepared& p) {
  std::vector<engine::CopyItem> items;
  for (std::size_t i = 0; i < p.sources.size(); ++i) {
    if (p.sources[i].numel() == 0) continue;
    engine::CopyItem it = item_of(p.sources[i], p.results[i]);
    if (c.gpu() && c.prefetch) it.src_mapped = p.mapped[i];
    if (c.gpu() && !c.prefetch) {
      it.dst_mapped = mapped_address(p.results[i]);
      HF_CHECK_VALUE(!it.convert || it.dst_mapped != nullptr, c.api, ": dtype conversion on the way to the host ",
                     "writes pinned memory from a kernel, but the pool's memory is not mapped; expected a "
                     "PinnedPool(mapped=True) (the default) or dtype=None");
    }
    items.push_back(it);
  }
  return items;
}

// Stage 5 on the host path: queues the copy; returns its worker ticket.
std::uint64_t dispatch_on_host(engine::PathContext& ctx, std::vector<engine::CopyItem> items,
                               const std::vector<void*>& mapped, std::shared_ptr<schedule::Outcome> outcome) {
  // Pinned sources may still be written by a device->host copy queued on the
  // current stream: the host copy waits for it (pageable memory cannot be).
  std::shared_ptr<rt::Event> produced;
  bool any_pinned = false;
  for (void* m : mapped) any_pinned = any_pinned || m != nullptr;
  if (any_pinned) {
    const int current = current_torch_device();
    rt::DeviceGuard guard(current);
    produced = std::make_shared<rt::Event>(current);
    produced->record(current_torch_stream(current));
  }
  return engine::run_on_host(ctx, std::move(items), std::move(outcome), produced);
}

}  // namespace

void Transfer::dispatch_on_gpu(engine::PathContext& ctx, std::vector<engine::CopyItem> items, int device,
                               bool prefetch) {
  rt::DeviceGuard guard(device);  // the producer may be the default stream (nullptr) of `device`
  Engine& engine = Engine::get();
  engine::GpuStreams streams;
  streams.producer = current_torch_stream(device);
  streams.copy = engine.stream(device, prefetch ? tracing::CopyStream::kToDevice : tracing::CopyStream::kToHost);
  if (prefetch) streams.staging = engine.stream(device, tracing::CopyStream::kStaging);
  auto done = std::make_shared<rt::Event>(device);
  copy_device_ = device;
  copy_stream_ = streams.copy;
  staging_stream_ = streams.staging;
  alloc_stream_ = streams.producer;
  completion_.event = done;
  try {
    if (prefetch) {
      std::vector<Tensor>& keep = keepalive_;
      const Device on = cuda_device(device);
      const auto scratch = [&keep, on](std::size_t bytes) -> void* {
        // On the current (producer) stream, before the copy's start event: the
        // copy is ordered after earlier uses of this memory.
        keep.push_back(torch::stable::empty({static_cast<std::int64_t>(bytes)}, ScalarType::Byte, std::nullopt, on));
        return keep.back().mutable_data_ptr();
      };
      completion_.ticket = engine::run_host_to_device(ctx, std::move(items), device, streams, done, scratch, outcome_);
    } else {
      engine::run_device_to_host(ctx, std::move(items), device, streams, std::move(done));
    }
  } catch (...) {
    // Something may have been queued: let go of the tensors only once the
    // streams are idle (they die with the caller's frame), then rethrow as it came.
    sync_streams_quietly();
    completion_.ticket = 0;
    state_ = State::kFailed;
    throw;
  }
}

std::shared_ptr<Transfer> start_transfer(TransferRequest r) {
  Engine& engine = Engine::get();
  engine.poll();
  const CheckedTransfer c = check_transfer(r);

  auto handle = std::make_shared<Transfer>();
  handle->generation_ = fork_generation();
  handle->device_ = c.prefetch ? c.where : Device(DeviceType::CPU);
  handle->results_count_ = r.sources.size();
  Prepared p;
  {
    const NoGradScope no_grad;  // the engine's tensors record no graph
    p = make_results(r, c);
    handle->nbytes_ = p.nbytes;
    hold_sources(r, c, p);
  }
  std::vector<engine::CopyItem> items = build_items(c, p);

  engine::PathContext ctx = context_of(engine, c.pool);
  engine.counters().transfers += 1;
  engine.counters().bytes += handle->nbytes_;
  handle->outcome_ = std::make_shared<schedule::Outcome>();
  if (c.gpu()) {
    handle->dispatch_on_gpu(ctx, std::move(items), c.device, c.prefetch);
  } else {
    handle->completion_.ticket = dispatch_on_host(ctx, std::move(items), p.mapped, handle->outcome_);
  }
  if (!p.copied_now) {
    for (auto& t : p.sources) handle->keepalive_.push_back(std::move(t));
  }
  handle->results_ = std::move(p.results);
  return handle;
}

}  // namespace hipferry
