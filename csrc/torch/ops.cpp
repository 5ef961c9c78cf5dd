// Every hipferry op schema, declared once. Backends register kernels for their
// dispatch key only: copy_cast_cpu.cpp and adamw_step.cpp (CPU),
// copy_cast_gpu.cpp and adamw_step_gpu.cpp (CUDA, which is also HIP on ROCm
// builds of torch), pinned_pool.cpp (no tensor inputs:
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
  // GPU's NUMA node); -1: the current GPU. alignment: the block starts at a
  // multiple of it, 256 or 4096 (a page, whole pages: O_DIRECT's buffers).
  m.def("pool_empty(int pool, int[] size, ScalarType dtype, int for_device=-1, int alignment=256) -> Tensor");
  // One fused AdamW step over one parameter's flat state (float32; grad and
  // param_out also bfloat16 / float16): in place, or (param_in and the *_in
  // state given) reading those and writing param and the state. adopt_out: param_out is
  // the parameter itself, and what the user wrote there is taken as the master first.
  m.def(
      "adamw_step_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "Tensor(d!)? max_exp_avg_sq, Tensor(e!)? param_out, int step, float lr, float beta1, float beta2, "
      "float eps, float weight_decay, bool amsgrad, bool maximize, Tensor? param_in=None, "
      "Tensor? exp_avg_in=None, Tensor? exp_avg_sq_in=None, Tensor? max_exp_avg_sq_in=None, "
      "bool adopt_out=False) -> ()");
  // Whether two contiguous CPU tensors of as many bytes hold the same bytes.
  // Its result depends on the data: traced code cannot know it (the tag).
  m.def("bits_equal(Tensor a, Tensor b) -> bool", {at::Tag::data_dependent_output});
}
