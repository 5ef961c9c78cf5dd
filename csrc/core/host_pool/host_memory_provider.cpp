// The defaults behind HostMemoryProvider and UseEventSource (host_memory_provider.h): page-aligned
// malloc'd memory, bound to a NUMA node when asked, and events that are complete when recorded.
#include "csrc/core/host_pool/host_memory_provider.h"

#include <cstdlib>
#include <memory>
#include <stdexcept>

#include "csrc/core/host_pool/format_bytes.h"
#include "csrc/core/host_pool/numa_binding.h"
#include "csrc/core/host_pool/size_classes.h"

namespace hipferry::pool {
namespace {

class CompletedEvent : public UseEvent {
 public:
  bool query() override { return true; }
  void synchronize() override {}
};

}  // namespace

HostSegment AlignedHostMemoryProvider::allocate(std::size_t bytes, int numa_node) {
  void* p = std::aligned_alloc(4096, round_up(bytes, 4096));
  if (p == nullptr) throw std::runtime_error("aligned_alloc: out of host memory for " + format_bytes(bytes));
  if (numa_node >= 0) {
    try {
      bind_to_node(p, round_up(bytes, 4096), numa_node);
    } catch (...) {
      std::free(p);
      throw;
    }
  }
  return {p, mapped_ ? p : nullptr};
}

void AlignedHostMemoryProvider::release(const HostSegment& segment, std::size_t) noexcept { std::free(segment.host); }

std::unique_ptr<UseEvent> CompletedEventSource::record(const StreamUse&) { return std::make_unique<CompletedEvent>(); }

}  // namespace hipferry::pool
