// hipferry._C._testing: hooks for the tests and the pool benchmark. They are
// compiled into the module only when the tests are built (CMake option
// HIPFERRY_TEST_HOOKS, on with HIPFERRY_BUILD_TESTS); a production build has
// none of them, and code that uses them checks for hipferry._C._testing.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "csrc/core/errors.h"
#include "csrc/core/host_pool/host_pool.h"
#include "csrc/torch/pinned_pool.h"
#include "csrc/torch/python_errors.h"
#include "csrc/torch/stable.h"
#include "csrc/torch/tensor_bridge.h"
#include "csrc/torch/transfer_engine.h"

namespace py = pybind11;

namespace hipferry {
namespace {

// Nanoseconds of each of `iterations` allocate+free pairs of `bytes`, after
// one warm-up pair: the cached path, timed without Python in the loop.
// kind: "pool_core" (HostPool directly), "pool_tensor" (pool_empty + free),
// "torch_pinned" (torch.empty(pin_memory=True)), "torch_cpu" (torch.empty), both
// through the stable ABI.
std::vector<std::int64_t> bench_alloc_free(const std::string& kind, std::int64_t id, std::size_t bytes,
                                           int iterations) {
  const Device cpu(DeviceType::CPU);
  const std::int64_t n = static_cast<std::int64_t>(bytes);
  std::function<void()> pair;
  std::shared_ptr<pool::HostPool> pool;
  if (kind == "pool_core") {
    pool = pinned_pool(id);
    pair = [&] { pool->deallocate(pool->allocate(bytes).host); };
  } else if (kind == "pool_tensor") {
    pair = [&] { (void)pool_empty(id, {n}, ScalarType::Byte); };
  } else if (kind == "torch_pinned") {
    pair = [&] { (void)torch::stable::empty({n}, ScalarType::Byte, std::nullopt, cpu, true); };
  } else if (kind == "torch_cpu") {
    pair = [&] { (void)torch::stable::empty({n}, ScalarType::Byte, std::nullopt, cpu); };
  } else {
    throw std::invalid_argument(
        "bench_alloc_free: kind must be pool_core, pool_tensor, torch_pinned or "
        "torch_cpu, got '" +
        kind + "'");
  }
  py::gil_scoped_release no_gil;
  pair();
  std::vector<std::int64_t> ns(static_cast<std::size_t>(std::max(iterations, 0)));
  for (auto& t : ns) {
    const auto t0 = std::chrono::steady_clock::now();
    pair();
    t = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  }
  return ns;
}

// Queues a sleep on the transfer worker: the transfers started next stay in flight.
void transfer_worker_sleep(double milliseconds) {
  HF_CHECK_VALUE(milliseconds >= 0 && milliseconds <= 60000,
                 "hipferry._C._testing.transfer_worker_sleep: ms must be in [0, 60000], got ", milliseconds);
  transfer_worker().submit(
      [milliseconds] { std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(milliseconds)); });
}

// Throws hipferry's error of `kind` through its check macro: translate_errors'
// clauses for types no input reaches yet (TypeError, OutOfMemory) get a test.
void raise_error(const std::string& kind, const std::string& message) {
  HF_CHECK_VALUE(kind != "value", message);
  HF_CHECK_TYPE(kind != "type", message);
  HF_CHECK_OOM(kind != "oom", message);
  HF_CHECK(kind != "runtime", message);
  HF_CHECK_VALUE(false, "hipferry._C._testing.raise_error: kind must be value, type, oom or runtime, got '", kind, "'");
}

}  // namespace

void bind_disk_faults(py::module_& t);  // disk_faults.cpp

void bind_test_hooks(py::module_& m) {
  py::module_ t = m.def_submodule("_testing", "Test and benchmark hooks (built with the tests only).");
  bind_disk_faults(t);
  t.def(
      "transfer_worker_sleep", [](double ms) { translate_errors([&] { transfer_worker_sleep(ms); }); }, py::arg("ms"));
  // GIL released, as in the transfer bindings: the OutOfMemory clause must take it back.
  t.def(
      "raise_error",
      [](const std::string& kind, const std::string& message) {
        translate_errors([&] { raise_error(kind, message); });
      },
      py::arg("kind"), py::arg("message"), py::call_guard<py::gil_scoped_release>());
  // hipferry's own dtype table (csrc/torch/stable.cpp), each entry with a
  // tensor made in that dtype through the stable ABI (None for the quantized
  // dtypes, which need a quantizer): the tests compare names and sizes with torch.
  t.def("dtype_table", [] {
    py::list rows;
    for (ScalarType type : known_dtypes()) {
      py::object made = py::none();
      if (!is_quantized(type)) {
        made = tensor_to_python(torch::stable::empty({2}, type, std::nullopt, Device(DeviceType::CPU)));
      }
      rows.append(py::make_tuple(dtype_name(type), element_size_of(type), made));
    }
    return rows;
  });
  t.def("pool_bench_alloc_free", &bench_alloc_free, py::arg("kind"), py::arg("pool"), py::arg("bytes"),
        py::arg("iterations"));
}

}  // namespace hipferry
