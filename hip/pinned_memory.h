// The pinned pool's backends on the runtime layer: where segments come from
// (hipHostMalloc or hipHostRegister) and how stream use is tracked (runtime
// events). Vendor-free like runtime.h; the torch glue picks one by name.
#pragma once

#include <array>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "csrc/core/host_pool/host_memory_provider.h"
#include "hip/runtime.h"

namespace hipferry {

// hipHostMalloc(flags); the device address is asked of the runtime when mapped.
class HostAllocProvider : public pool::HostMemoryProvider {
 public:
  explicit HostAllocProvider(unsigned flags) : flags_(flags) {}
  // numa_node >= 0: pages from that node (the runtime's NUMA-user flag, under
  // a thread policy for the node).
  pool::HostSegment allocate(std::size_t bytes, int numa_node) override;
  void release(const pool::HostSegment& segment, std::size_t bytes) noexcept override;
  std::string describe() const override;

 private:
  unsigned flags_;  // rt::HostAllocFlags
};

// Ordinary memory, its pages first touched by `threads` threads in parallel
// (the driver's own page-in is single-threaded; PyTorch's
// pinned_num_register_threads does the same), then hipHostRegister(flags).
class HostRegisterProvider : public pool::HostMemoryProvider {
 public:
  HostRegisterProvider(unsigned flags, int threads) : flags_(flags), threads_(threads) {}
  // numa_node >= 0: pages bound to that node before they are touched.
  pool::HostSegment allocate(std::size_t bytes, int numa_node) override;
  void release(const pool::HostSegment& segment, std::size_t bytes) noexcept override;
  std::string describe() const override;

 private:
  unsigned flags_;  // kHostPortable | kHostMapped subset
  int threads_;
};

// Events recorded on the streams that used a block. Created events are kept
// per device for reuse: event creation is a runtime call.
class RuntimeEventSource : public pool::UseEventSource {
 public:
  std::unique_ptr<pool::UseEvent> record(const pool::StreamUse& use) override;
  void give_back(std::unique_ptr<rt::Event> event, int device);

 private:
  std::unique_ptr<rt::Event> take(int device);
  std::mutex mutex_;  // guards free_; held only to move pointers, never across runtime calls
  std::vector<std::vector<std::unique_ptr<rt::Event>>> free_;  // by device
};

// The providers by name (hipferry._C.HOST_MEMORY_PROVIDERS, which PinnedPool checks against):
// "auto" (hipHostMalloc when a device is present, else ordinary memory),
// "host_alloc", "register" or "pageable".
inline constexpr std::array<const char*, 4> kHostMemoryProviders = {"auto", "host_alloc", "register", "pageable"};
// One of kHostMemoryProviders. Throws std::invalid_argument naming the
// choices for anything else.
std::unique_ptr<pool::HostMemoryProvider> make_host_memory_provider(const std::string& kind, unsigned flags,
                                                                    int register_threads);
// Uses on a transfer worker (device -1) get worker events; stream uses get
// runtime events when a device is present, else events that are always complete.
std::unique_ptr<pool::UseEventSource> make_use_event_source();

// "portable|mapped" for a flag set.
std::string describe_host_flags(unsigned flags);

}  // namespace hipferry
