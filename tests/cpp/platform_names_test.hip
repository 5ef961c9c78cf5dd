// Uses every name platform.h provides, compiled by the GPU compiler of this
// build (hipcc for AMD, nvcc for NVIDIA). A name added to the header without a
// use here is untested; a mapping that is wrong fails to compile or fails here.
#include <gtest/gtest.h>

#include <cstring>

#include "hip/platform.h"

namespace {

__global__ void add_one(int* p) { p[threadIdx.x] += 1; }

// Compiles only if every mapped name exists with a compatible signature.
[[maybe_unused]] void every_name_compiles() {
  hipError_t err = hipSuccess;
  (void)hipErrorNotReady;
  (void)hipErrorNoDevice;
  (void)hipGetErrorName(err);
  (void)hipGetErrorString(err);
  (void)hipGetLastError();
  int v = 0;
  (void)hipRuntimeGetVersion(&v);
  (void)hipDriverGetVersion(&v);
  hipDeviceProp_t prop;
  (void)hipGetDeviceCount(&v);
  (void)hipGetDevice(&v);
  (void)hipSetDevice(0);
  (void)hipGetDeviceProperties(&prop, 0);
  char buf[32];
  (void)hipferry_arch_name(prop, buf, sizeof buf);
  std::size_t a = 0, b = 0;
  (void)hipMemGetInfo(&a, &b);
  (void)hipDeviceSynchronize();
  hipStream_t s;
  hipEvent_t e;
  (void)hipStreamCreateWithFlags(&s, hipStreamNonBlocking);
  (void)hipEventCreateWithFlags(&e, hipEventDefault | hipEventDisableTiming);
  (void)hipEventRecord(e, s);
  (void)hipEventQuery(e);
  (void)hipEventSynchronize(e);
  float ms;
  (void)hipEventElapsedTime(&ms, e, e);
  (void)hipStreamWaitEvent(s, e, 0);
  (void)hipStreamQuery(s);
  (void)hipStreamSynchronize(s);
  (void)hipEventDestroy(e);
  (void)hipStreamDestroy(s);
  void* p = nullptr;
  (void)hipHostMalloc(&p, 16,
                      hipHostMallocDefault | hipHostMallocPortable | hipHostMallocMapped | hipHostMallocWriteCombined |
                          hipHostMallocNumaUser | hipHostMallocCoherent | hipHostMallocNonCoherent);
  void* dp = nullptr;
  (void)hipHostGetDevicePointer(&dp, p, 0);
  (void)hipHostFree(p);
  (void)hipHostRegister(p, 16, hipHostRegisterDefault | hipHostRegisterPortable | hipHostRegisterMapped);
  (void)hipHostUnregister(p);
  (void)hipMalloc(&p, 16);
  (void)hipMemcpy(p, dp, 16, hipMemcpyDefault);
  (void)hipMemcpyAsync(p, dp, 16, hipMemcpyDefault, s);
  (void)hipFree(p);
  add_one<<<1, 1, 0, s>>>(static_cast<int*>(p));
  void* dsts[1] = {p};
  const void* srcs[1] = {dp};
  const std::size_t sizes[1] = {16};
  const hipError_t batch = hipferry_memcpy_batch_async(dsts, srcs, sizes, 1, s);
  (void)(batch == hipErrorNotSupported);
}

TEST(Platform, NameIsKnown) {
  EXPECT_TRUE(std::strcmp(HIPFERRY_PLATFORM_NAME, "rocm") == 0 || std::strcmp(HIPFERRY_PLATFORM_NAME, "cuda") == 0);
}

TEST(Platform, DeviceCountReportsNoDeviceOrRunsAKernel) {
  int n = 0;
  const hipError_t err = hipGetDeviceCount(&n);
  if (err != hipSuccess) {
    // No device (or no driver): the runtime must say so, not crash.
    EXPECT_TRUE(err == hipErrorNoDevice || n == 0) << hipGetErrorName(err);
    (void)hipGetLastError();
    GTEST_SKIP() << "no device: " << hipGetErrorName(err);
  }
  if (n == 0) GTEST_SKIP() << "no device";
  int* d = nullptr;
  ASSERT_EQ(hipMalloc(&d, 32 * sizeof(int)), hipSuccess);
  int host[32] = {};
  for (int i = 0; i < 32; ++i) host[i] = i;
  ASSERT_EQ(hipMemcpy(d, host, sizeof host, hipMemcpyDefault), hipSuccess);
  add_one<<<1, 32>>>(d);
  ASSERT_EQ(hipGetLastError(), hipSuccess);
  ASSERT_EQ(hipMemcpy(host, d, sizeof host, hipMemcpyDefault), hipSuccess);
  for (int i = 0; i < 32; ++i) EXPECT_EQ(host[i], i + 1);
  (void)hipFree(d);
}

}  // namespace
