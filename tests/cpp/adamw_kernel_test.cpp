// The fused AdamW kernel against the CPU loop: both run optim::adamw_update
// and neither contracts a*b+c into an FMA, so the results are bit-identical.
// The CPU-only build runs the loop in place (checked too); the GPU case skips
// without a device.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "csrc/core/convert.h"
#include "hip/adamw_kernel.h"
#include "tests/cpp/adamw_arrays.h"

namespace hipferry {
namespace {

struct HostState {
  std::vector<float> p, m, v, vmax;
  std::vector<std::uint16_t> g, out;
  explicit HostState(std::size_t n) : p(n), m(n, 0.f), v(n, 0.f), vmax(n, 0.f), g(n), out(n, 0) {
    std::mt19937 rng(42);
    std::normal_distribution<float> d(0.f, 1.f);
    for (std::size_t i = 0; i < n; ++i) {
      p[i] = d(rng);
      g[i] = f32_to_bf16_rne(d(rng) * 1e-2f);
    }
  }
  optim::AdamWArrays arrays(float* base_p, void* base_g, float* base_m, float* base_v, float* base_vmax,
                            void* base_out) {
    optim::AdamWArrays a = optim::float32_arrays(base_p, base_g, base_m, base_v, base_vmax);
    a.grad_type = ElementType::kBFloat16;
    a.param_out = base_out;
    a.out_type = ElementType::kBFloat16;
    return a;
  }
};

optim::AdamWScalars scalars(int step) {
  optim::AdamWHyper h;
  h.amsgrad = true;
  return optim::adamw_scalars(h, step);
}

TEST(AdamWKernel, CpuBuildLaunchRunsTheLoopInPlace) {
  if (rt::build_info().platform != "cpu") GTEST_SKIP() << "GPU build";
  HostState a(1000), b(1000);
  for (int t = 1; t <= 3; ++t) {
    gpu::launch_adamw(a.arrays(a.p.data(), a.g.data(), a.m.data(), a.v.data(), a.vmax.data(), a.out.data()), scalars(t),
                      1000, nullptr, 0);
    optim::adamw_cpu(b.arrays(b.p.data(), b.g.data(), b.m.data(), b.v.data(), b.vmax.data(), b.out.data()), scalars(t),
                     0, 1000);
  }
  EXPECT_EQ(a.p, b.p);
  EXPECT_EQ(a.out, b.out);
}

TEST(AdamWKernelGpu, BitIdenticalToTheCpuLoop) {
  if (rt::device_count() == 0) GTEST_SKIP() << "no GPU device";
  rt::set_device(0);
  constexpr std::size_t n = 100003;
  HostState cpu(n), gpu_state(n);
  // Mapped pinned memory: the kernel reads and writes it where it lies.
  auto alloc = [](std::size_t bytes) { return rt::host_alloc(bytes, rt::kHostPortable | rt::kHostMapped); };
  float* p = static_cast<float*>(alloc(n * 4));
  float* m = static_cast<float*>(alloc(n * 4));
  float* v = static_cast<float*>(alloc(n * 4));
  float* vmax = static_cast<float*>(alloc(n * 4));
  auto* g = static_cast<std::uint16_t*>(alloc(n * 2));
  auto* out = static_cast<std::uint16_t*>(alloc(n * 2));
  std::copy(gpu_state.p.begin(), gpu_state.p.end(), p);
  std::fill(m, m + n, 0.f);
  std::fill(v, v + n, 0.f);
  std::fill(vmax, vmax + n, 0.f);
  std::copy(gpu_state.g.begin(), gpu_state.g.end(), g);
  auto dev = [](void* host) { return rt::host_device_pointer(host); };
  rt::Stream stream(0);
  for (int t = 1; t <= 5; ++t) {
    optim::AdamWArrays a;
    a.param = static_cast<float*>(dev(p));
    a.grad = dev(g);
    a.grad_type = ElementType::kBFloat16;
    a.exp_avg = static_cast<float*>(dev(m));
    a.exp_avg_sq = static_cast<float*>(dev(v));
    a.max_exp_avg_sq = static_cast<float*>(dev(vmax));
    a.param_out = dev(out);
    a.out_type = ElementType::kBFloat16;
    gpu::launch_adamw(a, scalars(t), n, stream.handle(), 0);
    optim::adamw_cpu(
        cpu.arrays(cpu.p.data(), cpu.g.data(), cpu.m.data(), cpu.v.data(), cpu.vmax.data(), cpu.out.data()), scalars(t),
        0, n);
  }
  stream.synchronize();
  EXPECT_EQ(std::vector<float>(p, p + n), cpu.p);
  EXPECT_EQ(std::vector<float>(m, m + n), cpu.m);
  EXPECT_EQ(std::vector<float>(v, v + n), cpu.v);
  EXPECT_EQ(std::vector<std::uint16_t>(out, out + n), cpu.out);
  for (void* ptr : {static_cast<void*>(p), static_cast<void*>(m), static_cast<void*>(v), static_cast<void*>(vmax),
                    static_cast<void*>(g), static_cast<void*>(out)}) {
    rt::host_free(ptr);
  }
}

// Out of place (AdamWArrays' *_in, the speculative step): the kernel reads one set of arrays and
// writes another, with the CPU loop's in-place bits, and leaves what it read as it was.
TEST(AdamWKernelGpu, OutOfPlaceBitIdenticalToTheCpuLoopInPlace) {
  if (rt::device_count() == 0) GTEST_SKIP() << "no GPU device";
  rt::set_device(0);
  constexpr std::size_t n = 50021;
  HostState cpu(n), source(n);
  for (int t = 1; t <= 2; ++t) {  // the CPU runs steps 1 and 2 in place, the source step 1
    optim::adamw_cpu(
        cpu.arrays(cpu.p.data(), cpu.g.data(), cpu.m.data(), cpu.v.data(), cpu.vmax.data(), cpu.out.data()), scalars(t),
        0, n);
  }
  optim::adamw_cpu(source.arrays(source.p.data(), source.g.data(), source.m.data(), source.v.data(), source.vmax.data(),
                                 source.out.data()),
                   scalars(1), 0, n);
  std::vector<float*> host;  // in: p m v vmax, then out: p m v vmax (mapped pinned)
  for (int i = 0; i < 8; ++i) {
    host.push_back(static_cast<float*>(rt::host_alloc(n * 4, rt::kHostPortable | rt::kHostMapped)));
  }
  auto* g = static_cast<std::uint16_t*>(rt::host_alloc(n * 2, rt::kHostPortable | rt::kHostMapped));
  auto* out = static_cast<std::uint16_t*>(rt::host_alloc(n * 2, rt::kHostPortable | rt::kHostMapped));
  const std::vector<float>* in[] = {&source.p, &source.m, &source.v, &source.vmax};
  for (int i = 0; i < 4; ++i) std::copy(in[i]->begin(), in[i]->end(), host[i]);
  std::copy(source.g.begin(), source.g.end(), g);
  auto dev = [](void* ptr) { return static_cast<float*>(rt::host_device_pointer(ptr)); };
  optim::AdamWArrays a;
  a.param_in = dev(host[0]);
  a.exp_avg_in = dev(host[1]);
  a.exp_avg_sq_in = dev(host[2]);
  a.max_exp_avg_sq_in = dev(host[3]);
  a.param = dev(host[4]);
  a.exp_avg = dev(host[5]);
  a.exp_avg_sq = dev(host[6]);
  a.max_exp_avg_sq = dev(host[7]);
  a.grad = rt::host_device_pointer(g);
  a.grad_type = ElementType::kBFloat16;
  a.param_out = rt::host_device_pointer(out);
  a.out_type = ElementType::kBFloat16;
  rt::Stream stream(0);
  gpu::launch_adamw(a, scalars(2), n, stream.handle(), 0);
  stream.synchronize();
  const std::vector<float>* want[] = {&cpu.p, &cpu.m, &cpu.v, &cpu.vmax};
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(std::vector<float>(host[4 + i], host[4 + i] + n), *want[i]) << "written array " << i;
    EXPECT_EQ(std::vector<float>(host[i], host[i] + n), *in[i]) << "read array " << i;
  }
  EXPECT_EQ(std::vector<std::uint16_t>(out, out + n), cpu.out);
  for (float* ptr : host) rt::host_free(ptr);
  rt::host_free(g);
  rt::host_free(out);
}

// NaNs of both signs with assorted payloads, quiet and signalling, and infinities in every array:
// the GPU writes the CPU loop's bits, every NaN the canonical 0x7fc00000 (Note [one NaN]; NVIDIA
// GPUs make their own NaNs as 0x7fffffff, x86 as 0xffc00000).
TEST(AdamWKernelGpu, NaNsAndInfinitiesBitIdenticalToTheCpuLoop) {
  if (rt::device_count() == 0) GTEST_SKIP() << "no GPU device";
  rt::set_device(0);
  constexpr std::size_t n = 30011;
  constexpr std::uint32_t kSpecial[] = {0x7fc00000, 0xffc00000, 0x7fc00001, 0xffffffff, 0x7f800001,
                                        0xff800123, 0x7f800000, 0xff800000, 0x00000000};
  constexpr std::uint16_t kSpecialBF16[] = {0x7fc0, 0xffc1, 0x7f81, 0xff80, 0x7f80};
  HostState cpu(n);
  std::mt19937 rng(3);
  for (std::vector<float>* a : {&cpu.p, &cpu.m, &cpu.v, &cpu.vmax}) {
    for (std::size_t i = 0; i < n; ++i) {
      if (rng() % 4 == 0) (*a)[i] = f32_from_bits(kSpecial[rng() % 9]);
    }
  }
  for (std::size_t i = 0; i < n; ++i) {
    if (rng() % 4 == 0) cpu.g[i] = kSpecialBF16[rng() % 5];
  }
  // Mapped pinned copies of the same inputs, in this order: p m v vmax (float32), g out (bfloat16).
  const void* inputs[] = {cpu.p.data(), cpu.m.data(), cpu.v.data(), cpu.vmax.data(), cpu.g.data(), cpu.out.data()};
  std::vector<void*> host, dev;
  for (int i = 0; i < 6; ++i) {
    const std::size_t bytes = n * (i < 4 ? 4 : 2);
    host.push_back(rt::host_alloc(bytes, rt::kHostPortable | rt::kHostMapped));
    std::memcpy(host.back(), inputs[i], bytes);
    dev.push_back(rt::host_device_pointer(host.back()));
  }
  const optim::AdamWArrays a = cpu.arrays(static_cast<float*>(dev[0]), dev[4], static_cast<float*>(dev[1]),
                                          static_cast<float*>(dev[2]), static_cast<float*>(dev[3]), dev[5]);
  rt::Stream stream(0);
  gpu::launch_adamw(a, scalars(3), n, stream.handle(), 0);
  stream.synchronize();
  optim::adamw_cpu(cpu.arrays(cpu.p.data(), cpu.g.data(), cpu.m.data(), cpu.v.data(), cpu.vmax.data(), cpu.out.data()),
                   scalars(3), 0, n);
  // inputs[] are the CPU's own arrays, updated in place: its results now.
  for (int i = 0; i < 4; ++i) EXPECT_EQ(0, std::memcmp(host[i], inputs[i], n * 4)) << "array " << i;
  EXPECT_EQ(0, std::memcmp(host[5], cpu.out.data(), n * 2)) << "param_out";
  for (void* ptr : host) rt::host_free(ptr);
}

}  // namespace
}  // namespace hipferry
