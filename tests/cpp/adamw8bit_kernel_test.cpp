// The fused 8-bit AdamW kernel against the CPU loop: both run quant8.h's element code
// (dequantize, adamw_update, a max of bits for the scales, comparisons for the codes), so
// parameters, codes and scales are bit-identical. The CPU-only build runs the loop (checked
// too); the GPU cases skip without a device.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "csrc/core/convert.h"
#include "hip/adamw8bit_kernel.h"

namespace hipferry {
namespace {

// Host arrays of one parameter: float32 param, bfloat16 grad and param_out, 8-bit m, v, max_v.
struct Host8 {
  std::size_t n, blocks;
  std::vector<float> p, scales;  // scales: m, v, max_v, blocks each
  std::vector<std::uint16_t> g, out;
  std::vector<std::uint8_t> codes;  // m, v, max_v, n each
  explicit Host8(std::size_t size)
      : n(size), blocks((size + 255) / 256), p(size), scales(3 * blocks), g(size), out(size), codes(3 * size) {
    std::mt19937 rng(42);
    std::normal_distribution<float> d(0.f, 1.f);
    std::vector<float> m(n), v(n);
    for (std::size_t i = 0; i < n; ++i) {
      p[i] = d(rng);
      g[i] = f32_to_bf16_rne(d(rng) * 1e-2f);
      m[i] = d(rng) * 1e-3f;
      v[i] = std::fabs(d(rng)) * 1e-5f;
    }
    const auto len = static_cast<std::int64_t>(n);
    optim::quantize_blockwise8(cpu::Isa::kBaseline, m.data(), true, codes.data(), scales.data(), 0, len);
    optim::quantize_blockwise8(cpu::Isa::kBaseline, v.data(), false, codes.data() + n, scales.data() + blocks, 0, len);
    std::copy(codes.begin() + n, codes.begin() + 2 * n, codes.begin() + 2 * n);
    std::copy(scales.begin() + blocks, scales.begin() + 2 * blocks, scales.begin() + 2 * blocks);
  }
};

// The arrays of `h`'s layout at the given bases (host or device addresses of the same layout).
optim::AdamW8bitArrays arrays(const Host8& h, float* p, void* g, std::uint8_t* codes, float* scales, void* out) {
  optim::AdamW8bitArrays a;
  a.param = p;
  a.grad = g;
  a.grad_type = ElementType::kBFloat16;
  a.exp_avg = {codes, scales};
  a.exp_avg_sq = {codes + h.n, scales + h.blocks};
  a.max_exp_avg_sq = {codes + 2 * h.n, scales + 2 * h.blocks};
  a.param_out = out;
  a.out_type = ElementType::kBFloat16;
  return a;
}

optim::AdamWScalars scalars(int step) {
  optim::AdamWHyper h;
  h.amsgrad = true;
  h.lr = 1e-2;
  return optim::adamw_scalars(h, step);
}

TEST(AdamW8bitKernel, CpuBuildLaunchRunsTheLoop) {
  if (rt::build_info().platform != "cpu") GTEST_SKIP() << "GPU build";
  Host8 a(1000), b(1000);
  for (int t = 1; t <= 3; ++t) {
    gpu::launch_adamw8bit(arrays(a, a.p.data(), a.g.data(), a.codes.data(), a.scales.data(), a.out.data()), scalars(t),
                          1000, nullptr, 0);
    optim::adamw8bit_cpu(arrays(b, b.p.data(), b.g.data(), b.codes.data(), b.scales.data(), b.out.data()), scalars(t),
                         0, 1000);
  }
  EXPECT_EQ(std::memcmp(a.p.data(), b.p.data(), 4000), 0);
  EXPECT_EQ(a.codes, b.codes);
}

template <class T>
T* mapped_copy(const std::vector<T>& v) {
  auto* host = static_cast<T*>(rt::host_alloc(v.size() * sizeof(T), rt::kHostPortable | rt::kHostMapped));
  std::copy(v.begin(), v.end(), host);
  return host;
}

template <class T>
T* dev(T* host) {
  return static_cast<T*>(rt::host_device_pointer(host));
}

// In place over 5 steps, then once out of place (the speculative step's form).
TEST(AdamW8bitKernelGpu, BitIdenticalToTheCpuLoop) {
  if (rt::device_count() == 0) GTEST_SKIP() << "no GPU device";
  rt::set_device(0);
  constexpr std::size_t n = 100003;  // a short last block
  Host8 cpu(n), gpu_state(n);
  float* p = mapped_copy(gpu_state.p);
  float* scales = mapped_copy(gpu_state.scales);
  std::uint16_t* g = mapped_copy(gpu_state.g);
  std::uint16_t* out = mapped_copy(gpu_state.out);
  std::uint8_t* codes = mapped_copy(gpu_state.codes);
  rt::Stream stream(0);
  for (int t = 1; t <= 5; ++t) {
    gpu::launch_adamw8bit(arrays(gpu_state, dev(p), dev(g), dev(codes), dev(scales), dev(out)), scalars(t), n,
                          stream.handle(), 0);
    optim::adamw8bit_cpu(arrays(cpu, cpu.p.data(), cpu.g.data(), cpu.codes.data(), cpu.scales.data(), cpu.out.data()),
                         scalars(t), 0, n);
  }
  stream.synchronize();
  EXPECT_EQ(std::memcmp(p, cpu.p.data(), n * 4), 0);
  EXPECT_EQ(std::memcmp(scales, cpu.scales.data(), cpu.scales.size() * 4), 0);
  EXPECT_EQ(std::vector<std::uint8_t>(codes, codes + 3 * n), cpu.codes);
  EXPECT_EQ(std::vector<std::uint16_t>(out, out + n), cpu.out);

  // Out of place: read the state just compared, write fresh arrays.
  float* p2 = mapped_copy(std::vector<float>(n, 0.f));
  float* scales2 = mapped_copy(std::vector<float>(cpu.scales.size(), 0.f));
  std::uint8_t* codes2 = mapped_copy(std::vector<std::uint8_t>(3 * n, 0));
  optim::AdamW8bitArrays a = arrays(gpu_state, dev(p2), dev(g), dev(codes2), dev(scales2), dev(out));
  const optim::AdamW8bitArrays in = arrays(gpu_state, dev(p), dev(g), dev(codes), dev(scales), dev(out));
  a.param_in = in.param;
  a.exp_avg_in = {in.exp_avg.codes, in.exp_avg.absmax};
  a.exp_avg_sq_in = {in.exp_avg_sq.codes, in.exp_avg_sq.absmax};
  a.max_exp_avg_sq_in = {in.max_exp_avg_sq.codes, in.max_exp_avg_sq.absmax};
  gpu::launch_adamw8bit(a, scalars(6), n, stream.handle(), 0);
  optim::adamw8bit_cpu(arrays(cpu, cpu.p.data(), cpu.g.data(), cpu.codes.data(), cpu.scales.data(), cpu.out.data()),
                       scalars(6), 0, n);
  stream.synchronize();
  EXPECT_EQ(std::memcmp(p2, cpu.p.data(), n * 4), 0);
  EXPECT_EQ(std::memcmp(scales2, cpu.scales.data(), cpu.scales.size() * 4), 0);
  EXPECT_EQ(std::vector<std::uint8_t>(codes2, codes2 + 3 * n), cpu.codes);
  for (void* ptr :
       {static_cast<void*>(p), static_cast<void*>(scales), static_cast<void*>(g), static_cast<void*>(out),
        static_cast<void*>(codes), static_cast<void*>(p2), static_cast<void*>(scales2), static_cast<void*>(codes2)}) {
    rt::host_free(ptr);
  }
}

}  // namespace
}  // namespace hipferry
