// hipferry._C: importing it registers the ops (static TORCH_LIBRARY blocks);
// the functions below expose the runtime layer to `python -m hipferry doctor`.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <vector>

#include "csrc/core/copy_cast_cpu.h"
#include "csrc/core/cpu/cpu_isa.h"
#include "csrc/core/host_pool/numa_topology.h"
#include "csrc/torch/tensor_bridge.h"
#include "hip/pinned_memory.h"
#include "hip/runtime.h"

namespace py = pybind11;
using namespace hipferry;

namespace {

py::dict build_info() {
  const rt::BuildInfo b = rt::build_info();
  py::dict d;
  d["target"] = b.platform;
  d["architectures"] = b.architectures;
  d["runtime_version"] = b.runtime_version;
  d["driver_version"] = b.driver_version;
  d["torch_version_built_against"] = HIPFERRY_TORCH_VERSION;
  // How tensors cross to Python in this process (Note [tensor bridge]).
  d["tensor_bridge"] = tensor_bridge_kind();
  d["cpu_f16c"] = copy_cast_cpu_uses_f16c();
  // The build of the CPU loops in use (HIPFERRY_CPU_ISA), and the best this CPU runs.
  d["cpu_isa"] = cpu::isa_name(cpu::active_isa());
  d["cpu_isa_best"] = cpu::isa_name(cpu::best_isa());
  return d;
}

py::dict device_info(int device) {
  const rt::DeviceInfo i = rt::device_info(device);
  py::dict d;
  d["index"] = i.index;
  d["name"] = i.name;
  d["arch"] = i.arch;
  d["total_memory"] = i.total_memory;
  d["free_memory"] = i.free_memory;
  d["multiprocessors"] = i.multiprocessors;
  d["can_map_host_memory"] = i.can_map_host_memory;
  d["pci_bus_id"] = i.pci_bus_id;
  d["numa_node"] = pool::NumaTopology::node_of_pci_device(i.pci_bus_id);  // -1: unknown
  return d;
}

// Pins `bytes` of host memory with `flags`, writes a pattern, asks the runtime
// for its device address, copies it device-ward through that address and back,
// and compares. Raises what failed.
py::dict check_host_memory(int device, std::size_t bytes, unsigned flags, bool use_register) {
  bool round_trip_ok = false;
  bool same_address = false;
  {
    py::gil_scoped_release no_gil;
    std::vector<unsigned char> pattern(bytes), back(bytes, 0);
    for (std::size_t i = 0; i < bytes; ++i) pattern[i] = static_cast<unsigned char>(i * 131 + 7);
    // The pinned pool's own providers: the doctor checks what the pool uses.
    auto provider = make_host_memory_provider(use_register ? "register" : "host_alloc", flags, 1);
    const pool::HostSegment host = provider->allocate(bytes, pool::kNoNumaNode);
    void* dev = nullptr;
    try {
      std::memcpy(host.host, pattern.data(), bytes);
      void* mapped = host.device != nullptr ? host.device : rt::host_device_pointer(host.host);
      same_address = mapped == host.host;
      dev = rt::device_alloc(bytes, device);
      rt::memcpy_sync(dev, mapped, bytes);
      rt::memcpy_sync(back.data(), dev, bytes);
    } catch (...) {
      if (dev != nullptr) rt::device_free(dev, device);
      provider->release(host, bytes);
      throw;
    }
    rt::device_free(dev, device);
    provider->release(host, bytes);
    round_trip_ok = std::memcmp(back.data(), pattern.data(), bytes) == 0;
  }
  py::dict result;
  result["round_trip_ok"] = round_trip_ok;
  result["device_address_equals_host_address"] = same_address;
  return result;
}

}  // namespace

namespace hipferry {
void bind_pinned_pool(py::module_& m);       // pool_bindings.cpp
void bind_pool_fast_path(py::module_& m);    // pool_fast_path.cpp
void bind_transfers(py::module_& m);         // transfer_bindings.cpp
void bind_adamw(py::module_& m);             // adamw_step.cpp
void bind_adamw8bit(py::module_& m);         // adamw8bit_step.cpp
void bind_disk(py::module_& m);              // disk_bindings.cpp
void bind_adamw_streamer(py::module_& m);    // adamw_streamer.cpp
void bind_layer_copier(py::module_& m);      // layer_copier.cpp
void bind_in_flight_window(py::module_& m);  // in_flight_bindings.cpp
void bind_content_hash(py::module_& m);      // content_hash.cpp
void bind_thread_fp_modes(py::module_& m);   // thread_fp_modes.cpp
#if defined(HIPFERRY_TEST_HOOKS)
void bind_test_hooks(py::module_& m);  // csrc/testing/test_hooks.cpp: built with the tests only
#endif
}  // namespace hipferry

PYBIND11_MODULE(_C, m) {
  m.doc() = "hipferry native module: ops are under torch.ops.hipferry";
  init_tensor_bridge();
  py::register_exception<rt::Error>(m, "RuntimeLayerError", PyExc_RuntimeError);
  m.def("build_info", &build_info, "What this binary was built for.");
  m.def(
      "cpu_isa", [] { return cpu::isa_name(cpu::active_isa()); },
      "The build of the CPU loops in use: 'avx512', 'avx2' or 'baseline' (HIPFERRY_CPU_ISA; ValueError if invalid).");
  m.def("device_count", &rt::device_count, "GPU devices visible to the runtime (0 without).");
  m.def("device_info", &device_info, py::arg("device"));
  m.def(
      "numa_nodes", [] { return pool::NumaTopology::read().nodes; }, "The host's online NUMA nodes.");
  m.def("check_host_memory", &check_host_memory, py::arg("device"), py::arg("bytes"), py::arg("flags"),
        py::arg("use_register") = false);
  bind_pinned_pool(m);
  bind_pool_fast_path(m);
  bind_transfers(m);
  bind_adamw(m);
  bind_adamw8bit(m);
  bind_disk(m);
  bind_adamw_streamer(m);
  bind_layer_copier(m);
  bind_in_flight_window(m);
  bind_content_hash(m);
  bind_thread_fp_modes(m);
#if defined(HIPFERRY_TEST_HOOKS)
  bind_test_hooks(m);
#endif
}
