// Every hipferry op schema, declared once. Backends register kernels for their
// dispatch key only: copy_cast_cpu.cpp (CPU), copy_cast_gpu.cpp (CUDA, which
// is also HIP on ROCm builds of torch), pinned_pool.cpp (no tensor inputs:
// CompositeExplicitAutograd). Fake kernels are in python/hipferry/. All are
// registered through the stable ABI (STABLE_TORCH_LIBRARY).
#include <torch/csrc/stable/library.h>

STABLE_TORCH_LIBRARY(hipferry, m) {
  // Writes src converted to dst.dtype into dst. src and dst may be on different
  // devices (host<->device through mapped pinned memory, or one device).
  m.def("copy_cast_(Tensor(a!) dst, Tensor src) -> ()");
  // A CPU tensor whose storage is a block of the pinned pool `pool` (an id
  // from hipferry._C.create_pinned_pool); the block returns when it dies.
  // for_device: the GPU whose copies will use it (its pages come from that
  // GPU's NUMA node); -1: the current GPU.
  m.def("pool_empty(int pool, int[] size, ScalarType dtype, int for_device=-1) -> Tensor");
}
