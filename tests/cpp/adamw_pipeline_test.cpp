// The streamed AdamW schedule (csrc/core/optim/adamw_pipeline.h) against fake
// streams with adversarial completion: the result must be bit-identical to
// adamw_cpu (adamw8bit_cpu for 8-bit moments) run in order over the whole
// arrays (hipferry owns both sides), with no ordering hazard, for random sizes,
// chunks, slots, dtypes and state formats; a broken ring must be caught; host
// mode (ImmediateStreams) must agree too.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "csrc/core/convert.h"
#include "csrc/core/optim/adamw8bit_cpu.h"
#include "csrc/core/optim/adamw_pipeline.h"
#include "csrc/core/schedule/host_streams.h"
#include "tests/cpp/fake_device.h"

namespace hipferry::optim {
namespace {

using fake::FakeDevice;

class RingWithoutAcquireWait : public schedule::SlotRing {
 public:
  using SlotRing::SlotRing;
  void acquire(std::size_t, schedule::Stream&) override {}
};

struct Param {
  std::int64_t n = 0;
  ElementType ptype = ElementType::kFloat32, gtype = ElementType::kFloat32;
  std::vector<std::uint8_t> param, grad;  // raw bytes in ptype / gtype
  std::vector<float> master, m, v, vmax;  // (8-bit: empty but master)
  bool q8 = false;
  std::vector<std::uint8_t> mq, vq, xq;  // 8-bit codes
  std::vector<float> ms, vs, xs;         // and their scales
};

// Moments in 8 bits, from the float32 ones: codes and scales as the optimizer keeps them.
void to_8bit(Param& p) {
  const auto blocks = static_cast<std::size_t>((p.n + 255) / 256);
  const auto quantize = [&](const std::vector<float>& x, bool is_signed, std::vector<std::uint8_t>& codes,
                            std::vector<float>& scales) {
    codes.resize(x.size());
    scales.resize(blocks);
    quantize_blockwise8(cpu::Isa::kBaseline, x.data(), is_signed, codes.data(), scales.data(), 0, p.n);
  };
  quantize(p.m, true, p.mq, p.ms);
  quantize(p.v, false, p.vq, p.vs);
  if (!p.vmax.empty()) quantize(p.vmax, false, p.xq, p.xs);
  p.m.clear();
  p.v.clear();
  p.vmax.clear();
  p.q8 = true;
}

std::size_t bytes_of(ElementType t) { return t == ElementType::kFloat32 ? 4 : 2; }

void put(std::uint8_t* at, ElementType t, float x) {
  if (t == ElementType::kFloat32) {
    std::memcpy(at, &x, 4);
  } else {
    const std::uint16_t h = t == ElementType::kFloat16 ? f32_to_f16_rne(x) : f32_to_bf16_rne(x);
    std::memcpy(at, &h, 2);
  }
}

std::vector<Param> random_params(std::mt19937_64& rng, bool amsgrad, bool some_8bit = false) {
  std::vector<Param> ps(std::uniform_int_distribution<int>(1, 4)(rng));
  std::normal_distribution<float> normal(0, 1);
  const ElementType types[] = {ElementType::kFloat32, ElementType::kFloat16, ElementType::kBFloat16};
  const bool low = rng() & 1;  // low-precision parameters with masters (all or none, as OffloadAdamW groups them)
  for (Param& p : ps) {
    p.n = std::uniform_int_distribution<std::int64_t>(1, 2500)(rng);
    p.ptype = low ? types[1 + (rng() & 1)] : ElementType::kFloat32;
    p.gtype = types[rng() % 3];
    p.param.resize(p.n * bytes_of(p.ptype));
    p.grad.resize(p.n * bytes_of(p.gtype));
    p.m.resize(p.n);
    p.v.resize(p.n);
    if (amsgrad) p.vmax.resize(p.n);
    if (low) p.master.resize(p.n);
    for (std::int64_t i = 0; i < p.n; ++i) {
      const float w = normal(rng);
      put(p.param.data() + i * bytes_of(p.ptype), p.ptype, w);
      if (low) p.master[i] = w;
      put(p.grad.data() + i * bytes_of(p.gtype), p.gtype, normal(rng));
      p.m[i] = 0.1f * normal(rng);
      p.v[i] = std::abs(normal(rng));
      if (amsgrad) p.vmax[i] = p.v[i] * 1.5f;
    }
    if (some_8bit && (rng() & 1)) to_8bit(p);
  }
  return ps;
}

std::vector<StreamedArrays> arrays_of(std::vector<Param>& ps) {
  std::vector<StreamedArrays> out;
  for (Param& p : ps) {
    StreamedArrays a;
    a.numel = p.n;
    a.param = p.param.data();
    a.param_type = p.ptype;
    a.grad = p.grad.data();
    a.grad_type = p.gtype;
    a.master = p.master.empty() ? nullptr : p.master.data();
    if (p.q8) {
      a.quant8 = true;
      a.exp_avg8 = {p.mq.data(), p.ms.data()};
      a.exp_avg_sq8 = {p.vq.data(), p.vs.data()};
      a.max_exp_avg_sq8 = {p.xq.empty() ? nullptr : p.xq.data(), p.xs.empty() ? nullptr : p.xs.data()};
    } else {
      a.exp_avg = p.m.data();
      a.exp_avg_sq = p.v.data();
      a.max_exp_avg_sq = p.vmax.empty() ? nullptr : p.vmax.data();
    }
    out.push_back(a);
  }
  return out;
}

// The parameter and gradient fields of either step's arrays.
template <class Arrays>
void set_param_and_grad(Arrays& a, Param& p) {
  if (!p.master.empty()) {
    a.param = p.master.data();
    a.param_out = p.param.data();
    a.out_type = p.ptype;
  } else {
    a.param = reinterpret_cast<float*>(p.param.data());
  }
  a.grad = p.grad.data();
  a.grad_type = p.gtype;
}

// The oracle: adamw_cpu (adamw8bit_cpu) over each whole parameter, in order.
void reference_step(std::vector<Param>& ps, const AdamWScalars& s) {
  for (Param& p : ps) {
    if (p.q8) {
      AdamW8bitArrays a;
      set_param_and_grad(a, p);
      a.exp_avg = {p.mq.data(), p.ms.data()};
      a.exp_avg_sq = {p.vq.data(), p.vs.data()};
      if (!p.xq.empty()) a.max_exp_avg_sq = {p.xq.data(), p.xs.data()};
      adamw8bit_cpu(a, s, 0, p.n);
      continue;
    }
    AdamWArrays a;
    set_param_and_grad(a, p);
    a.exp_avg = p.m.data();
    a.exp_avg_sq = p.v.data();
    a.max_exp_avg_sq = p.vmax.empty() ? nullptr : p.vmax.data();
    adamw_cpu(a, s, 0, p.n);
  }
}

// Scales compared bit for bit (a NaN scale is a NaN block: it must match too).
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

bool same(const std::vector<Param>& a, const std::vector<Param>& b) {
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i].param != b[i].param || a[i].master != b[i].master || a[i].m != b[i].m || a[i].v != b[i].v ||
        a[i].vmax != b[i].vmax || a[i].mq != b[i].mq || a[i].vq != b[i].vq || a[i].xq != b[i].xq ||
        !same_bits(a[i].ms, b[i].ms) || !same_bits(a[i].vs, b[i].vs) || !same_bits(a[i].xs, b[i].xs)) {
      return false;
    }
  }
  return true;
}

struct Outcome {
  bool same = false;
  bool eight_bit = false;  // some parameter had 8-bit moments
  std::vector<std::string> hazards;
};

// A ring of `bytes`, float-aligned.
struct RingMemory {
  explicit RingMemory(std::size_t bytes) : floats(bytes / 4 + 1) {}
  void* data() { return floats.data(); }
  std::vector<float> floats;
};

bool any_8bit(const std::vector<Param>& ps) {
  for (const Param& p : ps) {
    if (p.q8) return true;
  }
  return false;
}

Outcome run(std::uint64_t seed, bool broken, bool threaded = false) {
  std::mt19937_64 rng(seed);
  const bool amsgrad = rng() & 1;
  std::vector<Param> ps = random_params(rng, amsgrad, /*some_8bit=*/seed % 3 == 0), expected = ps;
  // 8-bit state streams in whole blocks of 256
  const std::int64_t chunk = any_8bit(ps) ? 256 * std::uniform_int_distribution<std::int64_t>(1, 3)(rng)
                                          : std::uniform_int_distribution<std::int64_t>(1, 700)(rng);
  const int slots = std::uniform_int_distribution<int>(2, 4)(rng);
  FakeDevice dev(FakeDevice::Options{seed, 0, threaded, 3});
  auto in = dev.stream("in"), compute = dev.stream("compute"), out = dev.stream("out");
  std::unique_ptr<schedule::SlotRing> ring;
  if (broken) ring = std::make_unique<RingWithoutAcquireWait>(slots);
  AdamWPipeline pipeline(chunk, slots, std::move(ring));
  std::vector<StreamedArrays> arrays = arrays_of(ps);
  const std::size_t slot_bytes = adamw_slot_bytes(arrays, amsgrad, chunk);
  RingMemory ring_memory(slots * slot_bytes);
  for (int step = 1; step <= 2; ++step) {
    AdamWHyper h;
    h.lr = 1e-2 * step;
    h.amsgrad = amsgrad;
    h.maximize = step == 2 && (seed & 1);
    const AdamWScalars s = adamw_scalars(h, step);
    pipeline.step(arrays, s, AdamWStreams{*in, *compute, *out}, ring_memory.data(), slot_bytes, step == 1, {});
    reference_step(expected, s);
  }
  pipeline.synchronize();
  for (Param& p : ps) {
    dev.host_reads(p.m.data(), p.m.size() * 4);
    dev.host_reads(p.mq.data(), p.mq.size());
    dev.host_reads(p.ms.data(), p.ms.size() * 4);
    dev.host_reads(p.param.data(), p.param.size());
  }
  Outcome o;
  o.same = same(ps, expected);
  o.eight_bit = any_8bit(ps);
  o.hazards = dev.hazards();
  return o;
}

TEST(AdamWPipelineProperty, AdversarialStreamsGiveTheSequentialBits) {
  int eight_bit = 0;
  for (std::uint64_t seed = 1; seed <= 120; ++seed) {
    const Outcome o = run(seed, /*broken=*/false);
    ASSERT_TRUE(o.hazards.empty()) << "seed " << seed << ": " << o.hazards.front();
    ASSERT_TRUE(o.same) << "seed " << seed;
    eight_bit += o.eight_bit;
  }
  EXPECT_GT(eight_bit, 20) << "8-bit moments were streamed";
}

TEST(AdamWPipelineProperty, ThreadedDeviceGivesTheSequentialBits) {
  for (std::uint64_t seed = 1; seed <= 10; ++seed) {
    const Outcome o = run(seed, false, /*threaded=*/true);
    ASSERT_TRUE(o.hazards.empty()) << "seed " << seed << ": " << o.hazards.front();
    ASSERT_TRUE(o.same) << "seed " << seed;
  }
}

TEST(AdamWPipelineBroken, ARingThatRefillsEarlyIsCaught) {
  int caught = 0;
  for (std::uint64_t seed = 1; seed <= 40; ++seed) caught += !run(seed, /*broken=*/true).hazards.empty();
  EXPECT_GT(caught, 10);
}

TEST(AdamWPipeline, HostModeGivesTheSequentialBits) {
  for (std::uint64_t seed = 1; seed <= 30; ++seed) {
    std::mt19937_64 rng(seed);
    const bool amsgrad = seed & 1;
    std::vector<Param> ps = random_params(rng, amsgrad, /*some_8bit=*/true), expected = ps;
    schedule::ImmediateStream in("in"), compute("compute"), out("out");
    AdamWPipeline pipeline(any_8bit(ps) ? 256 : std::uniform_int_distribution<std::int64_t>(1, 300)(rng), 2);
    std::vector<StreamedArrays> arrays = arrays_of(ps);
    const std::size_t per_slot = adamw_slot_bytes(arrays, amsgrad, pipeline.chunk_numel());
    RingMemory ring(2 * per_slot);
    AdamWHyper h;
    h.amsgrad = amsgrad;
    const AdamWScalars s = adamw_scalars(h, 3);
    pipeline.step(arrays, s, AdamWStreams{in, compute, out}, ring.data(), per_slot, true, {});
    EXPECT_TRUE(pipeline.idle());
    reference_step(expected, s);
    ASSERT_TRUE(same(ps, expected)) << "seed " << seed;
  }
}

TEST(AdamWPipeline, RejectsBadShapesAndReportsStreamErrors) {
  EXPECT_THROW(AdamWPipeline(0, 2), std::invalid_argument);
  EXPECT_THROW(AdamWPipeline(4, 1), std::invalid_argument);
  std::mt19937_64 rng(3);
  std::vector<Param> ps = random_params(rng, false);
  std::vector<StreamedArrays> arrays = arrays_of(ps);
  FakeDevice dev(FakeDevice::Options{});
  auto in = dev.stream("in"), compute = dev.stream("compute"), out = dev.stream("out");
  AdamWPipeline pipeline(64, 2);
  const std::size_t slot_bytes = adamw_slot_bytes(arrays, false, 64);
  RingMemory ring(2 * slot_bytes);
  const AdamWScalars s = adamw_scalars(AdamWHyper{}, 1);
  EXPECT_THROW(pipeline.step(arrays, s, AdamWStreams{*in, *compute, *out}, ring.data(), slot_bytes - 1, true, {}),
               std::invalid_argument);
  std::vector<Param> q = random_params(rng, false);
  to_8bit(q[0]);
  std::vector<StreamedArrays> q_arrays = arrays_of(q);
  RingMemory q_ring(2 * adamw_slot_bytes(q_arrays, false, 64));
  EXPECT_THROW(pipeline.step(q_arrays, s, AdamWStreams{*in, *compute, *out}, q_ring.data(),
                             adamw_slot_bytes(q_arrays, false, 64), true, {}),
               std::invalid_argument)
      << "8-bit state in chunks that are not whole blocks";
  EXPECT_EQ(dev.work_queued(), 0u) << "a rejected step queues nothing";
  dev.fail_work(2);
  pipeline.step(arrays, s, AdamWStreams{*in, *compute, *out}, ring.data(), slot_bytes, true, {});
  EXPECT_THROW(pipeline.synchronize(), std::runtime_error);
  EXPECT_THROW(pipeline.synchronize(), std::runtime_error) << "every waiter sees the error";
}

}  // namespace
}  // namespace hipferry::optim
