// hipferry's runtime layer: devices, streams, events, host memory and copies.
//
// Vendor-free: this header includes no GPU header, so torch glue and tests
// compiled by a plain C++ compiler use it. Two implementations exist and the
// build links exactly one:
//   runtime_gpu.hip  HIP on AMD, CUDA on NVIDIA (through platform.h)
//   runtime_cpu.cpp  CPU-only build: no devices; host memory is page-aligned
//                    ordinary memory; streams and events are always complete.
// A GPU build on a machine without a GPU reports device_count() == 0 and
// throws rt::Error (naming the call and the error) from anything that needs one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace hipferry::rt {

// Thrown for every failed runtime call: "hipMemcpyAsync failed on device 0:
// invalid argument (cudaErrorInvalidValue)".
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// What this binary was built for.
struct BuildInfo {
  std::string platform;       // "rocm", "cuda" or "cpu"
  std::string architectures;  // ";"-separated list compiled for, "" for cpu
  int runtime_version;        // HIP/CUDA runtime version (0 for cpu)
  int driver_version;         // 0 when there is no driver
};
BuildInfo build_info();

struct DeviceInfo {
  int index;
  std::string name;
  std::string arch;          // "gfx90a:sramecc+:xnack-", "sm_90"
  std::size_t total_memory;  // bytes
  std::size_t free_memory;   // bytes, at the time of the call
  int multiprocessors;       // CUs on AMD, SMs on NVIDIA
  bool can_map_host_memory;  // pinned host memory readable by kernels
  std::string pci_bus_id;    // "0000:65:00.0" (sysfs spelling: its NUMA node is under /sys/bus/pci/devices)
};

int device_count();  // 0 when no device (or no driver); never throws for that
DeviceInfo device_info(int device);
int current_device();
void set_device(int device);

// A native stream handle (hipStream_t / cudaStream_t). nullptr is the default
// stream of the current device.
using StreamHandle = void*;

// Makes `device` current for the guard's lifetime. Needed around calls that
// take a stream handle which may be nullptr (the default stream of the
// CURRENT device) and around kernel launches. No-op on the CPU-only build.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_;  // -1: nothing to restore
};

// Blocks until all work queued on `stream` of `device` has completed.
void stream_synchronize(StreamHandle stream, int device);

// An owned, non-blocking stream on one device.
class Stream {
 public:
  explicit Stream(int device);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  StreamHandle handle() const { return handle_; }
  int device() const { return device_; }
  bool query() const;  // true when all queued work has completed
  void synchronize() const;

 private:
  int device_;
  StreamHandle handle_;
};

// An owned event. Timing events can measure elapsed time between two records.
class Event {
 public:
  explicit Event(int device, bool timing = false);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void record(StreamHandle stream);
  bool query() const;  // true when the recorded work has completed
  void synchronize() const;
  void block_stream(StreamHandle stream) const;  // stream waits for this event
  // Milliseconds between two recorded, completed timing events.
  static float elapsed_ms(const Event& start, const Event& end);

 private:
  int device_;
  void* handle_;
};

// Host memory. The flag values are HIP's (field notes); the GPU runtime maps
// them to the vendor's, flags a vendor lacks are ignored there.
enum HostAllocFlags : unsigned {
  kHostDefault = 0x0,
  kHostPortable = 0x1,
  kHostMapped = 0x2,
  kHostWriteCombined = 0x4,
  kHostNumaUser = 0x20000000,
  kHostCoherent = 0x40000000,
  kHostNonCoherent = 0x80000000,
};
void* host_alloc(std::size_t bytes, unsigned flags);  // page-locked
void host_free(void* ptr);
// Page-locks existing memory (flags: kHostPortable | kHostMapped).
void host_register(void* ptr, std::size_t bytes, unsigned flags);
void host_unregister(void* ptr);
// Device address of mapped host memory; throws when `host_ptr` is not
// page-locked and mapped. Never assume it equals the host address (ROCm 7.2
// maps registered pages elsewhere), always ask.
void* host_device_pointer(void* host_ptr);
// The same, but nullptr for memory that is not page-locked and mapped (no
// exception: the transfer engine asks this of every source it is given).
void* host_device_pointer_or_null(void* host_ptr) noexcept;

// Device memory (tests and benchmarks; torch owns the tensors).
void* device_alloc(std::size_t bytes, int device);
void device_free(void* ptr, int device);

// Copies between any two addresses the runtime knows (unified addressing).
void memcpy_async(void* dst, const void* src, std::size_t bytes, StreamHandle stream);
// `count` such copies as ONE runtime call where the runtime has a working
// batched copy (CUDA 12.8+ with a driver that has it). Returns false, having
// queued nothing, where it does not (ROCm: see platform.h). The CPU-only build
// copies in place and returns true.
bool memcpy_batch_async(void* const* dsts, const void* const* srcs, const std::size_t* sizes, std::size_t count,
                        StreamHandle stream);
void memcpy_sync(void* dst, const void* src, std::size_t bytes);

}  // namespace hipferry::rt
