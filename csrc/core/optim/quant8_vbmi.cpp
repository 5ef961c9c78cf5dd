#include "csrc/core/optim/quant8_vbmi.h"

namespace hipferry::optim::q8 {

#ifdef HIPFERRY_HAVE_AVX512_BUILD

bool vbmi_available() {
  static const bool available = cpu::best_isa() >= cpu::Isa::kAvx512 && __builtin_cpu_supports("avx512vbmi");
  return available;
}

HIPFERRY_VBMI_TARGET void read_codes_vbmi(const Quant8Map& map, const std::uint8_t* codes, float* out, int count) {
  const vbmi::Reader r = vbmi::reader(map);
  int j = 0;
  for (; j + vbmi::kVector <= count; j += vbmi::kVector) vbmi::read64(r, codes + j, out + j);
  for (; j < count; ++j) out[j] = map.code[codes[j]];
}

template <bool kSigned>
HIPFERRY_VBMI_TARGET void quantize_whole(const Quant8Map& map, const float* x, Normalizer n, std::uint8_t* codes,
                                         int count) {
  const vbmi::Quantizer q = vbmi::quantizer(map);
  for (int j = 0; j + vbmi::kVector <= count; j += vbmi::kVector) vbmi::quantize64<kSigned>(q, x + j, n, codes + j);
}

void quantize_vbmi(const Quant8Map& map, const float* x, Normalizer n, std::uint8_t* codes, int count) {
  const int whole = count / vbmi::kVector * vbmi::kVector;
  map.is_signed ? quantize_whole<true>(map, x, n, codes, whole) : quantize_whole<false>(map, x, n, codes, whole);
  for (int j = whole; j < count; ++j) codes[j] = static_cast<std::uint8_t>(quantize_lut(normalize(x[j], n), map.lut));
}

#else

bool vbmi_available() { return false; }
void read_codes_vbmi(const Quant8Map&, const std::uint8_t*, float*, int) {}
void quantize_vbmi(const Quant8Map&, const float*, Normalizer, std::uint8_t*, int) {}

#endif

}  // namespace hipferry::optim::q8
