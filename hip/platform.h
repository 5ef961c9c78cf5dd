// hipferry's ONLY vendor switch. Every AMD/NVIDIA difference lives here; the
// rest of the tree writes HIP names and compiles for both.
//
// AMD (HIPFERRY_PLATFORM_CUDA undefined): the HIP runtime itself.
// NVIDIA (CMake defines HIPFERRY_PLATFORM_CUDA): the CUDA runtime, with the
// few hip* names hipferry uses mapped onto it. Every name below is used by
// tests/cpp/platform_names_test.hip, compiled for both vendors in CI, so the
// list cannot grow without a test.
#pragma once

#if !defined(HIPFERRY_PLATFORM_CUDA)

#include <hip/hip_runtime.h>

#define HIPFERRY_PLATFORM_NAME "rocm"
// HIP reports the gfx target directly, e.g. "gfx90a:sramecc+:xnack-".
inline const char* hipferry_arch_name(const hipDeviceProp_t& p, char*, int) { return p.gcnArchName; }

// Many copies in one runtime call: hipferry binds no batched copy of HIP's
// (whether to use one is the transfer engine's choice: BatchedCopy in
// csrc/torch/transfer_paths.h), so the call reports "not supported".
inline hipError_t hipferry_memcpy_batch_async(void* const*, const void* const*, const size_t*, size_t, hipStream_t) {
  return hipErrorNotSupported;
}

#else  // NVIDIA

#include <cuda_runtime.h>
#include <cstdio>

#define HIPFERRY_PLATFORM_NAME "cuda"

// Errors and versions.
using hipError_t = cudaError_t;
#define hipSuccess cudaSuccess
#define hipErrorNotReady cudaErrorNotReady
#define hipErrorNoDevice cudaErrorNoDevice
#define hipGetErrorName cudaGetErrorName
#define hipGetErrorString cudaGetErrorString
#define hipGetLastError cudaGetLastError
#define hipRuntimeGetVersion cudaRuntimeGetVersion
#define hipDriverGetVersion cudaDriverGetVersion

// Devices.
using hipDeviceProp_t = cudaDeviceProp;
#define hipGetDeviceCount cudaGetDeviceCount
#define hipGetDevice cudaGetDevice
#define hipSetDevice cudaSetDevice
#define hipGetDeviceProperties cudaGetDeviceProperties
#define hipMemGetInfo cudaMemGetInfo
#define hipDeviceSynchronize cudaDeviceSynchronize

// Streams and events.
using hipStream_t = cudaStream_t;
using hipEvent_t = cudaEvent_t;
#define hipStreamNonBlocking cudaStreamNonBlocking
#define hipStreamCreateWithFlags cudaStreamCreateWithFlags
#define hipStreamDestroy cudaStreamDestroy
#define hipStreamSynchronize cudaStreamSynchronize
#define hipStreamQuery cudaStreamQuery
#define hipStreamWaitEvent cudaStreamWaitEvent
#define hipEventDefault cudaEventDefault
#define hipEventDisableTiming cudaEventDisableTiming
#define hipEventCreateWithFlags cudaEventCreateWithFlags
#define hipEventDestroy cudaEventDestroy
#define hipEventRecord cudaEventRecord
#define hipEventQuery cudaEventQuery
#define hipEventSynchronize cudaEventSynchronize
#define hipEventElapsedTime cudaEventElapsedTime

// Memory. Coherence and NUMA flags are AMD-only; on NVIDIA they are no-ops.
#define hipHostMallocDefault cudaHostAllocDefault
#define hipHostMallocPortable cudaHostAllocPortable
#define hipHostMallocMapped cudaHostAllocMapped
#define hipHostMallocWriteCombined cudaHostAllocWriteCombined
#define hipHostMallocNumaUser 0u
#define hipHostMallocCoherent 0u
#define hipHostMallocNonCoherent 0u
#define hipHostMalloc cudaHostAlloc
#define hipHostFree cudaFreeHost
#define hipHostRegisterDefault cudaHostRegisterDefault
#define hipHostRegisterPortable cudaHostRegisterPortable
#define hipHostRegisterMapped cudaHostRegisterMapped
#define hipHostRegister cudaHostRegister
#define hipHostUnregister cudaHostUnregister
#define hipHostGetDevicePointer cudaHostGetDevicePointer
#define hipMalloc cudaMalloc
#define hipFree cudaFree
#define hipMemcpy cudaMemcpy
#define hipMemcpyAsync cudaMemcpyAsync
#define hipMemcpyDefault cudaMemcpyDefault

#define hipErrorNotSupported cudaErrorNotSupported

// Many copies in one runtime call: cudaMemcpyBatchAsync (CUDA 12.8+; 13.0
// made its pointers const and dropped the failIdx argument). Each copy may
// start as soon as the stream reaches the batch. Errors that mean "not here"
// (no such call in this driver, attributes it rejects) come back as
// hipErrorNotSupported: the call validates before queuing anything.
inline hipError_t hipferry_memcpy_batch_async(void* const* dsts, const void* const* srcs, const size_t* sizes,
                                              size_t count, hipStream_t stream) {
#if CUDART_VERSION >= 12080
  cudaMemcpyAttributes attr = {};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  size_t attr_index = 0;
#if CUDART_VERSION >= 13000
  const cudaError_t err = cudaMemcpyBatchAsync(dsts, srcs, sizes, count, &attr, &attr_index, 1, stream);
#else
  size_t fail_index = 0;
  const cudaError_t err =
      cudaMemcpyBatchAsync(const_cast<void**>(dsts), const_cast<void**>(srcs), const_cast<size_t*>(sizes), count, &attr,
                           &attr_index, 1, &fail_index, stream);
#endif
  if (err == cudaErrorCallRequiresNewerDriver || err == cudaErrorInvalidValue || err == cudaErrorNotSupported) {
    (void)cudaGetLastError();
    return cudaErrorNotSupported;
  }
  return err;
#else
  (void)dsts, (void)srcs, (void)sizes, (void)count, (void)stream;
  return cudaErrorNotSupported;
#endif
}

// CUDA reports compute capability; name it like the compiler does ("sm_90").
inline const char* hipferry_arch_name(const hipDeviceProp_t& p, char* buf, int len) {
  std::snprintf(buf, len, "sm_%d%d", p.major, p.minor);
  return buf;
}

#endif
