#include "csrc/core/disk/crc32c.h"

#include <array>
#include <cstring>

// The SSE4.2 build exists where the ISA dispatch does (csrc/core/cpu/cpu_isa.h:
// not under ThreadSanitizer, whose GCC build crashes in the CPU-feature check).
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(HIPFERRY_NO_ISA_DISPATCH)
#define HIPFERRY_HAVE_CRC32C_SSE42 1
#include <nmmintrin.h>
#endif

namespace hipferry::disk {
namespace {

constexpr std::uint32_t kPolynomial = 0x82F63B78u;  // Castagnoli, bit-reflected

// Slicing-by-8: table[k][b] is the CRC of byte b followed by k zero bytes, so
// eight bytes take eight lookups and no loop-carried shifts per bit.
using Tables = std::array<std::array<std::uint32_t, 256>, 8>;

Tables make_tables() {
  Tables t{};
  for (std::uint32_t b = 0; b < 256; ++b) {
    std::uint32_t crc = b;
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ ((crc & 1u) ? kPolynomial : 0u);
    t[0][b] = crc;
  }
  for (std::uint32_t b = 0; b < 256; ++b) {
    for (int k = 1; k < 8; ++k) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFFu];
  }
  return t;
}

const Tables& tables() {
  static const Tables t = make_tables();
  return t;
}

std::uint64_t load_le64(const unsigned char* p) {
  std::uint64_t v;
  std::memcpy(&v, p, sizeof v);  // unaligned-safe; x86-64 and aarch64 Linux are little-endian
  return v;
}

// `state` is the running (inverted) register, not the public CRC value.
std::uint32_t update_portable(std::uint32_t state, const unsigned char* p, std::size_t n) {
  const Tables& t = tables();
  while (n >= 8) {
    const std::uint64_t v = load_le64(p) ^ state;
    state = t[7][v & 0xFF] ^ t[6][(v >> 8) & 0xFF] ^ t[5][(v >> 16) & 0xFF] ^ t[4][(v >> 24) & 0xFF] ^
            t[3][(v >> 32) & 0xFF] ^ t[2][(v >> 40) & 0xFF] ^ t[1][(v >> 48) & 0xFF] ^ t[0][v >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) state = (state >> 8) ^ t[0][(state ^ *p++) & 0xFF];
  return state;
}

#ifdef HIPFERRY_HAVE_CRC32C_SSE42
__attribute__((target("sse4.2"))) std::uint32_t update_sse42(std::uint32_t state, const unsigned char* p,
                                                             std::size_t n) {
  // Byte steps up to an 8-byte boundary, so the 8-byte loads do not straddle lines.
  while (n > 0 && (reinterpret_cast<std::uintptr_t>(p) & 7u) != 0) {
    state = _mm_crc32_u8(state, *p++);
    --n;
  }
  std::uint64_t wide = state;
  while (n >= 8) {
    wide = _mm_crc32_u64(wide, load_le64(p));
    p += 8;
    n -= 8;
  }
  state = static_cast<std::uint32_t>(wide);
  while (n--) state = _mm_crc32_u8(state, *p++);
  return state;
}
#endif

}  // namespace

bool crc32c_hardware() {
#ifdef HIPFERRY_HAVE_CRC32C_SSE42
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
#else
  return false;
#endif
}

std::uint32_t crc32c_portable(const void* data, std::size_t bytes, std::uint32_t crc) {
  return ~update_portable(~crc, static_cast<const unsigned char*>(data), bytes);
}

std::uint32_t crc32c(const void* data, std::size_t bytes, std::uint32_t crc) {
#ifdef HIPFERRY_HAVE_CRC32C_SSE42
  if (crc32c_hardware()) return ~update_sse42(~crc, static_cast<const unsigned char*>(data), bytes);
#endif
  return crc32c_portable(data, bytes, crc);
}

}  // namespace hipferry::disk
