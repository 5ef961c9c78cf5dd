// A bf16/fp16 parameter written where no version counter shows (Note [a write the master does not
// see] in adamw_update.h): with adopt_out, the fused pass takes the written elements as the master
// before the step, and leaves every other element as the step without it does. Every CPU build
// gives the same bits, for the float32 step and the 8-bit step.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "csrc/core/convert.h"
#include "csrc/core/cpu/cpu_isa.h"
#include "csrc/core/optim/adamw8bit_cpu.h"
#include "csrc/core/optim/adamw_cpu.h"
#include "tests/cpp/adamw_arrays.h"

namespace hipferry::optim {
namespace {

constexpr std::size_t kN = 1000;

struct Bf16Param {
  std::vector<float> master, g, m, v, x;
  std::vector<std::uint16_t> out;  // bfloat16: the parameter, the rounded master after a step
  Bf16Param() : master(kN), g(kN), m(kN, 0.f), v(kN, 0.f), x(kN, 0.f), out(kN) {
    std::mt19937 rng(5);
    std::normal_distribution<float> d(0.f, 1.f);
    for (std::size_t i = 0; i < kN; ++i) {
      master[i] = d(rng);
      g[i] = d(rng) * 1e-2f;
      out[i] = from_f32<BFloat16>(master[i]);
    }
  }
  AdamWArrays arrays(bool adopt) {
    AdamWArrays a = float32_arrays(master.data(), g.data(), m.data(), v.data(), x.data());
    a.param_out = out.data();
    a.out_type = ElementType::kBFloat16;
    a.adopt_out = adopt;
    return a;
  }
};

AdamWScalars scalars() { return adamw_scalars(AdamWHyper{.lr = 1e-2}, 1); }

// Every 3rd element written by the user (a bf16 value far from its master), one NaN written too.
void write_some(Bf16Param& r) {
  for (std::size_t i = 0; i < kN; i += 3) r.out[i] = from_f32<BFloat16>(2.5f + static_cast<float>(i) * 1e-3f);
  r.out[7] = 0x7fc1;  // a NaN with another payload: written, so adopted (as the one NaN after the step)
}

TEST(AdamWAdopt, WrittenElementsBecomeTheMasterOthersStepAsWithout) {
  Bf16Param adopted, told;  // told: the master set to the written values by hand (what reload_params() does)
  write_some(adopted);
  write_some(told);
  for (std::size_t i = 0; i < kN; ++i) {
    if (i % 3 == 0 || i == 7) told.master[i] = to_f32<BFloat16>(told.out[i]);
  }
  Bf16Param untouched;  // no write, adopt on: the same bits as adopt off
  Bf16Param plain;
  adamw_cpu(adopted.arrays(true), scalars(), 0, kN);
  adamw_cpu(told.arrays(false), scalars(), 0, kN);
  adamw_cpu(untouched.arrays(true), scalars(), 0, kN);
  adamw_cpu(plain.arrays(false), scalars(), 0, kN);
  EXPECT_EQ(0, std::memcmp(adopted.master.data(), told.master.data(), kN * sizeof(float)));
  EXPECT_EQ(adopted.out, told.out);
  EXPECT_EQ(0, std::memcmp(untouched.master.data(), plain.master.data(), kN * sizeof(float)));
  EXPECT_NE(0, std::memcmp(adopted.master.data(), plain.master.data(), kN * sizeof(float)));
}

TEST(AdamWAdopt, EveryBuildGivesTheSameBits) {
  for (cpu::Isa isa : {cpu::Isa::kBaseline, cpu::best_isa()}) {
    Bf16Param a, b;
    write_some(a);
    write_some(b);
    adamw_cpu_isa(cpu::Isa::kBaseline, a.arrays(true), scalars(), 0, kN);
    adamw_cpu_isa(isa, b.arrays(true), scalars(), 0, kN);
    EXPECT_EQ(0, std::memcmp(a.master.data(), b.master.data(), kN * sizeof(float)));
    EXPECT_EQ(a.out, b.out);
  }
}

TEST(AdamWAdopt, TheEightBitStepAdoptsTheSameWay) {
  for (cpu::Isa isa : {cpu::Isa::kBaseline, cpu::best_isa()}) {
    Bf16Param adopted, told;
    write_some(adopted);
    write_some(told);
    for (std::size_t i = 0; i < kN; ++i) {
      if (i % 3 == 0 || i == 7) told.master[i] = to_f32<BFloat16>(told.out[i]);
    }
    std::vector<std::uint8_t> codes[2][2];
    std::vector<float> scales[2][2];
    Bf16Param* runs[2] = {&adopted, &told};
    for (int r = 0; r < 2; ++r) {
      AdamW8bitArrays a;
      for (int k = 0; k < 2; ++k) {
        codes[r][k].assign(kN, 0);
        scales[r][k].assign((kN + 255) / 256, 0.f);  // scale 0: a zero state
      }
      a.param = runs[r]->master.data();
      a.grad = runs[r]->g.data();
      a.exp_avg = {codes[r][0].data(), scales[r][0].data()};
      a.exp_avg_sq = {codes[r][1].data(), scales[r][1].data()};
      a.param_out = runs[r]->out.data();
      a.out_type = ElementType::kBFloat16;
      a.adopt_out = r == 0;
      adamw8bit_cpu_isa(isa, a, scalars(), 0, kN);
    }
    EXPECT_EQ(0, std::memcmp(adopted.master.data(), told.master.data(), kN * sizeof(float)));
    EXPECT_EQ(adopted.out, told.out);
    EXPECT_EQ(codes[0][0], codes[1][0]);
    EXPECT_EQ(scales[0][1], scales[1][1]);
  }
}

}  // namespace
}  // namespace hipferry::optim
