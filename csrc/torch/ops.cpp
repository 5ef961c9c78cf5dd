// Every hipferry op schema, declared once. Backends register kernels for their
// dispatch key only: copy_cast_cpu.cpp (CPU, Meta), copy_cast_gpu.cpp (CUDA,
// which is also HIP on ROCm builds of torch).
#include <torch/library.h>

TORCH_LIBRARY(hipferry, m) {
  // Writes src converted to dst.dtype into dst. src and dst may be on different
  // devices (host<->device through mapped pinned memory, or one device).
  m.def("copy_cast_(Tensor(a!) dst, Tensor src) -> ()");
}
