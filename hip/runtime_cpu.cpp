// runtime.h for the CPU-only build: there is no device. Host memory is
// page-aligned ordinary memory (the "device" is the CPU, so a host pointer is
// its own device pointer); streams and events complete immediately because
// every copy is done when memcpy returns.
#include <cstdlib>
#include <cstring>
#include <new>

#include "hip/runtime.h"

namespace hipferry::rt {
namespace {

constexpr std::size_t kPageSize = 4096;

[[noreturn]] void no_device(const char* call, int device) {
  throw Error(std::string("hipferry: ") + call + " failed on device " + std::to_string(device) +
              ": this is a CPU-only build of hipferry, it has no GPU devices");
}

}  // namespace

BuildInfo build_info() { return BuildInfo{"cpu", "", 0, 0}; }
int device_count() { return 0; }
DeviceInfo device_info(int device) { no_device("device_info", device); }
int current_device() { no_device("current_device", 0); }
void set_device(int device) { no_device("set_device", device); }

DeviceGuard::DeviceGuard(int) : previous_(-1) {}
DeviceGuard::~DeviceGuard() = default;
void stream_synchronize(StreamHandle, int) {}

Stream::Stream(int device) : device_(device), handle_(nullptr) { no_device("Stream", device); }
Stream::~Stream() = default;
bool Stream::query() const { return true; }
void Stream::synchronize() const {}

Event::Event(int device, bool) : device_(device), handle_(nullptr) { no_device("Event", device); }
Event::~Event() = default;
void Event::record(StreamHandle) {}
bool Event::query() const { return true; }
void Event::synchronize() const {}
void Event::block_stream(StreamHandle) const {}
float Event::elapsed_ms(const Event&, const Event&) { return 0.f; }

void* host_alloc(std::size_t bytes, unsigned) {
  const std::size_t rounded = (bytes + kPageSize - 1) / kPageSize * kPageSize;
  void* p = std::aligned_alloc(kPageSize, rounded == 0 ? kPageSize : rounded);
  if (p == nullptr) {
    throw Error("hipferry: host_alloc failed: out of host memory for " + std::to_string(bytes) + " bytes");
  }
  return p;
}
void host_free(void* ptr) { std::free(ptr); }
void host_register(void*, std::size_t, unsigned) {}
void host_unregister(void*) {}
void* host_device_pointer(void* host_ptr) { return host_ptr; }
void* host_device_pointer_or_null(void* host_ptr) noexcept { return host_ptr; }

void* device_alloc(std::size_t, int device) { no_device("device_alloc", device); }
void device_free(void*, int device) { no_device("device_free", device); }

void memcpy_async(void* dst, const void* src, std::size_t bytes, StreamHandle) { std::memcpy(dst, src, bytes); }
bool memcpy_batch_async(void* const* dsts, const void* const* srcs, const std::size_t* sizes, std::size_t count,
                        StreamHandle) {
  for (std::size_t i = 0; i < count; ++i) std::memcpy(dsts[i], srcs[i], sizes[i]);
  return true;
}
void memcpy_sync(void* dst, const void* src, std::size_t bytes) { std::memcpy(dst, src, bytes); }

}  // namespace hipferry::rt
