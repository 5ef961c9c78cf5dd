// Pinned pools as seen by torch: a registry of pools by id (Python holds the
// id; tensors hold the pool itself), tensors whose storage is a pool block,
// and stream-use recording for tensors that came from a pool.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "csrc/core/host_pool/host_pool.h"
#include "csrc/torch/stable.h"

namespace hipferry {

struct PinnedPoolConfig {
  std::string provider = "auto";  // see make_host_memory_provider
  unsigned flags = 0;             // rt::HostAllocFlags
  int register_threads = 8;
  pool::PoolOptions options;  // NUMA placement included (numa_node, device_nodes)
};

// Creates a pool and returns its id. Throws pool::PoolError for bad options.
std::int64_t create_pinned_pool(const PinnedPoolConfig& config);
// The pool with this id; throws std::runtime_error naming the id if there is none.
std::shared_ptr<pool::HostPool> pinned_pool(std::int64_t id);
// Closes the pool and forgets the id; tensors from it stay valid.
void destroy_pinned_pool(std::int64_t id);

// A CPU tensor of `sizes` and `dtype` whose storage is one block of the pool;
// the block goes back when the storage dies (every view of it included).
// `for_device`: the GPU whose copies will use it, for NUMA placement; -1: the
// current GPU (when the pool places by device and there is one).
// `alignment`: the storage starts at a multiple of it: 256 (every block) or
// 4096 (a page, and the block is whole pages: O_DIRECT reads and writes).
// Throws ValueError for bad arguments, OutOfMemory over the pool's capacity.
Tensor pool_empty(std::int64_t pool_id, const Shape& sizes, ScalarType dtype, std::int64_t for_device = -1,
                  std::int64_t alignment = 256);

// If `t`'s data lies in a block of an open pool, notes that `stream` on
// `device` uses it (deallocation then waits for that work). Returns false for
// other tensors. Pool tensors are recognised by address (HostPool::owns): the
// stable ABI shows no storage deleter to compare.
bool record_pool_use(const Tensor& t, int device, void* stream);

// Whether `t`'s data lies in a block of a pool (open or closed), found as
// record_pool_use finds it.
bool is_pool_tensor(const Tensor& t);

}  // namespace hipferry
