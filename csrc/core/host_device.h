// HIPFERRY_HD marks the element-wise functions that are compiled both for the
// host (the CPU loops, GoogleTest) and for the device (the HIP/CUDA kernels).
// This is a compiler check, not a vendor check: hipcc and nvcc both define
// __host__/__device__ (GPU sources include hip/platform.h first, which brings
// them in), a plain C++ compiler sees an ordinary inline function.
#pragma once

#if defined(__HIPCC__) || defined(__CUDACC__)
#define HIPFERRY_HD __host__ __device__ inline
#else
// Forced inline on the host: the CPU loops vectorize only with the element
// function inlined, and GCC's inliner gives up on it once a file holds many
// instances of a loop (it did at 5 template dimensions x 3 ISA builds).
#define HIPFERRY_HD inline __attribute__((always_inline))
#endif
