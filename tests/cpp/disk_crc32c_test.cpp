// CRC-32C: the RFC 3720 vectors, values the `crc32c` PyPI package computes
// (what a reader of hipferry's files in Python would check against), the
// SSE4.2 build against the table build on every small length and alignment,
// and chaining.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "csrc/core/disk/crc32c.h"

namespace hipferry::disk {
namespace {

using Crc = std::uint32_t (*)(const void*, std::size_t, std::uint32_t);

struct Named {
  const char* name;
  Crc crc;
};
const Named kBoth[] = {{"crc32c", &crc32c}, {"crc32c_portable", &crc32c_portable}};

std::uint32_t of(Crc crc, const std::string& s) { return crc(s.data(), s.size(), 0); }
std::uint32_t of(Crc crc, const std::vector<unsigned char>& v) { return crc(v.data(), v.size(), 0); }

std::vector<unsigned char> random_bytes(std::size_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<unsigned char> v(n);
  for (auto& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

TEST(Crc32c, Rfc3720Vectors) {
  std::vector<unsigned char> zeros(32, 0), ones(32, 0xFF), ascending(32);
  for (int i = 0; i < 32; ++i) ascending[i] = static_cast<unsigned char>(i);
  for (const Named& f : kBoth) {
    SCOPED_TRACE(f.name);
    EXPECT_EQ(of(f.crc, std::string("123456789")), 0xE3069283u);
    EXPECT_EQ(of(f.crc, zeros), 0x8A9136AAu);
    EXPECT_EQ(of(f.crc, ones), 0x62A8AB43u);
    EXPECT_EQ(of(f.crc, ascending), 0x46DD794Eu);
    EXPECT_EQ(f.crc(nullptr, 0, 0), 0u);  // nothing read: the empty message
  }
}

TEST(Crc32c, EqualsThePyPIPackage) {
  // Values from crc32c.crc32c(...) (PyPI crc32c 2.x) for the same bytes.
  std::vector<unsigned char> pattern(std::size_t{1} << 20);
  for (std::size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<unsigned char>((i * 31 + 7) & 255);
  std::vector<unsigned char> ramp;
  for (int r = 0; r < 5; ++r) {
    for (int b = 0; b < 256; ++b) ramp.push_back(static_cast<unsigned char>(b));
  }
  for (const Named& f : kBoth) {
    SCOPED_TRACE(f.name);
    EXPECT_EQ(of(f.crc, pattern), 0xFF5BE3FCu);
    EXPECT_EQ(of(f.crc, ramp), 0x23B62C98u);
    EXPECT_EQ(of(f.crc, std::string("hipferry disk state")), 0xE01FBCB6u);
    EXPECT_EQ(of(f.crc, std::string("The quick brown fox jumps over the lazy dog")), 0x22620404u);
  }
}

TEST(Crc32c, HardwareEqualsPortableOnEveryLengthAndAlignment) {
  std::printf("crc32c_hardware() = %d\n", crc32c_hardware() ? 1 : 0);
  const std::vector<unsigned char> data = random_bytes(300 + 16, 1234);
  for (std::size_t start = 0; start < 16; ++start) {
    for (std::size_t n = 0; n <= 300; ++n) {
      for (std::uint32_t seed : {0u, 0xDEADBEEFu}) {
        ASSERT_EQ(crc32c(data.data() + start, n, seed), crc32c_portable(data.data() + start, n, seed))
            << "start " << start << ", length " << n << ", seed " << seed;
      }
    }
  }
}

TEST(Crc32c, HardwareEqualsPortableOnLargeRandomBuffers) {
  for (std::uint32_t seed = 0; seed < 4; ++seed) {
    const std::vector<unsigned char> data = random_bytes((std::size_t{1} << 16) + seed * 4099, seed);
    EXPECT_EQ(of(&crc32c, data), of(&crc32c_portable, data)) << "seed " << seed;
  }
}

TEST(Crc32c, ChainingEqualsOnePass) {
  const std::vector<unsigned char> data = random_bytes(1000, 99);
  for (const Named& f : kBoth) {
    SCOPED_TRACE(f.name);
    const std::uint32_t whole = of(f.crc, data);
    for (std::size_t split : {0, 1, 7, 8, 9, 63, 500, 999, 1000}) {
      const std::uint32_t head = f.crc(data.data(), split, 0);
      EXPECT_EQ(f.crc(data.data() + split, data.size() - split, head), whole) << "split at " << split;
    }
    // Three pieces, and an empty piece in the middle changes nothing.
    std::uint32_t crc = f.crc(data.data(), 100, 0);
    crc = f.crc(data.data() + 100, 0, crc);
    crc = f.crc(data.data() + 100, 400, crc);
    EXPECT_EQ(f.crc(data.data() + 500, 500, crc), whole);
  }
}

TEST(Crc32c, DetectsEverySingleBitFlip) {
  std::vector<unsigned char> data = random_bytes(4096, 5);
  const std::uint32_t clean = of(&crc32c, data);
  for (std::size_t bit = 0; bit < data.size() * 8; bit += 37) {
    data[bit / 8] ^= static_cast<unsigned char>(1u << (bit % 8));
    EXPECT_NE(of(&crc32c, data), clean) << "bit " << bit;
    data[bit / 8] ^= static_cast<unsigned char>(1u << (bit % 8));
  }
}

}  // namespace
}  // namespace hipferry::disk
