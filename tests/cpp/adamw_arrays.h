// Test helper: the AdamW step's arrays over plain float32 vectors, in place (the fields left
// out keep AdamWArrays' defaults: float32 gradient, no param_out, no out-of-place inputs).
#pragma once

#include "csrc/core/optim/adamw_cpu.h"

namespace hipferry::optim {

// x is amsgrad's running maximum of v (read only with amsgrad).
inline AdamWArrays float32_arrays(float* p, const void* g, float* m, float* v, float* x) {
  AdamWArrays a;
  a.param = p;
  a.grad = g;
  a.exp_avg = m;
  a.exp_avg_sq = v;
  a.max_exp_avg_sq = x;
  return a;
}

}  // namespace hipferry::optim
