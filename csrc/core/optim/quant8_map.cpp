#include "csrc/core/optim/quant8_map.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace hipferry::optim::q8 {
namespace {

// torch.linspace(start, end, n) in float32 as torch's vectorized CPU kernel computes it:
// step = (end - start) / (n - 1) rounded to float, then start + step * i (the lower
// half) or end - step * (n - 1 - i) (the upper half) with a single rounding. In double
// those are exact (step * i needs 24 + 8 bits, the sum stays under 53), so one cast to
// float rounds once, as the fused multiply-add does.
std::vector<float> linspace_f32(float start, float end, int n) {
  const float step = (end - start) / static_cast<float>(n - 1);
  std::vector<float> out(static_cast<std::size_t>(n));
  const int halfway = n / 2;
  for (int i = 0; i < n; ++i) {
    const double v = i < halfway ? static_cast<double>(start) + static_cast<double>(step) * i
                                 : static_cast<double>(end) - static_cast<double>(step) * (n - 1 - i);
    out[static_cast<std::size_t>(i)] = static_cast<float>(v);
  }
  return out;
}

constexpr int kExponentBits = 7;  // max_exponent_bits; total_bits = 8, so 7 bits beside the sign
// 10 ** (k - 6) as Python evaluates it (a double), then rounded to float32 as torch
// rounds a Python scalar multiplying a float32 tensor.
constexpr double kDecade[kExponentBits] = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0};

[[noreturn]] void bad_bucket(std::int32_t key, const char* what) {
  throw std::logic_error("hipferry: 8-bit lookup bucket " + std::to_string(key) + " " + what);
}

// The packed entry of bucket `key`, whose floats run from `smallest` to `largest`.
std::int32_t lut_entry(const Quant8Map& map, std::int32_t key, float smallest, float largest) {
  if (lut_key(f32_as_bits(smallest)) != key || lut_key(f32_as_bits(largest)) != key) {
    bad_bucket(key, "has the wrong key");
  }
  const int below = code_search(smallest, map.threshold);
  const int holds = code_search(largest, map.threshold) - below;  // thresholds inside the bucket
  if (holds > 1) bad_bucket(key, "holds two thresholds");
  std::uint32_t low = kLutNoThreshold;
  if (holds == 1) {
    const std::uint32_t t = f32_as_bits(map.threshold[below]);
    // Its top 16 bits must be the bucket's (not a clamped end bucket), so the low 16 decide.
    if (lut_key(t) != key || (t >> 16) != (f32_as_bits(smallest) >> 16)) bad_bucket(key, "spans top bits");
    low = lut_order(t);
  }
  return static_cast<std::int32_t>((static_cast<std::uint32_t>(below) << kLutCodeShift) | low);
}

// Builds thresholds and the lookup table, and checks what quantize_lut relies on.
void complete(Quant8Map& map) {
  for (int i = 0; i + 1 < kCodes; ++i) {
    const float lo = map.code[i], hi = map.code[i + 1];
    const double sum = static_cast<double>(lo) + static_cast<double>(hi);
    if (!(lo < hi) || sum - lo != hi || sum - hi != lo) {
      throw std::logic_error("hipferry: 8-bit code table entry " + std::to_string(i) +
                             " is not below the next, or their midpoint is not exact in double");
    }
    map.threshold[i] = threshold_above_midpoint(lo, hi);
  }
  map.threshold[kCodes - 1] = f32_from_bits(kNanBits);
  // Bucket b of |y| spans magnitudes [mag_lo(b), mag_hi(b)]; positive y's key is
  // kLutSpan + 1 + b, negative y's kLutSpan - b (lut_key).
  auto mag_lo = [](std::int32_t b) { return b == 0 ? 0u : static_cast<std::uint32_t>(kLutFirst + b) << 16; };
  auto mag_hi = [](std::int32_t b) {
    return b == kLutSpan ? kInfBits : (static_cast<std::uint32_t>(kLutFirst + b + 1) << 16) - 1;
  };
  for (std::int32_t b = 0; b <= kLutSpan; ++b) {
    const float lo = f32_from_bits(mag_lo(b)), hi = f32_from_bits(mag_hi(b));
    const std::int32_t keys[2] = {kLutSpan + 1 + b, kLutSpan - b};
    const float smallest[2] = {lo, -hi}, largest[2] = {hi, -lo};
    for (int side = 0; side < 2; ++side) {
      map.lut[keys[side]] = lut_entry(map, keys[side], smallest[side], largest[side]);
    }
  }
}

void split_planes(const float* table, std::uint8_t (&planes)[4][kCodes]) {
  for (int i = 0; i < kCodes; ++i) {
    for (int b = 0; b < 4; ++b) planes[b][i] = static_cast<std::uint8_t>(f32_as_bits(table[i]) >> (8 * b));
  }
}

float next_down(float f) { return -next_up(-f); }

[[noreturn]] void bad_estimate(const Quant8Map& map, float y, const char* what) {
  throw std::logic_error(std::string("hipferry: 8-bit ") + (map.is_signed ? "signed" : "unsigned") + " estimate_code " +
                         what + " at y = " + std::to_string(y) + " (bits " + std::to_string(f32_as_bits(y)) + ")");
}

// estimate_code's constants (quant8_map.h). Decade d's entries start at `first` (positive
// side), `count` of them, the centres of an even grid over [0.1, 1] * 10^(d-6); its region
// runs from 0.1 to 1 times 10^(d-6) (the place w then runs from first - 0.5 to first +
// count - 0.5, so the guess never passes the decade's last entry).
void set_estimate(Quant8Map& map) {
  for (int r = 0; r < kRegionSlots; ++r) map.region_end[r] = INFINITY;
  const float zero_place = map.zero_code + 0.5f;  // floor: the zero code; 254 - ceil: the one below
  map.estimate_scale[0] = 0.0f;
  map.estimate_offset[0] = -zero_place;
  for (int d = 0; d < kExponentBits; ++d) {
    const int count = map.is_signed ? 1 << d : 2 << d;
    const int first = map.is_signed ? 127 + count : count - 1;
    const double decade = static_cast<float>(kDecade[d]);
    map.region_end[d] = static_cast<float>(decade * 0.1);
    map.estimate_scale[d + 1] = static_cast<float>(count / (0.9 * decade));
    map.estimate_offset[d + 1] = static_cast<float>(count / 9.0 + 0.5 - first);
  }
  map.region_end[kExponentBits] = 1.0f;  // 1.0's region
  for (int r = kRegions - 1; r < kRegionSlots; ++r) {
    map.estimate_scale[r] = 0.0f;
    map.estimate_offset[r] = -254.0f;  // 254: one below 1.0's code; 254 - 254 = 0 for y <= -1
  }
  auto region = [&](float a) {
    int r = 0;
    while (r < kRegions - 1 && a >= map.region_end[r]) ++r;
    return r;
  };
  // A binade holds at most one region boundary (a decade spans more than three binades).
  for (int b = 0; b < kBinadeSlots; ++b) {
    const float lo = b == 0 ? 0.0f : std::ldexp(1.0f, b - 24);
    map.region_of_binade[b] = region(lo);
    if (b < 25 && region(next_down(std::ldexp(1.0f, b - 23))) > map.region_of_binade[b] + 1) {
      bad_estimate(map, lo, "finds a binade holding two region boundaries");
    }
  }
}

// Checks estimate_code at every point where it or the code can change, and beside each:
// in between, the code is constant and the guess monotone, so it holds everywhere.
void check_estimate(const Quant8Map& map) {
  const float top = next_up(1.0f);
  std::vector<float> points = {0.0f, -0.0f, top, -top, 1.0f, -1.0f, f32_from_bits(1u), -f32_from_bits(1u)};
  auto add = [&](float f) {
    for (float p : {f, next_up(f), next_down(f), -f, next_up(-f), next_down(-f)}) {
      if (std::fabs(p) <= top) points.push_back(p);
    }
  };
  for (int i = 0; i + 1 < kCodes; ++i) add(map.threshold[i]);
  for (int r = 0; r < kRegions - 1; ++r) add(map.region_end[r]);
  for (int b = 1; b < 25; ++b) add(std::ldexp(1.0f, b - 24));
  for (float y : points) {
    const int guess = estimate_code(y, map);
    const int code = code_search(y, map.threshold);
    if (guess < 0 || guess > 255 || guess > code || code > guess + 1) bad_estimate(map, y, "misses the code");
  }
}

std::unique_ptr<Quant8Map> build(bool is_signed) {
  auto map = std::make_unique<Quant8Map>();
  const std::array<float, kCodes> code = dynamic_map(is_signed);
  std::copy(code.begin(), code.end(), map->code);
  map->is_signed = is_signed;
  map->zero_code = static_cast<std::uint8_t>(std::find(code.begin(), code.end(), 0.0f) - code.begin());
  complete(*map);
  split_planes(map->code, map->code_planes);
  split_planes(map->threshold, map->threshold_planes);
  set_estimate(*map);
  check_estimate(*map);
  return map;
}

}  // namespace

std::array<float, kCodes> dynamic_map(bool is_signed) {
  std::vector<float> data;
  for (int k = 0; k < kExponentBits; ++k) {
    const int fraction_items = is_signed ? (1 << k) + 1 : (1 << (k + 1)) + 1;
    const std::vector<float> bounds = linspace_f32(0.1f, 1.0f, fraction_items);
    const float scale = static_cast<float>(kDecade[k]);
    for (int j = 0; j + 1 < fraction_items; ++j) {
      const float mean = (bounds[static_cast<std::size_t>(j)] + bounds[static_cast<std::size_t>(j) + 1]) / 2.0f;
      data.push_back(scale * mean);
      if (is_signed) data.push_back(-scale * mean);
    }
  }
  // additional_items = 2^(7 - 7) - 1 = 0: no linear region.
  data.push_back(0.0f);
  data.push_back(1.0f);
  if (data.size() != static_cast<std::size_t>(kCodes)) {
    throw std::logic_error("hipferry: the dynamic map has " + std::to_string(data.size()) + " entries, not 256");
  }
  std::sort(data.begin(), data.end());
  std::array<float, kCodes> out;
  std::copy(data.begin(), data.end(), out.begin());
  return out;
}

const Quant8Map& quant8_map(bool is_signed) {
  static const std::unique_ptr<Quant8Map> maps[2] = {build(false), build(true)};
  return *maps[is_signed ? 1 : 0];
}

}  // namespace hipferry::optim::q8
