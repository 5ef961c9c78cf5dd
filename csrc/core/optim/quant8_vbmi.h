// Table reads and the quantizer of the 8-bit optimizer state (quant8.h) in registers, on
// CPUs with AVX-512 VBMI (Intel Ice Lake and later, AMD Zen 4 and later). A 256-entry
// float table is four 256-byte planes (quant8_map.h); vpermi2b reads 64 codes' bytes from
// a plane in two instructions, where a scalar read or a gather takes about one cycle per
// element. The quantizer takes quant8_map.h's estimate_code (arithmetic) and one read of
// the threshold above it. Both give exactly what the scalar code gives: a table read, and
// code_search's count of thresholds <= y (equal by construction, checked when the map is
// built), so the loops that use them stay bit-identical to the other builds.
#pragma once

#include <cstdint>

#include "csrc/core/cpu/cpu_isa.h"
#include "csrc/core/optim/quant8_map.h"

namespace hipferry::optim::q8 {

// Whether this CPU runs the functions below (always false without the AVX-512 build).
bool vbmi_available();

// out[j] = map.code[codes[j]] for j < count.
void read_codes_vbmi(const Quant8Map& map, const std::uint8_t* codes, float* out, int count);

// codes[j] = code_search(normalize(x[j], n), map.threshold) for j < count (x finite,
// |normalize(x, n)| <= 1 + 2^-23; other x get some code, as in quantize_lut).
void quantize_vbmi(const Quant8Map& map, const float* x, Normalizer n, std::uint8_t* codes, int count);

// One block's moments at once, m (the signed map) then v and max_v (the unsigned one), of
// which `states` (2 or 3): the table entries of their codes, out[k][j] = code[codes[k][j]];
// and their codes from new values, codes[k][j] = quantize_vbmi's, with normalizer n[k].
// Taken in turns 64 elements at a time, which ran faster than one state after the other;
// one call a block keeps the vector code out of the loops that call it (compiled once,
// not once per element type: the sanitizer build took minutes over those).
void read_moments_vbmi(const std::uint8_t* const (&codes)[3], float* const (&out)[3], int states, int count);
void quantize_moments_vbmi(const float* const (&x)[3], const Normalizer (&n)[3], std::uint8_t* const (&codes)[3],
                           int states, int count);

}  // namespace hipferry::optim::q8
