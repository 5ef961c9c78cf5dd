// hipferry::adamw_step_ and hipferry::bits_equal for the CUDA dispatch key
// (also HIP on ROCm builds of torch): the same kernels as on the CPU
// (adamw_step.cpp), which launch the GPU kernel on the current stream for GPU
// tensors. bits_equal compares host memory only: registered here so that a GPU
// tensor gets its error naming the argument, not the dispatcher's.
#include <torch/csrc/stable/library.h>

#include "csrc/torch/adamw_step.h"

STABLE_TORCH_LIBRARY_IMPL(hipferry, CUDA, m) {
  m.impl("adamw_step_", TORCH_BOX(&hipferry::adamw_step_op));
  m.impl("bits_equal", TORCH_BOX(&hipferry::bits_equal_op));
}
