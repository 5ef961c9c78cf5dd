// hipferry._C._testing.disk_faults(...): faults injected into the disk state
// store's I/O, for the Python fault tests (the C++ tests drive the core with
// their own fakes). Every DiskIo made in a test build runs its backend
// through FaultyBackend, which passes requests through until a fault is armed.
#include <pybind11/pybind11.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "csrc/core/disk/io_backend.h"
#include "csrc/core/errors.h"
#include "csrc/torch/disk_bindings.h"

namespace py = pybind11;

namespace hipferry {
namespace {

constexpr std::size_t kPage = 4096;

// The armed fault: the `after`-th request (0: the next) of `op` fails with
// -error, or (error == 0) moves only half of its bytes. `count` faults, then
// disarmed.
struct FaultPlan {
  std::mutex mutex;
  bool armed = false;
  int op = -1;  // 0 read, 1 write, -1 either
  long after = 0;
  int error = EIO;
  long count = 1;
  long fired = 0;
};
FaultPlan g_plan;

class FaultyBackend final : public disk::IoBackend {
 public:
  explicit FaultyBackend(std::unique_ptr<disk::IoBackend> inner) : inner_(std::move(inner)) {}
  const char* name() const override { return inner_->name(); }
  std::size_t depth() const override { return inner_->depth(); }

  void submit(const disk::IoRequest& r) override {
    disk::IoRequest forwarded = r;
    {
      std::lock_guard<std::mutex> lock(g_plan.mutex);
      const int op = r.op == disk::IoOp::kRead ? 0 : 1;
      // A short transfer stops on a page (O_DIRECT's unit, as a real one would): requests
      // under two pages pass through without using up the fault.
      const bool can_fail = g_plan.error != 0 || r.bytes >= 2 * kPage;
      if (g_plan.armed && can_fail && (g_plan.op < 0 || g_plan.op == op) && g_plan.after-- <= 0) {
        ++g_plan.fired;
        if (--g_plan.count <= 0) g_plan.armed = false;
        if (g_plan.error != 0) {
          failed_.push_back({r.tag, -static_cast<std::int64_t>(g_plan.error)});
          return;  // never reaches the file
        }
        forwarded.bytes = r.bytes / 2 / kPage * kPage;  // a short transfer
      }
    }
    inner_->submit(forwarded);
    ++inner_in_flight_;
  }

  std::size_t reap(disk::IoCompletion* out, std::size_t max, std::size_t min_complete) override {
    std::size_t n = 0;
    while (n < max && !failed_.empty()) {
      out[n++] = failed_.back();
      failed_.pop_back();
    }
    const std::size_t need = n >= min_complete ? 0 : min_complete - n;
    if (inner_in_flight_ == 0 || n == max) return n;
    const std::size_t got = inner_->reap(out + n, max - n, need < inner_in_flight_ ? need : inner_in_flight_);
    inner_in_flight_ -= got;
    return n + got;
  }

 private:
  std::unique_ptr<disk::IoBackend> inner_;
  std::vector<disk::IoCompletion> failed_;
  std::size_t inner_in_flight_ = 0;
};

std::unique_ptr<disk::IoBackend> wrap(std::unique_ptr<disk::IoBackend> inner) {
  return std::make_unique<FaultyBackend>(std::move(inner));
}

}  // namespace

void bind_disk_faults(py::module_& t) {
  set_disk_backend_wrapper(&wrap);
  t.def(
      "disk_faults",
      [](const std::string& op, long after, int error, long count) {
        HF_CHECK_VALUE(op == "read" || op == "write" || op == "any", "disk_faults: op must be read, write or any");
        std::lock_guard<std::mutex> lock(g_plan.mutex);
        g_plan.armed = count > 0;
        g_plan.op = op == "read" ? 0 : op == "write" ? 1 : -1;
        g_plan.after = after;
        g_plan.error = error;
        g_plan.count = count;
        g_plan.fired = 0;
      },
      py::arg("op"), py::arg("after") = 0, py::arg("error") = EIO, py::arg("count") = 1,
      "Arms a fault in every DiskIo: the after-th request of op fails with -error (error=0: moves half its bytes), "
      "count times. count=0 disarms.");
  t.def("disk_faults_fired", [] {
    std::lock_guard<std::mutex> lock(g_plan.mutex);
    return g_plan.fired;
  });
}

}  // namespace hipferry
