// Element-wise float conversions, written once (design principle 1): the HIP
// kernel and the CPU loop call these same functions, so the CPU tests check the
// arithmetic the GPU runs.
//
// Every function is pure integer bit manipulation. That keeps results
// independent of the floating-point environment (flush-to-zero, fast-math,
// signalling-NaN quieting by FPU ops), which differs between GPUs and CPUs.
//
// Rounding is round-to-nearest-even, overflow goes to infinity, subnormals are
// produced and consumed exactly: bit-identical to torch's `.to(dtype)`.
// NaN follows IEEE 754 convertFormat (as x86 F16C/AVX-512 and ARM hardware do):
// the result is a quiet NaN with the same sign and the leading payload bits.
// torch itself is not consistent here (its CPU bfloat16 path writes 0xFFFF,
// its scalar path 0x7FC0, CUDA 0x7FFF), so tests compare NaN by this rule.
#pragma once

#include <cstdint>
#include <type_traits>

#include "csrc/core/host_device.h"

namespace hipferry {

// __builtin_bit_cast where the compiler has it: unlike a memcpy it does not
// make the float addressable, which stopped GCC from vectorizing loops that
// store the converted value (the AdamW loop writing bfloat16 parameters).
#if defined(__has_builtin)
#if __has_builtin(__builtin_bit_cast)
#define HIPFERRY_HAS_BIT_CAST 1
#endif
#endif

HIPFERRY_HD std::uint32_t f32_as_bits(float f) {
#ifdef HIPFERRY_HAS_BIT_CAST
  return __builtin_bit_cast(std::uint32_t, f);
#else
  std::uint32_t u;
  __builtin_memcpy(&u, &f, sizeof u);  // std::memcpy is host-only in HIP
  return u;
#endif
}

HIPFERRY_HD float f32_from_bits(std::uint32_t u) {
#ifdef HIPFERRY_HAS_BIT_CAST
  return __builtin_bit_cast(float, u);
#else
  float f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// c ? a : b without a branch, so that CPU loops over these functions vectorize.
HIPFERRY_HD std::uint32_t select_bits(bool c, std::uint32_t a, std::uint32_t b) {
  const std::uint32_t mask = 0u - static_cast<std::uint32_t>(c);
  return (a & mask) | (b & ~mask);
}

// float32 -> bfloat16 bits, round to nearest even.
HIPFERRY_HD std::uint16_t f32_to_bf16_rne(float f) {
  const std::uint32_t u = f32_as_bits(f);
  const bool is_nan = (u & 0x7fffffffu) > 0x7f800000u;
  const std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const std::uint32_t quiet_nan = (u >> 16) | 0x0040u;
  return static_cast<std::uint16_t>(select_bits(is_nan, quiet_nan, rounded));
}

// bfloat16 bits -> float32: exact, a bfloat16 is the top half of a float32.
HIPFERRY_HD float bf16_to_f32(std::uint16_t h) { return f32_from_bits(static_cast<std::uint32_t>(h) << 16); }

// float32 -> IEEE binary16 bits, round to nearest even.
HIPFERRY_HD std::uint16_t f32_to_f16_rne(float f) {
  const std::uint32_t u = f32_as_bits(f);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t a = u & 0x7fffffffu;  // magnitude bits

  // |f| >= 2^-14: rebias the exponent (127 -> 15) and round away 13 bits.
  const std::uint32_t normal = (a + 0xc8000fffu + ((a >> 13) & 1u)) >> 13;

  // |f| < 2^-14: the result is m * 2^-24 with m = round(significand >> shift).
  const std::uint32_t exponent = a >> 23;
  const std::uint32_t significand = (a & 0x7fffffu) | 0x800000u;
  // Clamp keeps the shift defined for lanes that take another branch;
  // 25 already shifts every significand (< 2^24) to zero with remainder < half.
  const std::uint32_t shift = select_bits(exponent < 101u, 25u, select_bits(exponent > 112u, 14u, 126u - exponent));
  // Round to nearest even: add half-1, plus 1 when the kept part is odd.
  const std::uint32_t half = 1u << (shift - 1u);
  const std::uint32_t subnormal = (significand + (half - 1u) + ((significand >> shift) & 1u)) >> shift;

  const std::uint32_t quiet_nan = 0x7e00u | ((a >> 13) & 0x03ffu);
  const std::uint32_t finite = select_bits(a >= 0x38800000u, normal, subnormal);
  const std::uint32_t magnitude = select_bits(
      a > 0x7f800000u, quiet_nan, select_bits(a >= 0x477ff000u, 0x7c00u, finite));  // >= 65520 rounds to inf
  return static_cast<std::uint16_t>(sign | magnitude);
}

// IEEE binary16 bits -> float32: exact.
HIPFERRY_HD float f16_to_f32(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu;
  const std::uint32_t mantissa = h & 0x03ffu;
  const std::uint32_t normal = ((h & 0x7fffu) << 13) + 0x38000000u;
  // mantissa * 2^-24 is exact in float32 and never subnormal there.
  const std::uint32_t subnormal = f32_as_bits(static_cast<float>(mantissa) * 5.9604644775390625e-8f);
  const std::uint32_t inf_or_nan = select_bits(mantissa == 0, 0x7f800000u, 0x7fc00000u | (mantissa << 13));
  const std::uint32_t magnitude =
      select_bits(exponent == 0x1fu, inf_or_nan, select_bits(exponent != 0, normal, subnormal));
  return f32_from_bits(sign | magnitude);
}

// Tag types naming an element type and its storage.
struct Float32 {
  using storage = float;
};
struct Float16 {
  using storage = std::uint16_t;
};
struct BFloat16 {
  using storage = std::uint16_t;
};

template <class T>
HIPFERRY_HD float to_f32(typename T::storage x) {
  if constexpr (sizeof(typename T::storage) == 4) {
    return x;
  } else if constexpr (std::is_same_v<T, Float16>) {
    return f16_to_f32(x);
  } else {
    return bf16_to_f32(x);
  }
}

template <class T>
HIPFERRY_HD typename T::storage from_f32(float f) {
  if constexpr (sizeof(typename T::storage) == 4) {
    return f;
  } else if constexpr (std::is_same_v<T, Float16>) {
    return f32_to_f16_rne(f);
  } else {
    return f32_to_bf16_rne(f);
  }
}

// The one conversion every backend runs. Same type is the identity (bits kept);
// float16 <-> bfloat16 goes through float32, as torch does (exact widening
// first, so there is no double rounding).
template <class From, class To>
HIPFERRY_HD typename To::storage convert_element(typename From::storage x) {
  if constexpr (std::is_same_v<From, To>) {
    return x;
  } else {
    return from_f32<To>(to_f32<From>(x));
  }
}

}  // namespace hipferry
