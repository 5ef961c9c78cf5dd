#include "csrc/core/optim/adamw_cpu.h"

#include "csrc/core/cpu/cpu_isa.h"
#include "csrc/core/dispatch.h"

// AVX2 and AVX-512 builds of the loop (8 and 16 elements per instruction),
// picked at run time by cpu::active_isa(); the baseline build stays correct
// everywhere and every build gives the same bits (adamw_update has no FMA and
// writes one canonical NaN). Done by hand (a `target` wrapper
// around one always-inline body) rather than with GCC's target_clones: Clang,
// the host compiler of ROCm builds, cannot clone templates.

namespace hipferry::optim {
namespace {

// What a loop does with param_out (kWriteOut): nothing, write the new values, or first take the
// user's writes as the master, then write (AdamWArrays::adopt_out).
constexpr int kNoOut = 0, kWrite = 1, kAdoptAndWrite = 2;

// kFrom: out of place (AdamWArrays' *_in arrays are read; distinct from the written ones, so
// every pointer may be __restrict). In place, the *_in pointers are never touched.
template <class Grad, class Out, bool kAmsgrad, int kWriteOut, bool kFrom>
[[gnu::always_inline]] inline void adamw_body(const AdamWArrays& a, const AdamWScalars& s, std::int64_t begin,
                                              std::int64_t end) {
  float* __restrict param = a.param;
  const auto* __restrict grad = static_cast<const typename Grad::storage*>(a.grad);
  float* __restrict m = a.exp_avg;
  float* __restrict v = a.exp_avg_sq;
  float* __restrict max_v = a.max_exp_avg_sq;
  auto* __restrict out = static_cast<typename Out::storage*>(a.param_out);
  const float* __restrict param_in = a.param_in;
  const float* __restrict m_in = a.exp_avg_in;
  const float* __restrict v_in = a.exp_avg_sq_in;
  const float* __restrict max_v_in = a.max_exp_avg_sq_in;
  // A local copy: reads of `s` through the reference could alias the stores
  // below, and GCC then keeps them in the loop and does not vectorize it.
  const AdamWScalars sc = s;
#pragma omp simd
  for (std::int64_t i = begin; i < end; ++i) {
    float p = kFrom ? param_in[i] : param[i];
    if constexpr (kWriteOut == kAdoptAndWrite) p = adopt_written<Out>(p, out[i]);
    float mi = kFrom ? m_in[i] : m[i];
    float vi = kFrom ? v_in[i] : v[i];
    float mx = kAmsgrad ? (kFrom ? max_v_in[i] : max_v[i]) : 0.0f;
    adamw_update<kAmsgrad>(p, to_f32<Grad>(grad[i]), mi, vi, mx, sc);
    param[i] = p;
    m[i] = mi;
    v[i] = vi;
    if constexpr (kAmsgrad) max_v[i] = mx;
    if constexpr (kWriteOut) out[i] = from_f32<Out>(p);
  }
}

#ifdef HIPFERRY_HAVE_AVX2_BUILD
template <class Grad, class Out, bool kAmsgrad, int kWriteOut, bool kFrom>
HIPFERRY_AVX2_TARGET void adamw_loop_avx2(const AdamWArrays& a, const AdamWScalars& s, std::int64_t begin,
                                          std::int64_t end) {
  adamw_body<Grad, Out, kAmsgrad, kWriteOut, kFrom>(a, s, begin, end);
}
#endif

#ifdef HIPFERRY_HAVE_AVX512_BUILD
template <class Grad, class Out, bool kAmsgrad, int kWriteOut, bool kFrom>
HIPFERRY_AVX512_TARGET void adamw_loop_avx512(const AdamWArrays& a, const AdamWScalars& s, std::int64_t begin,
                                              std::int64_t end) {
  adamw_body<Grad, Out, kAmsgrad, kWriteOut, kFrom>(a, s, begin, end);
}
#endif

template <class Grad, class Out, bool kAmsgrad, int kWriteOut, bool kFrom>
void adamw_loop(cpu::Isa isa, const AdamWArrays& a, const AdamWScalars& s, std::int64_t begin, std::int64_t end) {
#ifdef HIPFERRY_HAVE_AVX512_BUILD
  if (isa == cpu::Isa::kAvx512) return adamw_loop_avx512<Grad, Out, kAmsgrad, kWriteOut, kFrom>(a, s, begin, end);
#endif
#ifdef HIPFERRY_HAVE_AVX2_BUILD
  if (isa == cpu::Isa::kAvx2) return adamw_loop_avx2<Grad, Out, kAmsgrad, kWriteOut, kFrom>(a, s, begin, end);
#endif
  (void)isa;
  adamw_body<Grad, Out, kAmsgrad, kWriteOut, kFrom>(a, s, begin, end);
}

template <class Grad, class Out, bool kFrom>
void adamw_pick_from(cpu::Isa isa, const AdamWArrays& a, const AdamWScalars& s, std::int64_t begin, std::int64_t end) {
  const int out = a.param_out == nullptr ? kNoOut : (!kFrom && a.adopt_out) ? kAdoptAndWrite : kWrite;
  if (s.amsgrad) {
    out == kWrite   ? adamw_loop<Grad, Out, true, kWrite, kFrom>(isa, a, s, begin, end)
    : out == kNoOut ? adamw_loop<Grad, Out, true, kNoOut, kFrom>(isa, a, s, begin, end)
                    : adamw_loop<Grad, Out, true, kFrom ? kWrite : kAdoptAndWrite, kFrom>(isa, a, s, begin, end);
  } else {
    out == kWrite   ? adamw_loop<Grad, Out, false, kWrite, kFrom>(isa, a, s, begin, end)
    : out == kNoOut ? adamw_loop<Grad, Out, false, kNoOut, kFrom>(isa, a, s, begin, end)
                    : adamw_loop<Grad, Out, false, kFrom ? kWrite : kAdoptAndWrite, kFrom>(isa, a, s, begin, end);
  }
}

template <class Grad, class Out>
void adamw_pick(cpu::Isa isa, const AdamWArrays& a, const AdamWScalars& s, std::int64_t begin, std::int64_t end) {
  a.param_in != nullptr ? adamw_pick_from<Grad, Out, true>(isa, a, s, begin, end)
                        : adamw_pick_from<Grad, Out, false>(isa, a, s, begin, end);
}

}  // namespace

void adamw_cpu_isa(cpu::Isa isa, const AdamWArrays& a, const AdamWScalars& s, std::int64_t begin, std::int64_t end) {
  if (begin >= end) return;
  dispatch_element_pair(a.grad_type, a.out_type, [&](auto grad_tag, auto out_tag) {
    adamw_pick<decltype(grad_tag), decltype(out_tag)>(isa, a, s, begin, end);
  });
}

void adamw_cpu(const AdamWArrays& a, const AdamWScalars& s, std::int64_t begin, std::int64_t end) {
  adamw_cpu_isa(cpu::active_isa(), a, s, begin, end);
}

}  // namespace hipferry::optim
