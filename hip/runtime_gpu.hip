// runtime.h for HIP (AMD) and CUDA (NVIDIA), one source through platform.h.
#include <cstdio>
#include <string>

#include "hip/check.h"
#include "hip/platform.h"
#include "hip/runtime.h"

#ifndef HIPFERRY_GPU_ARCHITECTURES
#error "the build must define HIPFERRY_GPU_ARCHITECTURES"
#endif

namespace hipferry::rt {
namespace {

// Makes `device` current for the scope; restores the previous one after.
hipStream_t native(StreamHandle s) { return static_cast<hipStream_t>(s); }

}  // namespace

BuildInfo build_info() {
  BuildInfo info{HIPFERRY_PLATFORM_NAME, HIPFERRY_GPU_ARCHITECTURES, 0, 0};
  (void)hipRuntimeGetVersion(&info.runtime_version);
  if (hipDriverGetVersion(&info.driver_version) != hipSuccess) {
    info.driver_version = 0;
    (void)hipGetLastError();
  }
  return info;
}

int device_count() {
  int n = 0;
  if (hipGetDeviceCount(&n) != hipSuccess) {  // no device, no driver
    (void)hipGetLastError();
    return 0;
  }
  return n;
}

DeviceInfo device_info(int device) {
  hipDeviceProp_t p;
  HIPFERRY_CHECK_ON(device, hipGetDeviceProperties(&p, device));
  DeviceInfo info;
  info.index = device;
  info.name = p.name;
  char arch[64];
  info.arch = hipferry_arch_name(p, arch, sizeof arch);
  info.total_memory = p.totalGlobalMem;
  info.multiprocessors = p.multiProcessorCount;
  info.can_map_host_memory = p.canMapHostMemory != 0;
  char pci[32];
  std::snprintf(pci, sizeof pci, "%04x:%02x:%02x.0", static_cast<unsigned>(p.pciDomainID),
                static_cast<unsigned>(p.pciBusID), static_cast<unsigned>(p.pciDeviceID));
  info.pci_bus_id = pci;
  DeviceGuard scope(device);
  std::size_t free_bytes = 0, total_bytes = 0;
  HIPFERRY_CHECK_ON(device, hipMemGetInfo(&free_bytes, &total_bytes));
  info.free_memory = free_bytes;
  return info;
}

DeviceGuard::DeviceGuard(int device) : previous_(current_device_or_minus_one()) {
  if (device != previous_) HIPFERRY_CHECK_ON(device, hipSetDevice(device));
  if (device == previous_) previous_ = -1;
}

DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0) (void)hipSetDevice(previous_);
}

void stream_synchronize(StreamHandle stream, int device) {
  DeviceGuard scope(device);
  HIPFERRY_CHECK_ON(device, hipStreamSynchronize(native(stream)));
}

int current_device() {
  int d = 0;
  HIPFERRY_CHECK_ON(-1, hipGetDevice(&d));
  return d;
}

void set_device(int device) { HIPFERRY_CHECK_ON(device, hipSetDevice(device)); }

Stream::Stream(int device) : device_(device), handle_(nullptr) {
  DeviceGuard scope(device);
  hipStream_t s;
  HIPFERRY_CHECK_ON(device, hipStreamCreateWithFlags(&s, hipStreamNonBlocking));
  handle_ = s;
}

Stream::~Stream() { (void)hipStreamDestroy(native(handle_)); }

bool Stream::query() const {
  const hipError_t err = hipStreamQuery(native(handle_));
  if (err == hipErrorNotReady) {
    (void)hipGetLastError();
    return false;
  }
  HIPFERRY_CHECK_ON(device_, err);
  return true;
}

void Stream::synchronize() const { HIPFERRY_CHECK_ON(device_, hipStreamSynchronize(native(handle_))); }

Event::Event(int device, bool timing) : device_(device), handle_(nullptr) {
  DeviceGuard scope(device);
  hipEvent_t e;
  HIPFERRY_CHECK_ON(device, hipEventCreateWithFlags(&e, timing ? hipEventDefault : hipEventDisableTiming));
  handle_ = e;
}

Event::~Event() { (void)hipEventDestroy(static_cast<hipEvent_t>(handle_)); }

void Event::record(StreamHandle stream) {
  HIPFERRY_CHECK_ON(device_, hipEventRecord(static_cast<hipEvent_t>(handle_), native(stream)));
}

bool Event::query() const {
  const hipError_t err = hipEventQuery(static_cast<hipEvent_t>(handle_));
  if (err == hipErrorNotReady) {
    (void)hipGetLastError();
    return false;
  }
  HIPFERRY_CHECK_ON(device_, err);
  return true;
}

void Event::synchronize() const { HIPFERRY_CHECK_ON(device_, hipEventSynchronize(static_cast<hipEvent_t>(handle_))); }

void Event::block_stream(StreamHandle stream) const {
  HIPFERRY_CHECK_ON(device_, hipStreamWaitEvent(native(stream), static_cast<hipEvent_t>(handle_), 0));
}

float Event::elapsed_ms(const Event& start, const Event& end) {
  float ms = 0.f;
  HIPFERRY_CHECK_ON(start.device_, hipEventElapsedTime(&ms, static_cast<hipEvent_t>(start.handle_),
                                                       static_cast<hipEvent_t>(end.handle_)));
  return ms;
}

void* host_alloc(std::size_t bytes, unsigned flags) {
  // Each requested flag is translated; flags the vendor lacks map to 0.
  unsigned native_flags = hipHostMallocDefault;
  if (flags & kHostPortable) native_flags |= hipHostMallocPortable;
  if (flags & kHostMapped) native_flags |= hipHostMallocMapped;
  if (flags & kHostWriteCombined) native_flags |= hipHostMallocWriteCombined;
  if (flags & kHostNumaUser) native_flags |= hipHostMallocNumaUser;
  if (flags & kHostCoherent) native_flags |= hipHostMallocCoherent;
  if (flags & kHostNonCoherent) native_flags |= hipHostMallocNonCoherent;
  void* p = nullptr;
  HIPFERRY_CHECK(hipHostMalloc(&p, bytes, native_flags));
  return p;
}

void host_free(void* ptr) { HIPFERRY_CHECK(hipHostFree(ptr)); }

void host_register(void* ptr, std::size_t bytes, unsigned flags) {
  unsigned native_flags = hipHostRegisterDefault;
  if (flags & kHostPortable) native_flags |= hipHostRegisterPortable;
  if (flags & kHostMapped) native_flags |= hipHostRegisterMapped;
  HIPFERRY_CHECK(hipHostRegister(ptr, bytes, native_flags));
}

void host_unregister(void* ptr) { HIPFERRY_CHECK(hipHostUnregister(ptr)); }

void* host_device_pointer(void* host_ptr) {
  void* device_ptr = nullptr;
  HIPFERRY_CHECK(hipHostGetDevicePointer(&device_ptr, host_ptr, 0));
  return device_ptr;
}

void* host_device_pointer_or_null(void* host_ptr) noexcept {
  void* device_ptr = nullptr;
  if (hipHostGetDevicePointer(&device_ptr, host_ptr, 0) != hipSuccess) {
    (void)hipGetLastError();  // not pinned: not an error for the caller
    return nullptr;
  }
  return device_ptr;
}

void* device_alloc(std::size_t bytes, int device) {
  DeviceGuard scope(device);
  void* p = nullptr;
  HIPFERRY_CHECK_ON(device, hipMalloc(&p, bytes));
  return p;
}

void device_free(void* ptr, int device) {
  DeviceGuard scope(device);
  HIPFERRY_CHECK_ON(device, hipFree(ptr));
}

void memcpy_async(void* dst, const void* src, std::size_t bytes, StreamHandle stream) {
  HIPFERRY_CHECK(hipMemcpyAsync(dst, src, bytes, hipMemcpyDefault, native(stream)));
}

bool memcpy_batch_async(void* const* dsts, const void* const* srcs, const std::size_t* sizes, std::size_t count,
                        StreamHandle stream) {
  if (count == 0) return true;
  const hipError_t err = hipferry_memcpy_batch_async(dsts, srcs, sizes, count, native(stream));
  if (err == hipErrorNotSupported) {
    (void)hipGetLastError();
    return false;
  }
  HIPFERRY_CHECK(err);
  return true;
}

void memcpy_sync(void* dst, const void* src, std::size_t bytes) {
  HIPFERRY_CHECK(hipMemcpy(dst, src, bytes, hipMemcpyDefault));
}

}  // namespace hipferry::rt
