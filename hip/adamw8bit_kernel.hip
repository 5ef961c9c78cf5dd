// platform.h first: it defines __host__/__device__ for the core headers.
#include "hip/platform.h"

#include <algorithm>

#include "csrc/core/convert.h"
#include "csrc/core/dispatch.h"
#include "csrc/core/optim/quant8_map.h"
#include "hip/adamw8bit_kernel.h"
#include "hip/check.h"

namespace hipferry::gpu {
namespace {

using optim::Quant8Input;
namespace q8 = optim::q8;

constexpr int kThreads = q8::kBlock;  // one thread per element of a quantization block
// Blocks loop over quantization blocks (grid stride), so each sets its tables up once for
// many: more than enough to fill any GPU.
constexpr std::int64_t kMaxBlocks = 8192;

// The code tables travel as a kernel argument (2 KiB); each block copies them to shared
// memory and derives the thresholds there (quant8.h's threshold_above_midpoint, as the
// host does).
struct CodeTables {
  float m[q8::kCodes];
  float v[q8::kCodes];
  std::uint8_t zero_m, zero_v;
};

// The largest of each thread's three values over the block, in every thread (red: shared).
__device__ void block_max3(std::uint32_t (*red)[kThreads], std::uint32_t m, std::uint32_t v, std::uint32_t x) {
  const int t = threadIdx.x;
  red[0][t] = m;
  red[1][t] = v;
  red[2][t] = x;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride >>= 1) {
    if (t < stride) {
      for (int k = 0; k < 3; ++k) red[k][t] = q8::max_u32(red[k][t], red[k][t + stride]);
    }
    __syncthreads();
  }
}

// The code of x in a block of stored scale `scale` (quant8.h's rules).
__device__ std::uint8_t quantize(float x, float scale, const float* threshold, std::uint8_t zero) {
  return q8::scale_divides(scale) ? q8::quantize_search(x, q8::normalizer(scale), threshold) : zero;
}

template <class Grad, class Out, bool kAmsgrad, bool kWriteOut>
__global__ void adamw8bit_kernel(optim::AdamW8bitArrays a, optim::AdamWScalars s, CodeTables tables, std::int64_t n) {
  __shared__ float code_m[q8::kCodes], code_v[q8::kCodes], thr_m[q8::kCodes], thr_v[q8::kCodes];
  __shared__ std::uint32_t red[3][kThreads];
  const int t = threadIdx.x;
  code_m[t] = tables.m[t];
  code_v[t] = tables.v[t];
  __syncthreads();
  if (t + 1 < q8::kCodes) {
    thr_m[t] = q8::threshold_above_midpoint(code_m[t], code_m[t + 1]);
    thr_v[t] = q8::threshold_above_midpoint(code_v[t], code_v[t + 1]);
  }
  __syncthreads();
  const auto* grad = static_cast<const typename Grad::storage*>(a.grad);
  auto* out = static_cast<typename Out::storage*>(a.param_out);
  // Out of place when the *_in arrays are set (adamw8bit_cpu.h), else in place.
  const bool from = a.param_in != nullptr;
  const float* param_in = from ? a.param_in : a.param;
  const Quant8Input m_in = from ? a.exp_avg_in : Quant8Input{a.exp_avg.codes, a.exp_avg.absmax};
  const Quant8Input v_in = from ? a.exp_avg_sq_in : Quant8Input{a.exp_avg_sq.codes, a.exp_avg_sq.absmax};
  const Quant8Input x_in = from ? a.max_exp_avg_sq_in : Quant8Input{a.max_exp_avg_sq.codes, a.max_exp_avg_sq.absmax};
  const std::int64_t blocks = q8::block_count(n);
  for (std::int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const std::int64_t i = b * q8::kBlock + t;
    const bool active = i < n;
    float m = 0.0f, v = 0.0f, x = 0.0f;  // an idle thread adds |0| to the scales
    if (active) {
      float p = param_in[i];
      if (kWriteOut && a.adopt_out) p = optim::adopt_written<Out>(p, out[i]);  // (in place only: the binding)
      q8::adamw8bit_element<kAmsgrad>(p, to_f32<Grad>(grad[i]), code_m[m_in.codes[i]], m_in.absmax[b],
                                      code_v[v_in.codes[i]], v_in.absmax[b], kAmsgrad ? code_v[x_in.codes[i]] : 0.0f,
                                      kAmsgrad ? x_in.absmax[b] : 0.0f, m, v, x, s);
      a.param[i] = p;
      if (kWriteOut) out[i] = from_f32<Out>(p);
    }
    // Every thread has read the old scales before this barrier; thread 0 overwrites them after.
    block_max3(red, q8::abs_bits(m), q8::abs_bits(v), q8::abs_bits(x));
    const float scale_m = q8::block_scale(red[0][0]);
    const float scale_v = q8::block_scale(red[1][0]);
    const float scale_x = q8::block_scale(red[2][0]);
    if (active) {
      a.exp_avg.codes[i] = quantize(m, scale_m, thr_m, tables.zero_m);
      a.exp_avg_sq.codes[i] = quantize(v, scale_v, thr_v, tables.zero_v);
      if (kAmsgrad) a.max_exp_avg_sq.codes[i] = quantize(x, scale_x, thr_v, tables.zero_v);
    }
    if (t == 0) {
      a.exp_avg.absmax[b] = scale_m;
      a.exp_avg_sq.absmax[b] = scale_v;
      if (kAmsgrad) a.max_exp_avg_sq.absmax[b] = scale_x;
    }
    __syncthreads();  // red is the next block's
  }
}

template <class Grad, class Out, bool kAmsgrad, bool kWriteOut>
void launch(const optim::AdamW8bitArrays& a, const optim::AdamWScalars& s, const CodeTables& tables, std::int64_t n,
            hipStream_t stream) {
  const std::int64_t blocks = std::min<std::int64_t>(q8::block_count(n), kMaxBlocks);
  adamw8bit_kernel<Grad, Out, kAmsgrad, kWriteOut>
      <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a, s, tables, n);
}

CodeTables code_tables() {
  CodeTables t;
  const q8::Quant8Map& m = q8::quant8_map(true);
  const q8::Quant8Map& v = q8::quant8_map(false);
  std::copy(m.code, m.code + q8::kCodes, t.m);
  std::copy(v.code, v.code + q8::kCodes, t.v);
  t.zero_m = m.zero_code;
  t.zero_v = v.zero_code;
  return t;
}

}  // namespace

void launch_adamw8bit(const optim::AdamW8bitArrays& a, const optim::AdamWScalars& s, std::int64_t n,
                      rt::StreamHandle stream, int device) {
  if (n <= 0) return;
  static const CodeTables tables = code_tables();
  rt::DeviceGuard guard(device);
  const auto native = static_cast<hipStream_t>(stream);
  dispatch_element_pair(a.grad_type, a.out_type, [&](auto grad_tag, auto out_tag) {
    using G = decltype(grad_tag);
    using O = decltype(out_tag);
    const bool out = a.param_out != nullptr;
    if (s.amsgrad) {
      out ? launch<G, O, true, true>(a, s, tables, n, native) : launch<G, O, true, false>(a, s, tables, n, native);
    } else {
      out ? launch<G, O, false, true>(a, s, tables, n, native) : launch<G, O, false, false>(a, s, tables, n, native);
    }
  });
  HIPFERRY_CHECK_ON(device, hipGetLastError());
}

}  // namespace hipferry::gpu
