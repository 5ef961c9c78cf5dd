// Pinned pools for torch (see pinned_pool.h).
#include "csrc/torch/pinned_pool.h"

#include <ATen/ops/empty.h>
#include <c10/core/Storage.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <mutex>
#include <unordered_map>

#include "csrc/core/errors.h"
#include "csrc/torch/transfer_engine.h"
#include "hip/pinned_memory.h"

namespace hipferry {
namespace {

std::mutex registry_mutex;  // guards registry and next_id
std::unordered_map<std::int64_t, std::shared_ptr<pool::HostPool>> registry;
std::int64_t next_id = 1;

// The DataPtr context of a pool tensor's storage: keeps the pool alive while
// any tensor uses one of its blocks.
struct PoolBlock {
  std::shared_ptr<pool::HostPool> pool;
  void* host;
};

void delete_pool_block(void* context) {
  auto* block = static_cast<PoolBlock*>(context);
  try {
    block->pool->deallocate(block->host);
  } catch (const std::exception& e) {  // a deleter must not throw
    TORCH_WARN("hipferry: returning a block to its pinned pool failed: ", e.what());
  }
  delete block;
}

const PoolBlock* pool_block_of(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage() || !t.is_cpu()) return nullptr;
  const c10::DataPtr& dp = t.storage().data_ptr();
  if (dp.get_deleter() != &delete_pool_block) return nullptr;
  return static_cast<const PoolBlock*>(dp.get_context());
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

// An op kernel: its checks stay c10 errors, which torch's dispatcher binding
// raises by type (c10::OutOfMemoryError as torch.OutOfMemoryError); a std
// exception would arrive as RuntimeError. Direct C++ callers (start_transfer)
// reach Python through translate_errors, which maps c10 errors the same way.
at::Tensor pool_empty(std::int64_t pool_id, at::IntArrayRef sizes, at::ScalarType dtype, std::int64_t for_device) {
  TORCH_CHECK(for_device >= -1 && for_device < (std::int64_t{1} << 16), "hipferry.PinnedPool.empty: for_device ",
              for_device, " is not a device index; expected -1 (the current GPU) or an index >= 0");
  bool empty = false;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    TORCH_CHECK(sizes[i] >= 0, "hipferry.PinnedPool.empty: size has a negative dimension ", sizes[i],
                " at index ", i, "; expected sizes >= 0");
    empty = empty || sizes[i] == 0;
  }
  std::int64_t numel = empty ? 0 : 1;  // a zero-element shape is fine however large its other dimensions
  for (std::size_t i = 0; i < sizes.size() && !empty; ++i) {
    TORCH_CHECK(numel <= (std::int64_t{1} << 50) / sizes[i], "hipferry.PinnedPool.empty: size ", sizes,
                " has more than 2^50 elements; expected a size that fits in host memory");
    numel *= sizes[i];
  }
  TORCH_CHECK(!c10::isQIntType(dtype) && dtype != at::ScalarType::Undefined,
              "hipferry.PinnedPool.empty: dtype ", dtype, " cannot be allocated as plain memory; expected a "
              "non-quantized dtype");
  const auto options = at::TensorOptions().dtype(dtype).device(at::kCPU);
  const std::size_t nbytes = static_cast<std::size_t>(numel) * c10::elementSize(dtype);
  auto pool = pinned_pool(pool_id);
  if (nbytes == 0) {
    TORCH_CHECK(!pool->closed(), "hipferry.PinnedPool.empty: the pool is closed; expected an open pool");
    return at::empty(sizes, options);
  }
  // Only a pool that places by device asks which GPU is current (a runtime
  // call, but one that takes no lock and no driver round trip).
  int device = static_cast<int>(for_device);
  if (device < 0 && !pool->options().device_nodes.empty() && rt::device_count() > 0) device = rt::current_device();
  pool::HostPool::Allocation block;
  try {
    block = pool->allocate(nbytes, device);
  } catch (const pool::PoolCapacityError& e) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, e.what());
  } catch (const pool::PoolError& e) {
    TORCH_CHECK(false, e.what());
  }
  auto* context = new PoolBlock{pool, block.host};
  c10::DataPtr data(block.host, context, &delete_pool_block, c10::Device(c10::kCPU));
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, std::move(data), /*allocator=*/nullptr,
                       /*resizable=*/false);
  // Built directly rather than by at::empty + set_: two dispatcher round trips
  // fewer on the allocation hot path.
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                                          c10::scalarTypeToTypeMeta(dtype));
  t.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  return t;
}

bool record_pool_use(const at::Tensor& t, int device, void* stream) {
  const PoolBlock* block = pool_block_of(t);
  if (block == nullptr) return false;
  block->pool->record_use(block->host, pool::StreamUse{device, stream});
  return true;
}

TORCH_LIBRARY_IMPL(hipferry, CompositeExplicitAutograd, m) { m.impl("pool_empty", &pool_empty); }

}  // namespace hipferry
