// copy_cast_cpu writes exactly [begin, end), for every type pair, at odd sizes
// and unaligned addresses (the F16C path's tails and unaligned loads).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "csrc/core/convert.h"
#include "csrc/core/copy_cast_cpu.h"
#include "csrc/core/dispatch.h"

namespace hipferry {
namespace {

const ElementType kTypes[] = {ElementType::kFloat32, ElementType::kFloat16, ElementType::kBFloat16};

// Random bit patterns of `type`, stored in 4-byte slots for simplicity.
std::vector<unsigned char> random_bytes(std::size_t n_bytes, unsigned seed) {
  std::mt19937 gen(seed);
  std::vector<unsigned char> v(n_bytes);
  for (auto& b : v) b = static_cast<unsigned char>(gen());
  return v;
}

TEST(CopyCastCpu, WritesExactlyTheRangeForEveryPairSizeAndAlignment) {
  for (ElementType from : kTypes) {
    for (ElementType to : kTypes) {
      for (std::int64_t n : {0, 1, 7, 8, 9, 511, 512, 513, 1000, 4099}) {
        for (std::int64_t offset : {0, 1, 3}) {  // elements: misaligns the vector path
          const std::size_t fs = element_size(from), ts = element_size(to);
          auto src = random_bytes((n + offset) * fs, static_cast<unsigned>(n * 7 + offset));
          const unsigned char kSentinel = 0xA5;
          std::vector<unsigned char> dst((n + offset + 2) * ts, kSentinel);
          const std::int64_t begin = n > 2 ? 1 : 0, end = n > 2 ? n - 1 : n;
          copy_cast_cpu(src.data() + offset * fs, from, dst.data() + offset * ts, to, begin, end);
          dispatch_element_pair(from, to, [&](auto f, auto t) {
            using From = decltype(f);
            using To = decltype(t);
            for (std::int64_t i = 0; i < n + offset + 2; ++i) {
              const bool written = i >= offset + begin && i < offset + end;
              typename To::storage got;
              std::memcpy(&got, dst.data() + i * ts, ts);
              if (!written) {
                typename To::storage sentinel;
                std::memset(&sentinel, kSentinel, ts);
                ASSERT_EQ(std::memcmp(&got, &sentinel, ts), 0)
                    << element_type_name(from) << "->" << element_type_name(to) << " n=" << n
                    << " wrote outside the range at " << i;
                continue;
              }
              typename From::storage x;
              std::memcpy(&x, src.data() + i * fs, fs);
              const auto want = convert_element<From, To>(x);
              ASSERT_EQ(std::memcmp(&got, &want, ts), 0) << element_type_name(from) << "->" << element_type_name(to)
                                                         << " n=" << n << " offset=" << offset << " i=" << i;
            }
          });
        }
      }
    }
  }
}

TEST(CopyCastCpu, EmptyAndReversedRangesWriteNothing) {
  float src[4] = {1, 2, 3, 4};
  std::uint16_t dst[4] = {9, 9, 9, 9};
  copy_cast_cpu(src, ElementType::kFloat32, dst, ElementType::kBFloat16, 2, 2);
  copy_cast_cpu(src, ElementType::kFloat32, dst, ElementType::kBFloat16, 3, 1);
  for (auto d : dst) EXPECT_EQ(d, 9);
}

}  // namespace
}  // namespace hipferry
