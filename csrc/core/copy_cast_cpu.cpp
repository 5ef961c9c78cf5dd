#include "csrc/core/copy_cast_cpu.h"

#include <algorithm>
#include <cstring>

#include "csrc/core/dispatch.h"

// Speed notes.
// - The loops are branch-free element code; `omp simd` (-fopenmp-simd, no
//   OpenMP runtime) makes GCC if-convert the selects of convert.h into vector
//   blends instead of branches.
// - The float16 leg has a hardware path on x86-64 (F16C: vcvtps2ph with
//   round-to-nearest-even, vcvtph2ps). It implements exactly the rule of
//   convert.h (IEEE RNE, quiet NaN keeping sign and payload bits); GoogleTest
//   checks that over all 2^32 float32 and 2^16 float16 inputs. The software
//   integer path is several times slower out of cache. The GPU runs convert.h.
#include "csrc/core/cpu/cpu_isa.h"
#ifdef HIPFERRY_HAVE_AVX2_BUILD
#include <immintrin.h>
#endif
namespace hipferry {
namespace {

#ifdef HIPFERRY_HAVE_AVX2_BUILD
// The AVX2 build (cpu_isa.h) or one beyond it runs: the F16C conversions, and the AVX2 loops
// where there is no wider build.
bool avx2_build_active() { return cpu::active_isa() >= cpu::Isa::kAvx2; }
#endif
#ifdef HIPFERRY_HAVE_AVX512_BUILD
bool avx512_build_active() { return cpu::active_isa() == cpu::Isa::kAvx512; }
#endif

template <class From, class To>
[[gnu::always_inline]] inline void convert_body(const typename From::storage* __restrict src,
                                                typename To::storage* __restrict dst, std::int64_t n) {
#pragma omp simd
  for (std::int64_t i = 0; i < n; ++i) {
    dst[i] = convert_element<From, To>(src[i]);
  }
}

#ifdef HIPFERRY_HAVE_AVX2_BUILD
// An AVX2 build of the portable loop, picked at run time: one binary, fast on
// new CPUs, still correct on old ones. By hand rather than with target_clones,
// which Clang (ROCm's host compiler) cannot apply to templates.
template <class From, class To>
HIPFERRY_AVX2_TARGET void convert_range_avx2(const typename From::storage* src, typename To::storage* dst,
                                             std::int64_t n) {
  convert_body<From, To>(src, dst, n);
}
#endif

#ifdef HIPFERRY_HAVE_AVX512_BUILD
template <class From, class To>
HIPFERRY_AVX512_TARGET void convert_range_avx512(const typename From::storage* src, typename To::storage* dst,
                                                 std::int64_t n) {
  convert_body<From, To>(src, dst, n);
}
#endif

template <class From, class To>
void convert_range_portable(const typename From::storage* src, typename To::storage* dst, std::int64_t n) {
#ifdef HIPFERRY_HAVE_AVX512_BUILD
  if (avx512_build_active()) return convert_range_avx512<From, To>(src, dst, n);
#endif
#ifdef HIPFERRY_HAVE_AVX2_BUILD
  if (avx2_build_active()) return convert_range_avx2<From, To>(src, dst, n);
#endif
  convert_body<From, To>(src, dst, n);
}

#ifdef HIPFERRY_HAVE_AVX2_BUILD
HIPFERRY_AVX2_TARGET void f32_to_f16_f16c(const float* src, std::uint16_t* dst, std::int64_t n) {
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(src + i);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) dst[i] = f32_to_f16_rne(src[i]);
}

HIPFERRY_AVX2_TARGET void f16_to_f32_f16c(const std::uint16_t* src, float* dst, std::int64_t n) {
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(v));
  }
  for (; i < n; ++i) dst[i] = f16_to_f32(src[i]);
}

// A float16 leg on either side: convert through a small float32 block that
// stays in L1, hardware for the float16 side, convert.h for the other.
template <class From, class To>
bool convert_range_f16c(const typename From::storage* src, typename To::storage* dst, std::int64_t n) {
  constexpr bool from_f16 = std::is_same_v<From, Float16>;
  constexpr bool to_f16 = std::is_same_v<To, Float16>;
  if constexpr (!from_f16 && !to_f16) {
    return false;
  } else {
    if (!avx2_build_active()) return false;
    constexpr std::int64_t kBlock = 512;
    alignas(64) float block[kBlock];
    for (std::int64_t start = 0; start < n; start += kBlock) {
      const std::int64_t len = std::min(kBlock, n - start);
      const float* as_f32;
      if constexpr (from_f16) {
        f16_to_f32_f16c(src + start, block, len);
        as_f32 = block;
      } else if constexpr (std::is_same_v<From, Float32>) {
        as_f32 = src + start;
      } else {
        convert_range_portable<From, Float32>(src + start, block, len);
        as_f32 = block;
      }
      if constexpr (to_f16) {
        f32_to_f16_f16c(as_f32, dst + start, len);
      } else if constexpr (std::is_same_v<To, Float32>) {
        if (as_f32 != dst + start) std::memcpy(dst + start, as_f32, len * sizeof(float));
      } else {
        convert_range_portable<Float32, To>(as_f32, dst + start, len);
      }
    }
    return true;
  }
}
#endif

template <class From, class To>
void convert_range(const typename From::storage* src, typename To::storage* dst, std::int64_t n) {
#ifdef HIPFERRY_HAVE_AVX2_BUILD
  if (convert_range_f16c<From, To>(src, dst, n)) return;
#endif
  convert_range_portable<From, To>(src, dst, n);
}

}  // namespace

void copy_cast_cpu(const void* src, ElementType src_type, void* dst, ElementType dst_type, std::int64_t begin,
                   std::int64_t end) {
  if (end <= begin) return;
  if (src_type == dst_type) {
    const std::size_t size = element_size(src_type);
    std::memcpy(static_cast<char*>(dst) + begin * size, static_cast<const char*>(src) + begin * size,
                (end - begin) * size);
    return;
  }
  dispatch_element_pair(src_type, dst_type, [&](auto from, auto to) {
    using From = decltype(from);
    using To = decltype(to);
    convert_range<From, To>(static_cast<const typename From::storage*>(src) + begin,
                            static_cast<typename To::storage*>(dst) + begin, end - begin);
  });
}

bool copy_cast_cpu_uses_f16c() {
#ifdef HIPFERRY_HAVE_AVX2_BUILD
  return avx2_build_active();
#else
  return false;
#endif
}

}  // namespace hipferry
