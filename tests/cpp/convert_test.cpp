// The element-wise conversions of convert.h (run by the GPU kernels) and the
// CPU kernel (which adds an F16C path on x86) against independent references,
// over EVERY float32 and float16 bit pattern.
#include <gtest/gtest.h>

#include <cmath>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "csrc/core/convert.h"
#include "csrc/core/copy_cast_cpu.h"
#include "csrc/core/cpu/cpu_isa.h"

namespace hipferry {
namespace {

// Independent bfloat16 reference: pick the nearer of the two neighbours in
// double arithmetic, ties to the even one.
std::uint16_t reference_f32_to_bf16(float x) {
  const std::uint32_t u = f32_as_bits(x);
  const std::uint32_t sign = u & 0x80000000u;
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);  // NaN rule
  if (a == 0x7f800000u) return static_cast<std::uint16_t>(u >> 16);
  const std::uint32_t low = a & 0xffff0000u;  // truncated magnitude
  const int exponent = static_cast<int>(a >> 23);
  const double ulp = std::ldexp(1.0, (exponent == 0 ? 1 : exponent) - 127 - 7);
  const double lo = std::fabs(static_cast<double>(f32_from_bits(low)));
  const double mag = std::fabs(static_cast<double>(x));
  const double down = mag - lo, up = lo + ulp - mag;
  std::uint32_t bf = low >> 16;
  if (up < down || (up == down && (bf & 1u))) bf += 1;  // may carry into inf: correct
  return static_cast<std::uint16_t>((sign >> 16) | bf);
}

// Independent float16 reference: the CPU's own conversion instruction (F16C
// vcvtps2ph, round to nearest even) where the CPU has it, else the compiler's
// _Float16 conversion (libgcc's soft-float routine: about 5x slower over the
// 2^32 patterns). Neither is hipferry's code.
#if defined(HIPFERRY_HAVE_AVX2_BUILD)
__attribute__((target("f16c"))) std::uint16_t hardware_f32_to_f16(float x) {
  return static_cast<std::uint16_t>(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT));
}
// (cpu_isa.h: the AVX2 and AVX-512 builds run only where the CPU has F16C too.)
const bool kHardwareF16 = cpu::best_isa() >= cpu::Isa::kAvx2;
#else
std::uint16_t hardware_f32_to_f16(float) { return 0; }
const bool kHardwareF16 = false;
#endif

std::uint16_t reference_f32_to_f16(float x) {
  const std::uint32_t a = f32_as_bits(x) & 0x7fffffffu;
  if (a > 0x7f800000u) {  // NaN rule: quiet, same sign, leading payload bits
    return static_cast<std::uint16_t>(((f32_as_bits(x) >> 16) & 0x8000u) | 0x7e00u | ((a >> 13) & 0x3ffu));
  }
  if (kHardwareF16) return hardware_f32_to_f16(x);
  const _Float16 h = static_cast<_Float16>(x);
  std::uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}

float reference_f16_to_f32(std::uint16_t h) {
  if ((h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0) {  // NaN rule
    return f32_from_bits((static_cast<std::uint32_t>(h & 0x8000u) << 16) | 0x7fc00000u |
                         (static_cast<std::uint32_t>(h & 0x3ffu) << 13));
  }
  _Float16 v;
  std::memcpy(&v, &h, 2);
  return static_cast<float>(v);
}

// The two references agree (so the fast one stands for the other), on every
// float16 boundary region: around each f16 value and midpoint, the subnormals,
// overflow, and a stride through all patterns.
TEST(ConvertReference, HardwareFloat16AgreesWithTheCompilersConversion) {
  if (!kHardwareF16) GTEST_SKIP() << "no F16C here: the compiler's conversion is the reference";
  const auto soft = [](float x) {
    const _Float16 h = static_cast<_Float16>(x);
    std::uint16_t bits;
    std::memcpy(&bits, &h, 2);
    return bits;
  };
  std::uint64_t checked = 0;
  const auto check = [&](std::uint32_t u) {
    const float x = f32_from_bits(u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return;  // NaNs: the shared rule above
    ASSERT_EQ(hardware_f32_to_f16(x), soft(x)) << "input 0x" << std::hex << u;
    ++checked;
  };
  for (std::uint32_t h = 0; h < 0x7c00u; ++h) {  // each finite f16 magnitude and the halfway points beside it
    const std::uint32_t u = f32_as_bits(reference_f16_to_f32(static_cast<std::uint16_t>(h)));
    for (std::uint32_t d = 0; d < 3; ++d) {
      for (std::uint32_t sign : {0u, 0x80000000u}) {
        check(sign | (u + d));
        check(sign | (u - d));
        check(sign | (u + (1u << 12) + d));  // about halfway to the next f16 (normal range)
        check(sign | (u + (1u << 12) - d));
      }
    }
  }
  for (std::uint64_t u = 0; u < (1ull << 32); u += 65521) check(static_cast<std::uint32_t>(u));
  EXPECT_GT(checked, 500000u);
}

// Runs check(first, count) over all 2^32 patterns, chunked over threads;
// returns the number of mismatches (and reports the first few).
template <class Check>
std::uint64_t over_all_f32_patterns(Check check) {
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  constexpr std::uint64_t kChunk = 1u << 20;
  constexpr std::uint64_t kTotal = 1ull << 32;
  std::vector<std::uint64_t> bad(threads, 0);
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (std::uint64_t first = t * kChunk; first < kTotal; first += threads * kChunk) {
        bad[t] += check(static_cast<std::uint32_t>(first), kChunk);
      }
    });
  }
  for (auto& th : pool) th.join();
  std::uint64_t total = 0;
  for (auto b : bad) total += b;
  return total;
}

template <class T>
std::uint64_t count_and_report(const char* what, std::uint32_t input, T got, T want, std::uint64_t& reported) {
  if (got == want) return 0;
  if (reported++ < 5) {
    ADD_FAILURE() << what << " input 0x" << std::hex << input << " got 0x" << +got << " want 0x" << +want;
  }
  return 1;
}

// Every float32 pattern through the shared function `scalar` (what the GPU
// runs) and through copy_cast_cpu (what the CPU runs) against `reference`.
template <class Scalar, class Reference>
void check_all_f32_to(ElementType to, Scalar scalar, Reference reference) {
  std::uint64_t reported = 0;
  const auto bad = over_all_f32_patterns([&](std::uint32_t first, std::uint64_t n) {
    std::vector<float> src(n);
    std::vector<std::uint16_t> cpu(n);
    for (std::uint64_t i = 0; i < n; ++i) src[i] = f32_from_bits(first + static_cast<std::uint32_t>(i));
    copy_cast_cpu(src.data(), ElementType::kFloat32, cpu.data(), to, 0, n);
    std::uint64_t b = 0;
    for (std::uint64_t i = 0; i < n; ++i) {
      const std::uint16_t want = reference(src[i]);
      b += count_and_report("convert.h", first + i, scalar(src[i]), want, reported);
      b += count_and_report("copy_cast_cpu", first + i, cpu[i], want, reported);
    }
    return b;
  });
  EXPECT_EQ(bad, 0u) << "float32 -> " << element_type_name(to);
}

TEST(ConvertExhaustive, Float32ToBFloat16AllPatterns) {
  check_all_f32_to(ElementType::kBFloat16, f32_to_bf16_rne, reference_f32_to_bf16);
}

TEST(ConvertExhaustive, Float32ToFloat16AllPatterns) {
  check_all_f32_to(ElementType::kFloat16, f32_to_f16_rne, reference_f32_to_f16);
}

TEST(ConvertExhaustive, Float16AndBFloat16ToFloat32AllPatterns) {
  std::vector<std::uint16_t> src(65536);
  for (std::uint32_t i = 0; i < 65536; ++i) src[i] = static_cast<std::uint16_t>(i);
  std::vector<float> from_f16(65536), from_bf16(65536);
  copy_cast_cpu(src.data(), ElementType::kFloat16, from_f16.data(), ElementType::kFloat32, 0, 65536);
  copy_cast_cpu(src.data(), ElementType::kBFloat16, from_bf16.data(), ElementType::kFloat32, 0, 65536);
  for (std::uint32_t i = 0; i < 65536; ++i) {
    const auto h = static_cast<std::uint16_t>(i);
    const std::uint32_t want = f32_as_bits(reference_f16_to_f32(h));
    ASSERT_EQ(f32_as_bits(f16_to_f32(h)), want) << "f16 0x" << std::hex << i;
    ASSERT_EQ(f32_as_bits(from_f16[i]), want) << "copy_cast_cpu f16 0x" << std::hex << i;
    ASSERT_EQ(f32_as_bits(bf16_to_f32(h)), i << 16) << "bf16 0x" << std::hex << i;
    ASSERT_EQ(f32_as_bits(from_bf16[i]), i << 16) << "copy_cast_cpu bf16 0x" << std::hex << i;
  }
}

TEST(ConvertExhaustive, Float16BFloat16CrossConversionsGoThroughFloat32) {
  std::vector<std::uint16_t> src(65536), to_bf16(65536), to_f16(65536);
  for (std::uint32_t i = 0; i < 65536; ++i) src[i] = static_cast<std::uint16_t>(i);
  copy_cast_cpu(src.data(), ElementType::kFloat16, to_bf16.data(), ElementType::kBFloat16, 0, 65536);
  copy_cast_cpu(src.data(), ElementType::kBFloat16, to_f16.data(), ElementType::kFloat16, 0, 65536);
  for (std::uint32_t i = 0; i < 65536; ++i) {
    const auto h = static_cast<std::uint16_t>(i);
    ASSERT_EQ(to_bf16[i], reference_f32_to_bf16(reference_f16_to_f32(h))) << std::hex << i;
    ASSERT_EQ(to_f16[i], reference_f32_to_f16(bf16_to_f32(h))) << std::hex << i;
    ASSERT_EQ((convert_element<Float16, BFloat16>(h)), to_bf16[i]);
    ASSERT_EQ((convert_element<BFloat16, Float16>(h)), to_f16[i]);
  }
}

// Hand-picked cases, so a failure names the case instead of a bit pattern.
TEST(Convert, NamedEdgeCases) {
  EXPECT_EQ(f32_to_bf16_rne(1.0f), 0x3f80);
  EXPECT_EQ(f32_to_bf16_rne(-0.0f), 0x8000);
  EXPECT_EQ(f32_to_bf16_rne(f32_from_bits(0x3f808000u)), 0x3f80);  // tie, even stays
  EXPECT_EQ(f32_to_bf16_rne(f32_from_bits(0x3f818000u)), 0x3f82);  // tie, odd rounds up
  EXPECT_EQ(f32_to_bf16_rne(f32_from_bits(0x7f7fffffu)), 0x7f80);  // FLT_MAX -> inf
  EXPECT_EQ(f32_to_bf16_rne(f32_from_bits(0xffc00001u)), 0xffc0);  // NaN keeps sign
  EXPECT_EQ(f32_to_bf16_rne(f32_from_bits(0x7f800001u)), 0x7fc0);  // sNaN is quieted
  EXPECT_EQ(f32_to_f16_rne(65504.0f), 0x7bff);                     // largest finite
  EXPECT_EQ(f32_to_f16_rne(65519.996f), 0x7bff);
  EXPECT_EQ(f32_to_f16_rne(65520.0f), 0x7c00);               // rounds to inf
  EXPECT_EQ(f32_to_f16_rne(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(f32_to_f16_rne(std::ldexp(1.0f, -25)), 0x0000);  // tie to even zero
  EXPECT_EQ(f32_to_f16_rne(std::ldexp(1.5f, -25)), 0x0001);
  EXPECT_EQ(f32_to_f16_rne(std::ldexp(3.0f, -25)), 0x0002);       // 1.5 ulp tie -> 2
  EXPECT_EQ(f32_to_f16_rne(-std::ldexp(1.0f, -14)), 0x8400);      // smallest normal
  EXPECT_EQ(f32_to_f16_rne(f32_from_bits(0xff812345u)), 0xfe09);  // NaN payload
  EXPECT_EQ(f32_as_bits(f16_to_f32(0x0001)), f32_as_bits(std::ldexp(1.0f, -24)));
  EXPECT_EQ(f32_as_bits(f16_to_f32(0xfc00)), 0xff800000u);
  EXPECT_EQ(f32_as_bits(f16_to_f32(0x7c01)), 0x7fc02000u);
}

}  // namespace
}  // namespace hipferry
