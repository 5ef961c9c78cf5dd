// Where the pinned pool's segments come from, and how it learns when
// asynchronous work on a block is done. Both are interfaces so the pool stays
// torch-free and GPU-free: the GPU build plugs in hipHostMalloc /
// hipHostRegister and runtime events (hip/pinned_memory.h), the CPU build and
// the tests plug in ordinary memory and fake events.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

namespace hipferry::pool {

// One segment of host memory.
// No NUMA preference: the system's default placement (first touch).
constexpr int kNoNumaNode = -1;

struct HostSegment {
  void* host = nullptr;    // host address, aligned to a page (4096 bytes) at least
  void* device = nullptr;  // device address of mapped memory, nullptr when not mapped
};

class HostMemoryProvider {
 public:
  virtual ~HostMemoryProvider() = default;
  // `bytes` of (page-locked, where the provider pins) memory, its pages on
  // NUMA node `numa_node` (kNoNumaNode: wherever the system puts them).
  // Throws on failure; the message says what the system or runtime said.
  virtual HostSegment allocate(std::size_t bytes, int numa_node) = 0;
  // Gives back a segment from allocate() with the same `bytes`. Must not throw.
  virtual void release(const HostSegment& segment, std::size_t bytes) noexcept = 0;
  // "hipHostMalloc(portable|mapped)", for stats and error messages.
  virtual std::string describe() const = 0;
};

// A stream that used a block: opaque to the pool, meaningful to the event source.
struct StreamUse {
  int device = 0;
  void* stream = nullptr;
  bool operator==(const StreamUse& o) const { return device == o.device && stream == o.stream; }
};

// Marks the point in a stream's work after which a block is no longer used.
class UseEvent {
 public:
  virtual ~UseEvent() = default;
  virtual bool query() = 0;        // true once the stream has passed the event
  virtual void synchronize() = 0;  // blocks the host until then
};

class UseEventSource {
 public:
  virtual ~UseEventSource() = default;
  // Records an event on `use.stream` now. Throws on a runtime failure.
  virtual std::unique_ptr<UseEvent> record(const StreamUse& use) = 0;
};

// Ordinary (pageable) aligned memory: the CPU-only build, GPU builds on a
// machine without a GPU, and the tests. `device` is the host address when
// `mapped` (on the CPU the "device" reads host memory directly).
class AlignedHostMemoryProvider : public HostMemoryProvider {
 public:
  explicit AlignedHostMemoryProvider(bool mapped = true) : mapped_(mapped) {}
  // A numa_node >= 0 binds the pages to it before anything touches them.
  HostSegment allocate(std::size_t bytes, int numa_node) override;
  void release(const HostSegment& segment, std::size_t bytes) noexcept override;
  std::string describe() const override { return "aligned host memory (not page-locked)"; }

 private:
  bool mapped_;
};

// Events for a build without asynchronous streams: always complete.
class CompletedEventSource : public UseEventSource {
 public:
  std::unique_ptr<UseEvent> record(const StreamUse& use) override;
};

}  // namespace hipferry::pool
