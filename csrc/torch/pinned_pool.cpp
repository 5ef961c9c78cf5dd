// Pinned pools for torch (see pinned_pool.h).
#include "csrc/torch/pinned_pool.h"

#include <torch/csrc/stable/library.h>

#include <algorithm>
#include <cstdio>
#include <mutex>
#include <unordered_map>

#include "csrc/core/errors.h"
#include "csrc/torch/op_errors.h"
#include "csrc/torch/transfer_engine.h"
#include "hip/pinned_memory.h"

namespace hipferry {
namespace {

std::mutex registry_mutex;                                                   // guards registry, every_pool and next_id
std::unordered_map<std::int64_t, std::shared_ptr<pool::HostPool>> registry;  // the open pools, by id
// Every pool that may still have live blocks, closed ones included (a tensor
// keeps its pool alive): record_pool_use looks a tensor's block up in each.
std::vector<std::weak_ptr<pool::HostPool>> every_pool;
std::int64_t next_id = 1;

// The deleter of a pool tensor's storage: it keeps the pool alive while any
// tensor uses one of its blocks, and returns the block when the storage dies.
struct PoolBlock {
  std::shared_ptr<pool::HostPool> pool;
  void* host;
  void operator()(void* /*data*/) const {
    try {
      pool->deallocate(host);
    } catch (const std::exception& e) {  // a deleter must not throw
      std::fprintf(stderr, "hipferry: returning a block to its pinned pool failed: %s\n", e.what());
    }
  }
};

// The pool whose live block starts where `t`'s storage does, or null.
std::shared_ptr<pool::HostPool> pool_of(const Tensor& t, void*& block) {
  if (!t.defined() || !t.is_cpu() || t.numel() == 0) return nullptr;
  block = storage_start(t);
  std::vector<std::shared_ptr<pool::HostPool>> pools;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    for (const auto& w : every_pool) {
      if (auto p = w.lock()) pools.push_back(std::move(p));
    }
  }
  for (auto& p : pools) {
    if (p->owns(block)) return p;
  }
  return nullptr;  // pools die outside the lock
}

}  // namespace

std::int64_t create_pinned_pool(const PinnedPoolConfig& config) {
  auto provider = make_host_memory_provider(config.provider, config.flags, config.register_threads);
  auto pool = std::make_shared<pool::HostPool>(std::move(provider), make_use_event_source(), config.options);
  // Results of transfers that completed but were not yet polled hold blocks:
  // an allocation over the capacity lets go of them before it fails.
  pool->set_reclaimer([] { return poll_transfer_releases(); });
  std::lock_guard<std::mutex> lock(registry_mutex);
  const std::int64_t id = next_id++;
  every_pool.erase(std::remove_if(every_pool.begin(), every_pool.end(),
                                  [](const std::weak_ptr<pool::HostPool>& w) { return w.expired(); }),
                   every_pool.end());
  every_pool.push_back(pool);
  registry.emplace(id, std::move(pool));
  return id;
}

std::shared_ptr<pool::HostPool> pinned_pool(std::int64_t id) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry.find(id);
  HF_CHECK(it != registry.end(), "hipferry: pinned pool ", id,
           " does not exist (it was closed); expected an open PinnedPool");
  return it->second;
}

void destroy_pinned_pool(std::int64_t id) {
  std::shared_ptr<pool::HostPool> pool;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    auto it = registry.find(id);
    if (it == registry.end()) return;
    pool = std::move(it->second);
    registry.erase(it);
  }
  pool->close();  // outside the registry lock: it releases memory
}

// Argument errors are std::runtime_error (RuntimeError, as torch's own
// factory checks); a full pool is OutOfMemory (torch.OutOfMemoryError: the
// op kernel below tags it for hipferry.ops, translate_errors maps it for the
// transfer engine's callers).
Tensor pool_empty(std::int64_t pool_id, const Shape& sizes, ScalarType dtype, std::int64_t for_device,
                  std::int64_t alignment) {
  HF_CHECK(for_device >= -1 && for_device < (std::int64_t{1} << 16), "hipferry.PinnedPool.empty: for_device ",
           for_device, " is not a device index; expected -1 (the current GPU) or an index >= 0");
  HF_CHECK(alignment == pool::kAlignment || alignment == pool::kPageAlignment, "hipferry.PinnedPool.empty: alignment ",
           alignment, " is not supported; expected 256 (the default) or 4096 (a page, as O_DIRECT needs)");
  bool empty = false;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    HF_CHECK(sizes[i] >= 0, "hipferry.PinnedPool.empty: size has a negative dimension ", sizes[i], " at index ", i,
             "; expected sizes >= 0");
    empty = empty || sizes[i] == 0;
  }
  std::int64_t numel = empty ? 0 : 1;  // a zero-element shape is fine however large its other dimensions
  for (std::size_t i = 0; i < sizes.size() && !empty; ++i) {
    HF_CHECK(numel <= (std::int64_t{1} << 50) / sizes[i], "hipferry.PinnedPool.empty: size ", shape_str(sizes),
             " has more than 2^50 elements; expected a size that fits in host memory");
    numel *= sizes[i];
  }
  HF_CHECK(!is_quantized(dtype) && dtype != ScalarType::Undefined, "hipferry.PinnedPool.empty: dtype ",
           dtype_name(dtype), " cannot be allocated as plain memory; expected a non-quantized dtype");
  const std::size_t nbytes = static_cast<std::size_t>(numel) * element_size_of(dtype);
  auto pool = pinned_pool(pool_id);
  const Device cpu(DeviceType::CPU);
  if (nbytes == 0) {
    HF_CHECK(!pool->closed(), "hipferry.PinnedPool.empty: the pool is closed; expected an open pool");
    return torch::stable::empty(sizes, dtype, std::nullopt, cpu);
  }
  // Only a pool that places by device asks which GPU is current (a runtime
  // call, but one that takes no lock and no driver round trip).
  int device = static_cast<int>(for_device);
  if (device < 0 && !pool->options().device_nodes.empty() && rt::device_count() > 0) device = rt::current_device();
  pool::HostPool::Allocation block;
  try {
    block = pool->allocate(nbytes, device, static_cast<std::size_t>(alignment));
  } catch (const pool::PoolCapacityError& e) {
    HF_CHECK_OOM(false, e.what());
  } catch (const pool::PoolError& e) {
    HF_CHECK(false, e.what());
  }
  Shape strides(sizes.size(), 1);
  for (std::size_t i = sizes.size(); i-- > 1;) strides[i - 1] = strides[i] * std::max<std::int64_t>(sizes[i], 1);
  try {
    return torch::stable::from_blob(block.host, sizes, strides, cpu, dtype, PoolBlock{pool, block.host});
  } catch (...) {
    pool->deallocate(block.host);  // torch refused the blob: the block was never handed out
    throw;
  }
}

bool record_pool_use(const Tensor& t, int device, void* stream) {
  void* block = nullptr;
  auto pool = pool_of(t, block);
  if (!pool) return false;
  pool->record_use(block, pool::StreamUse{device, stream});
  return true;
}

bool is_pool_tensor(const Tensor& t) {
  void* block = nullptr;
  return pool_of(t, block) != nullptr;
}

namespace {

Tensor pool_empty_op(std::int64_t pool, std::vector<std::int64_t> size, ScalarType dtype, std::int64_t for_device,
                     std::int64_t alignment) {
  return tag_op_errors([&] { return pool_empty(pool, size, dtype, for_device, alignment); });
}

}  // namespace

}  // namespace hipferry

STABLE_TORCH_LIBRARY_IMPL(hipferry, CompositeExplicitAutograd, m) {
  m.impl("pool_empty", TORCH_BOX(&hipferry::pool_empty_op));
}
