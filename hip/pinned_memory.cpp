// Backends of the pinned pool on the runtime layer (see pinned_memory.h).
#include "hip/pinned_memory.h"

#include <cstdlib>
#include <stdexcept>

#include "csrc/core/host_pool/numa_binding.h"
#include "csrc/core/host_pool/page_touch.h"
#include "csrc/core/host_pool/size_classes.h"
#include "csrc/core/transfer/serial_worker.h"

namespace hipferry {
namespace {

constexpr std::size_t kHugePage = std::size_t{2} << 20;

class RuntimeUseEvent : public pool::UseEvent {
 public:
  RuntimeUseEvent(RuntimeEventSource* source, std::unique_ptr<rt::Event> event, int device)
      : source_(source), event_(std::move(event)), device_(device) {}
  ~RuntimeUseEvent() override { source_->give_back(std::move(event_), device_); }
  bool query() override { return event_->query(); }
  void synchronize() override { event_->synchronize(); }

 private:
  RuntimeEventSource* source_;  // outlives the event: the pool destroys events first
  std::unique_ptr<rt::Event> event_;
  int device_;
};

// Asks the runtime for a mapped segment's device address; gives the segment
// back to `provider` when the runtime has none.
void ask_device_address(pool::HostMemoryProvider& provider, pool::HostSegment& segment, std::size_t bytes,
                        unsigned flags) {
  if (!(flags & rt::kHostMapped)) return;
  try {
    segment.device = rt::host_device_pointer(segment.host);
  } catch (...) {
    provider.release(segment, bytes);
    throw;
  }
}

}  // namespace

std::string describe_host_flags(unsigned flags) {
  std::string s;
  const auto add = [&s](const char* name) { s += s.empty() ? name : std::string("|") + name; };
  if (flags & rt::kHostPortable) add("portable");
  if (flags & rt::kHostMapped) add("mapped");
  if (flags & rt::kHostWriteCombined) add("write_combined");
  if (flags & rt::kHostNumaUser) add("numa_user");
  if (flags & rt::kHostCoherent) add("coherent");
  if (flags & rt::kHostNonCoherent) add("non_coherent");
  return s.empty() ? "default" : s;
}

pool::HostSegment HostAllocProvider::allocate(std::size_t bytes, int numa_node) {
  void* p = nullptr;
  if (numa_node >= 0) {
    pool::ScopedThreadNodePolicy on_node(numa_node);
    p = rt::host_alloc(bytes, flags_ | rt::kHostNumaUser);
  } else {
    p = rt::host_alloc(bytes, flags_);
  }
  pool::HostSegment segment{p, nullptr};
  ask_device_address(*this, segment, bytes, flags_);
  return segment;
}

void HostAllocProvider::release(const pool::HostSegment& segment, std::size_t) noexcept {
  try {
    rt::host_free(segment.host);
  } catch (...) {  // nothing sensible to do: the memory is the runtime's now
  }
}

std::string HostAllocProvider::describe() const { return "hipHostMalloc(" + describe_host_flags(flags_) + ")"; }

pool::HostSegment HostRegisterProvider::allocate(std::size_t bytes, int numa_node) {
  const std::size_t size = pool::round_up(bytes, kHugePage);
  char* p = static_cast<char*>(std::aligned_alloc(kHugePage, size));
  if (p == nullptr)
    throw std::runtime_error("aligned_alloc: out of host memory for " + std::to_string(size) + " bytes");
  try {
    if (numa_node >= 0) pool::bind_to_node(p, size, numa_node);  // before the first touch places the pages
    pool::touch_pages(p, size, threads_);
    rt::host_register(p, size, flags_);
  } catch (...) {
    std::free(p);
    throw;
  }
  pool::HostSegment segment{p, nullptr};
  ask_device_address(*this, segment, size, flags_);
  return segment;
}

void HostRegisterProvider::release(const pool::HostSegment& segment, std::size_t) noexcept {
  try {
    rt::host_unregister(segment.host);
  } catch (...) {
  }
  std::free(segment.host);
}

std::string HostRegisterProvider::describe() const {
  return "hipHostRegister(" + describe_host_flags(flags_) + ", " + std::to_string(threads_) + " threads)";
}

std::unique_ptr<rt::Event> RuntimeEventSource::take(int device) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (device < static_cast<int>(free_.size()) && !free_[device].empty()) {
    auto e = std::move(free_[device].back());
    free_[device].pop_back();
    return e;
  }
  return nullptr;
}

void RuntimeEventSource::give_back(std::unique_ptr<rt::Event> event, int device) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (device >= static_cast<int>(free_.size())) free_.resize(device + 1);
  free_[device].push_back(std::move(event));
}

std::unique_ptr<pool::UseEvent> RuntimeEventSource::record(const pool::StreamUse& use) {
  // Whoever frees a block records: its current device may not be the stream's
  // (and a nullptr stream means the current device's default stream).
  rt::DeviceGuard guard(use.device);
  auto event = take(use.device);
  if (!event) event = std::make_unique<rt::Event>(use.device, /*timing=*/false);
  event->record(use.stream);
  return std::make_unique<RuntimeUseEvent>(this, std::move(event), use.device);
}

std::unique_ptr<pool::HostMemoryProvider> make_host_memory_provider(const std::string& kind, unsigned flags,
                                                                    int register_threads) {
  // Ordinary memory is readable by the "device" only when that is the CPU.
  if (kind == "pageable") return std::make_unique<pool::AlignedHostMemoryProvider>(rt::device_count() == 0);
  if (kind == "host_alloc") return std::make_unique<HostAllocProvider>(flags);
  if (kind == "register") return std::make_unique<HostRegisterProvider>(flags, register_threads);
  if (kind == "auto") {
    if (rt::device_count() == 0) return std::make_unique<pool::AlignedHostMemoryProvider>(true);
    return std::make_unique<HostAllocProvider>(flags);
  }
  std::string choices;
  for (std::size_t i = 0; i < kHostMemoryProviders.size(); ++i) {
    choices += (i == 0 ? "'" : i + 1 == kHostMemoryProviders.size() ? " or '" : ", '");
    choices += std::string(kHostMemoryProviders[i]) + "'";
  }
  throw std::invalid_argument("hipferry pinned pool: provider must be " + choices + ", got '" + kind + "'");
}

namespace {

// Uses on the transfer worker (StreamUse{-1, SerialWorker*}) get worker
// events; uses on GPU streams get runtime events (or, without a GPU, events
// that are complete at once: nothing asynchronous runs there).
class StreamOrWorkerEventSource : public pool::UseEventSource {
 public:
  StreamOrWorkerEventSource() {
    if (rt::device_count() == 0) {
      streams_ = std::make_unique<pool::CompletedEventSource>();
    } else {
      streams_ = std::make_unique<RuntimeEventSource>();
    }
  }
  std::unique_ptr<pool::UseEvent> record(const pool::StreamUse& use) override {
    return use.device < 0 ? workers_.record(use) : streams_->record(use);
  }

 private:
  transfer::WorkerEventSource workers_;
  std::unique_ptr<pool::UseEventSource> streams_;
};

}  // namespace

std::unique_ptr<pool::UseEventSource> make_use_event_source() { return std::make_unique<StreamOrWorkerEventSource>(); }

}  // namespace hipferry
