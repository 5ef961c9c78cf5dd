// Python bindings of the pinned pool (hipferry._C.*pinned_pool*, pool_*).
// Tensors are made by the op torch.ops.hipferry.pool_empty; these functions
// manage pools by id. python/hipferry/pool.py is the public wrapper.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "csrc/core/host_pool/numa_binding.h"
#include "csrc/core/host_pool/numa_topology.h"
#include "csrc/core/host_pool/size_classes.h"
#include "csrc/torch/pinned_pool.h"
#include "hip/pinned_memory.h"
#include "hip/runtime.h"

namespace py = pybind11;

namespace hipferry {
namespace {

py::dict pool_stats(std::int64_t id) {
  const pool::PoolStats s = pinned_pool(id)->stats();
  py::dict d;
  d["requested_bytes"] = s.requested_bytes;
  d["allocated_bytes"] = s.allocated_bytes;
  d["reserved_bytes"] = s.reserved_bytes;
  d["peak_requested_bytes"] = s.peak_requested_bytes;
  d["peak_allocated_bytes"] = s.peak_allocated_bytes;
  d["peak_reserved_bytes"] = s.peak_reserved_bytes;
  d["cached_free_bytes"] = s.cached_free_bytes;
  d["live_blocks"] = s.live_blocks;
  d["waiting_blocks"] = s.waiting_blocks;
  d["waiting_bytes"] = s.waiting_bytes;
  d["segments"] = s.segments;
  d["cache_hits"] = s.cache_hits;
  d["cache_misses"] = s.cache_misses;
  d["reclaims"] = s.reclaims;
  d["growth_releases"] = s.growth_releases;
  d["system_allocs"] = s.system_allocs;
  d["system_frees"] = s.system_frees;
  d["system_alloc_seconds"] = static_cast<double>(s.system_alloc_ns) * 1e-9;
  d["capacity"] = s.capacity;
  py::dict by_node;  // -1: pages the system placed (no binding)
  for (const auto& [node, bytes] : s.reserved_by_node) by_node[py::int_(node)] = bytes;
  d["reserved_by_node"] = by_node;
  return d;
}

std::int64_t create(const std::string& provider, unsigned flags, int register_threads, std::size_t capacity,
                    std::size_t max_cached_bytes, std::size_t reserve_bytes, const std::string& capacity_origin,
                    int numa_node, const std::vector<int>& device_nodes, double growth_limit) {
  PinnedPoolConfig config;
  config.provider = provider;
  config.flags = flags;
  config.register_threads = register_threads;
  config.options.capacity = capacity;
  config.options.max_cached_bytes = max_cached_bytes;
  config.options.reserve_bytes = reserve_bytes;
  config.options.capacity_origin = capacity_origin;
  config.options.numa_node = numa_node;
  config.options.device_nodes = device_nodes;
  config.options.growth_limit = growth_limit;
  py::gil_scoped_release no_gil;  // the reserve may take a while to pin
  return create_pinned_pool(config);
}

// What python/hipferry/pool.py reads instead of copying: the hipHostMalloc
// flag values by PinnedPool argument, the provider names, the reserve's granule.
void bind_pool_constants(py::module_& m) {
  py::dict flags;
  flags["portable"] = static_cast<unsigned>(rt::kHostPortable);
  flags["mapped"] = static_cast<unsigned>(rt::kHostMapped);
  flags["write_combined"] = static_cast<unsigned>(rt::kHostWriteCombined);
  flags["numa_user"] = static_cast<unsigned>(rt::kHostNumaUser);
  flags["coherent"] = static_cast<unsigned>(rt::kHostCoherent);
  flags["non_coherent"] = static_cast<unsigned>(rt::kHostNonCoherent);
  m.attr("HOST_ALLOC_FLAGS") = flags;
  py::tuple providers(kHostMemoryProviders.size());
  for (std::size_t i = 0; i < kHostMemoryProviders.size(); ++i) providers[i] = py::str(kHostMemoryProviders[i]);
  m.attr("HOST_MEMORY_PROVIDERS") = providers;
  m.attr("RESERVE_GRANULE") = pool::kOwnSegmentGranule;  // the reserve is one segment, rounded up to it
}

}  // namespace

void bind_pinned_pool(py::module_& m) {
  py::register_exception<pool::PoolError>(m, "PoolError", PyExc_RuntimeError);
  bind_pool_constants(m);
  m.def("create_pinned_pool", &create, py::arg("provider"), py::arg("flags"), py::arg("register_threads"),
        py::arg("capacity"), py::arg("max_cached_bytes"), py::arg("reserve_bytes"), py::arg("capacity_origin") = "",
        py::arg("numa_node") = -1, py::arg("device_nodes") = std::vector<int>{},
        py::arg("growth_limit") = pool::PoolOptions{}.growth_limit);
  m.def(
      "numa_device_nodes",
      [](const std::vector<std::string>& pci_bus_ids, const std::string& sysfs_root) {
        return pool::NumaTopology::read(sysfs_root).device_nodes(pci_bus_ids, sysfs_root);
      },
      py::arg("pci_bus_ids"), py::arg("sysfs_root") = "/sys",
      "The NUMA node each device's pinned memory should come from (-1: no binding: one node, or unknown).");
  m.def("pool_node_of_block", [](std::int64_t id, std::uintptr_t host) {
    return pinned_pool(id)->node_of_block(reinterpret_cast<void*>(host));
  });
  m.def("pool_numa_placement", [](std::int64_t id) {
    const pool::PoolOptions& o = pinned_pool(id)->options();
    return py::make_tuple(o.numa_node, o.device_nodes);
  });
  m.def(
      "numa_node_of_address", [](std::uintptr_t p) { return pool::node_of_address(reinterpret_cast<const void*>(p)); },
      py::arg("address"), "The NUMA node of the touched page at `address` (-1: the kernel cannot say).");
  m.def("destroy_pinned_pool", [](std::int64_t id) {
    py::gil_scoped_release no_gil;
    destroy_pinned_pool(id);
  });
  m.def("pool_stats", &pool_stats);
  m.def("pool_trim", [](std::int64_t id) {
    auto pool = pinned_pool(id);
    py::gil_scoped_release no_gil;
    return pool->trim();
  });
  m.def("pool_process_events", [](std::int64_t id) {
    auto pool = pinned_pool(id);
    py::gil_scoped_release no_gil;
    return pool->process_events();
  });
  m.def("pool_provider", [](std::int64_t id) { return pinned_pool(id)->provider_name(); });
  m.def("pool_check_invariants", [](std::int64_t id) { pinned_pool(id)->check_invariants(); });
  m.def("pool_owns",
        [](std::int64_t id, std::uintptr_t host) { return pinned_pool(id)->owns(reinterpret_cast<void*>(host)); });
  m.def("pool_record_use", [](std::int64_t id, std::uintptr_t host, int device, std::uintptr_t stream) {
    pinned_pool(id)->record_use(reinterpret_cast<void*>(host),
                                pool::StreamUse{device, reinterpret_cast<void*>(stream)});
  });
}

}  // namespace hipferry
