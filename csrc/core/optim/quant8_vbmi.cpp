#include "csrc/core/optim/quant8_vbmi.h"

#ifdef HIPFERRY_HAVE_AVX512_BUILD
#include <immintrin.h>
#ifndef __clang__
// GCC 12 warns inside its own AVX-512 headers (the _mm512_undefined_* placeholders of its
// intrinsics) wherever they are inlined.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#define HIPFERRY_VBMI_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi")))
#define HIPFERRY_VBMI_INLINE \
  inline __attribute__((always_inline, target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi")))
#endif

namespace hipferry::optim::q8 {

#ifdef HIPFERRY_HAVE_AVX512_BUILD
namespace {

constexpr int kVector = 64;  // elements a piece takes

// A float table as four byte planes, read from the map where they are (64-byte aligned):
// the instructions take them as memory operands, and nothing is copied a call.
using Planes = std::uint8_t[4][kCodes];

HIPFERRY_VBMI_INLINE __m512i quarter(const Planes& t, int byte, int q) { return _mm512_load_si512(t[byte] + 64 * q); }

// The byte order that makes read_floats' unpacking come out in element order: the unpacks
// work within 128-bit lanes, so lane L of output k holds elements 16k + 4L .. 16k + 4L + 3,
// which must sit at bytes 16L + 4k .. 16L + 4k + 3 of the planes' results.
HIPFERRY_VBMI_INLINE __m512i unpack_order() {
  alignas(64) std::uint8_t order[64];
  for (int lane = 0; lane < 4; ++lane) {
    for (int k = 0; k < 4; ++k) {
      for (int t = 0; t < 4; ++t) order[16 * lane + 4 * k + t] = static_cast<std::uint8_t>(16 * k + 4 * lane + t);
    }
  }
  return _mm512_load_si512(order);
}

// table[index[j]] for 64 byte indices in element order, as four registers of 16 floats.
// vpermi2b takes bit 6 of an index to pick one of two registers; bit 7 picks the pair.
HIPFERRY_VBMI_INLINE void read_floats(const Planes& t, __m512i order, __m512i index, __m512 (&out)[4]) {
  const __m512i at = _mm512_permutexvar_epi8(order, index);
  const __mmask64 high = _mm512_movepi8_mask(at);
  __m512i b[4];
  for (int k = 0; k < 4; ++k) {
    const __m512i low = _mm512_permutex2var_epi8(quarter(t, k, 0), at, quarter(t, k, 1));
    const __m512i up = _mm512_permutex2var_epi8(quarter(t, k, 2), at, quarter(t, k, 3));
    b[k] = _mm512_mask_blend_epi8(high, low, up);
  }
  const __m512i lo01 = _mm512_unpacklo_epi8(b[0], b[1]), hi01 = _mm512_unpackhi_epi8(b[0], b[1]);
  const __m512i lo23 = _mm512_unpacklo_epi8(b[2], b[3]), hi23 = _mm512_unpackhi_epi8(b[2], b[3]);
  out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(lo01, lo23));
  out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(lo01, lo23));
  out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(hi01, hi23));
  out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(hi01, hi23));
}

// Reads the code table: out[j] = map.code[codes[j]], 64 of them.
struct Reader {
  const Planes& table;
  __m512i order;
};

HIPFERRY_VBMI_INLINE Reader reader(const Quant8Map& map) { return {map.code_planes, unpack_order()}; }

HIPFERRY_VBMI_INLINE void read64(const Reader& r, const std::uint8_t* codes, float* out) {
  __m512 v[4];
  read_floats(r.table, r.order, _mm512_loadu_si512(codes), v);
  for (int k = 0; k < 4; ++k) _mm512_storeu_ps(out + 16 * k, v[k]);
}

// Quantizes against one map: estimate_code (quant8_map.h) lane for lane, then one
// comparison with the threshold above the guess.
struct Quantizer {
  const Planes& thresholds;
  __m512i order;
  __m512i region_of_binade_lo, region_of_binade_hi;
  __m512 region_end, scale, offset;
};

HIPFERRY_VBMI_INLINE Quantizer quantizer(const Quant8Map& map) {
  return {map.threshold_planes,
          unpack_order(),
          _mm512_load_si512(map.region_of_binade),
          _mm512_load_si512(map.region_of_binade + 16),
          _mm512_load_ps(map.region_end),
          _mm512_load_ps(map.estimate_scale),
          _mm512_load_ps(map.estimate_offset)};
}

template <bool kSigned>
HIPFERRY_VBMI_INLINE __m512i estimate(const Quantizer& e, __m512 y) {
  const __m512i abs_bits = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(0x7fffffff));
  const __m512 a = _mm512_castsi512_ps(abs_bits);
  const __m512i binade = _mm512_max_epi32(_mm512_sub_epi32(_mm512_srli_epi32(abs_bits, 23), _mm512_set1_epi32(103)),
                                          _mm512_setzero_si512());
  __m512i r = _mm512_permutex2var_epi32(e.region_of_binade_lo, binade, e.region_of_binade_hi);
  const __mmask16 next = _mm512_cmp_ps_mask(a, _mm512_permutexvar_ps(r, e.region_end), _CMP_GE_OQ);
  r = _mm512_mask_add_epi32(r, next, r, _mm512_set1_epi32(1));
  const __m512 w =
      _mm512_sub_ps(_mm512_mul_ps(a, _mm512_permutexvar_ps(r, e.scale)), _mm512_permutexvar_ps(r, e.offset));
  const __m512i down = _mm512_cvt_roundps_epi32(w, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __mmask16 negative = _mm512_cmplt_epi32_mask(_mm512_castps_si512(y), _mm512_setzero_si512());
  if constexpr (!kSigned) return _mm512_maskz_mov_epi32(static_cast<__mmask16>(~negative), down);
  const __m512i up = _mm512_cvt_roundps_epi32(w, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC);
  const __m512i mirrored = _mm512_max_epi32(_mm512_sub_epi32(_mm512_set1_epi32(254), up), _mm512_setzero_si512());
  return _mm512_mask_mov_epi32(down, negative, mirrored);
}

// codes[j] = code_search((x[j] * n.pre) * n.inverse), 64 of them.
template <bool kSigned>
HIPFERRY_VBMI_INLINE void quantize64(const Quantizer& q, const float* x, Normalizer n, std::uint8_t* codes) {
  const __m512 pre = _mm512_set1_ps(n.pre), inverse = _mm512_set1_ps(n.inverse);
  __m512 y[4];
  __m128i bytes[4];
  for (int k = 0; k < 4; ++k) {
    y[k] = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + 16 * k), pre), inverse);
    bytes[k] = _mm512_cvtepi32_epi8(estimate<kSigned>(q, y[k]));
  }
  const __m512i guess = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(bytes[1], bytes[0])),
                                           _mm256_set_m128i(bytes[3], bytes[2]), 1);
  __m512 above[4];  // threshold[guess]: y at or past it takes the next code
  read_floats(q.thresholds, q.order, guess, above);
  std::uint64_t past = 0;
  for (int k = 0; k < 4; ++k) {
    past |= static_cast<std::uint64_t>(_mm512_cmp_ps_mask(y[k], above[k], _CMP_GE_OQ)) << (16 * k);
  }
  _mm512_storeu_si512(codes, _mm512_mask_sub_epi8(guess, past, guess, _mm512_set1_epi8(-1)));
}

// The elements [from, count) past the last whole vector, one at a time: the table read, and
// the lookup table's code (quant8_map.h), equal to the vector pieces' results.
void read_rest(const Quant8Map& map, const std::uint8_t* codes, float* out, int from, int count) {
  for (int j = from; j < count; ++j) out[j] = map.code[codes[j]];
}

void quantize_rest(const Quant8Map& map, const float* x, Normalizer n, std::uint8_t* codes, int from, int count) {
  for (int j = from; j < count; ++j) codes[j] = static_cast<std::uint8_t>(quantize_lut(normalize(x[j], n), map.lut));
}

// m's tables (the signed map) and v's (the unsigned one, max_v's too).
struct MomentTables {
  Reader read[2];
  Quantizer quantize[2];
};

HIPFERRY_VBMI_INLINE MomentTables moment_tables() {
  const Quant8Map& m = quant8_map(true);
  const Quant8Map& v = quant8_map(false);
  return {{reader(m), reader(v)}, {quantizer(m), quantizer(v)}};
}

template <int kStates>
HIPFERRY_VBMI_TARGET void read_moments(const std::uint8_t* const (&codes)[3], float* const (&out)[3], int count) {
  const MomentTables t = moment_tables();
  int j = 0;
  for (; j + kVector <= count; j += kVector) {
    for (int k = 0; k < kStates; ++k) read64(t.read[k == 0 ? 0 : 1], codes[k] + j, out[k] + j);
  }
  for (int k = 0; k < kStates; ++k) read_rest(quant8_map(k == 0), codes[k], out[k], j, count);
}

template <int kStates>
HIPFERRY_VBMI_TARGET void quantize_moments(const float* const (&x)[3], const Normalizer (&n)[3],
                                           std::uint8_t* const (&codes)[3], int count) {
  const MomentTables t = moment_tables();
  int j = 0;
  for (; j + kVector <= count; j += kVector) {
    quantize64<true>(t.quantize[0], x[0] + j, n[0], codes[0] + j);
    for (int k = 1; k < kStates; ++k) quantize64<false>(t.quantize[1], x[k] + j, n[k], codes[k] + j);
  }
  for (int k = 0; k < kStates; ++k) quantize_rest(quant8_map(k == 0), x[k], n[k], codes[k], j, count);
}

template <bool kSigned>
HIPFERRY_VBMI_TARGET void quantize_whole(const Quant8Map& map, const float* x, Normalizer n, std::uint8_t* codes,
                                         int count) {
  const Quantizer q = quantizer(map);
  for (int j = 0; j + kVector <= count; j += kVector) quantize64<kSigned>(q, x + j, n, codes + j);
}

}  // namespace

bool vbmi_available() {
  static const bool available = cpu::best_isa() >= cpu::Isa::kAvx512 && __builtin_cpu_supports("avx512vbmi");
  return available;
}

HIPFERRY_VBMI_TARGET void read_codes_vbmi(const Quant8Map& map, const std::uint8_t* codes, float* out, int count) {
  const Reader r = reader(map);
  int j = 0;
  for (; j + kVector <= count; j += kVector) read64(r, codes + j, out + j);
  read_rest(map, codes, out, j, count);
}

void quantize_vbmi(const Quant8Map& map, const float* x, Normalizer n, std::uint8_t* codes, int count) {
  const int whole = count / kVector * kVector;
  map.is_signed ? quantize_whole<true>(map, x, n, codes, whole) : quantize_whole<false>(map, x, n, codes, whole);
  quantize_rest(map, x, n, codes, whole, count);
}

void read_moments_vbmi(const std::uint8_t* const (&codes)[3], float* const (&out)[3], int states, int count) {
  states == 3 ? read_moments<3>(codes, out, count) : read_moments<2>(codes, out, count);
}

void quantize_moments_vbmi(const float* const (&x)[3], const Normalizer (&n)[3], std::uint8_t* const (&codes)[3],
                           int states, int count) {
  states == 3 ? quantize_moments<3>(x, n, codes, count) : quantize_moments<2>(x, n, codes, count);
}

#else

bool vbmi_available() { return false; }
void read_codes_vbmi(const Quant8Map&, const std::uint8_t*, float*, int) {}
void quantize_vbmi(const Quant8Map&, const float*, Normalizer, std::uint8_t*, int) {}
void read_moments_vbmi(const std::uint8_t* const (&)[3], float* const (&)[3], int, int) {}
void quantize_moments_vbmi(const float* const (&)[3], const Normalizer (&)[3], std::uint8_t* const (&)[3], int, int) {}

#endif

}  // namespace hipferry::optim::q8
