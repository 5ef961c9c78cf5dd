// run_state_pass (state_pass.h, Note [disk state layout]) over fake in-memory files that complete
// requests out of order, short, or with -EIO (fake_io_backend.h). hipferry computes both sides, so
// the state the passes leave in the files equals optim::adamw_cpu / adamw8bit_cpu run on plain
// arrays bit for bit, with the right checksums, slots alternating; a failed step changes nothing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "csrc/core/copy_cast_cpu.h"
#include "csrc/core/disk/crc32c.h"
#include "csrc/core/disk/state_pass.h"
#include "csrc/core/optim/adamw8bit_cpu.h"
#include "csrc/core/optim/adamw_cpu.h"
#include "csrc/core/optim/quant8_map.h"
#include "tests/cpp/disk_temp_files.h"
#include "tests/cpp/fake_io_backend.h"

namespace hipferry::disk {
namespace {

using fake::FakeIoConfig;
using Bytes = std::vector<unsigned char>;
using Tweak = std::function<void(PassConfig&, std::vector<ParamPass>&, std::vector<void*>&)>;
constexpr std::int64_t kQ = kChunkQuantum;

// Serial, in pieces of `grain`: split points like the torch pool's.
void serial_for(std::int64_t n, std::int64_t grain, const std::function<void(std::int64_t, std::int64_t)>& fn) {
  for (std::int64_t b = 0; b < n; b += grain) fn(b, std::min(n, b + grain));
}

float* f32(Bytes& b) { return reinterpret_cast<float*>(b.data()); }

Bytes cast(const void* src, ElementType from, ElementType to, std::int64_t n) {
  Bytes out(static_cast<std::size_t>(n) * element_size(to));
  copy_cast_cpu(src, from, out.data(), to, 0, n);
  return out;
}

struct Param {
  std::int64_t numel = 0;
  std::vector<std::uint64_t> offsets;        // per array, the same in both slots
  std::vector<std::uint32_t> crc, crc_next;  // of the state's slot; what the pass writes
  std::vector<Bytes> model;                  // per array: the state as plain arrays
  Bytes out, model_out, grad;                // out_type: the parameter, the model's, the gradient
  std::int64_t chunks() const { return (numel + kQ - 1) / kQ; }
};

// Two slots of files holding several parameters' state, and the model.
struct Store {
  StateFormat format;
  bool amsgrad;
  ElementType type;  // of out, the gradient and fill's source
  std::vector<ArrayFormat> arrays;
  std::vector<std::uint8_t> fill;  // per array
  std::vector<FileRef> files;      // [slot * arrays + array]
  std::map<int, Bytes> bytes;      // the files between passes
  std::vector<Param> params;
  std::int64_t step = 0;
  optim::AdamWHyper hyper;
  std::mt19937_64 rng;
  std::vector<disk::testing::AlignedBytes> window;
  std::vector<std::vector<Bytes>> dests;  // kRead: per parameter, per array
  std::vector<Bytes> read_out;            // kRead: per parameter, the master in `type`
  std::size_t null_source = SIZE_MAX;     // kLoad: this array filled, not copied
  Tweak tweak;                            // spoils a plan (bad-plan tests)
  std::size_t requests = 0, shorts = 0;   // of the last pass

  Store(StateFormat f, bool ams, ElementType t, const std::vector<std::int64_t>& sizes, std::uint64_t seed)
      : format(f),
        amsgrad(ams),
        type(t),
        arrays(state_arrays(f, ams)),
        hyper{/*lr=*/1e-2, 0.9, 0.999, 1e-8, /*weight_decay=*/1e-2, ams},
        rng(seed) {
    const std::size_t n = arrays.size();
    for (std::size_t a = 0; a < n; ++a) {
      const bool codes = f == StateFormat::kUint8 && a % 2 == 1;  // 1, 3, 5: exp_avg is signed
      fill.push_back(codes ? optim::q8::quant8_map(a == 1).zero_code : 0);
    }
    for (int s = 0; s < 2; ++s) {
      for (std::size_t a = 0; a < n; ++a) {
        const std::string path = "/fake/slot" + std::to_string(s) + "/" + std::to_string(a);
        files.push_back({static_cast<int>(10 + 10 * s + a), path});
        bytes[files.back().fd] = {};
      }
    }
    std::vector<std::uint64_t> at(n, 0);
    for (std::int64_t numel : sizes) {
      Param p;
      p.numel = numel;
      for (std::size_t a = 0; a < n; ++a) {
        p.offsets.push_back(at[a]);
        at[a] += region_bytes(arrays[a], numel);
        p.model.emplace_back(array_bytes(arrays[a], numel), fill[a]);
      }
      p.crc = p.crc_next = std::vector<std::uint32_t>(static_cast<std::size_t>(p.chunks()) * n, 0);
      p.model_out = p.out = random_values(numel);
      p.model[0] = cast(p.out.data(), type, ElementType::kFloat32, numel);  // what kFill makes the master
      params.push_back(std::move(p));
    }
    for (int i = 0; i < 3; ++i) {
      window.push_back(disk::testing::aligned_bytes(chunk_buffer_bytes(f, ams, kQ)));
      std::memset(window.back().get(), 0xcd, chunk_buffer_bytes(f, ams, kQ));  // stale bytes show
    }
  }

  Bytes random_values(std::int64_t n) {
    std::normal_distribution<float> d(0, 1);
    std::vector<float> x(static_cast<std::size_t>(n));
    for (float& v : x) v = d(rng);
    return cast(x.data(), ElementType::kFloat32, type, n);
  }
  void new_grads() {
    for (Param& p : params) p.grad = random_values(p.numel);
  }
  void step_with_new_grads() {
    new_grads();
    run_random(PassKind::kStep);
    model_step();
  }
  int slot() const { return static_cast<int>(step % 2); }  // the state's: fill writes 0, a step the other
  const FileRef* file(int s, std::size_t a) const { return &files[static_cast<std::size_t>(s) * arrays.size() + a]; }

  ParamPass plan(PassKind kind, std::size_t i) {
    Param& p = params[i];
    ParamPass pp;
    pp.numel = p.numel;
    pp.offsets = p.offsets;
    pp.crc_in = p.crc.data();
    pp.crc_out = p.crc_next.data();
    for (std::size_t a = 0; a < arrays.size(); ++a) {
      if (kind == PassKind::kStep || kind == PassKind::kRead) pp.read_files.push_back(file(slot(), a));
      if (kind != PassKind::kRead) pp.write_files.push_back(file(kind == PassKind::kStep ? 1 - slot() : slot(), a));
      if (kind == PassKind::kLoad) pp.sources.push_back(a == null_source ? nullptr : p.model[a].data());
      if (kind == PassKind::kRead && dests.size() == params.size()) pp.dests.push_back(dests[i][a].data());
    }
    pp.fill_bytes = fill;
    pp.grad_type = pp.out_type = pp.source_type = type;
    if (kind == PassKind::kStep) {
      pp.grad = p.grad.data();
      pp.out = p.out.data();
      pp.scalars = optim::adamw_scalars(hyper, step + 1);
    }
    if (kind == PassKind::kFill) pp.source = p.out.data();
    if (kind == PassKind::kRead && read_out.size() == params.size()) pp.out = read_out[i].data();
    return pp;
  }

  // One pass over fresh fakes holding `bytes`; the files are kept whatever happens.
  void run(PassKind kind, const FakeIoConfig& io, std::size_t request_bytes, std::size_t buffers) {
    std::vector<ParamPass> plans;
    for (std::size_t i = 0; i < params.size(); ++i) plans.push_back(plan(kind, i));
    PassConfig c{kind, format, amsgrad, kQ, serial_for};
    std::vector<void*> w;
    for (std::size_t i = 0; i < buffers; ++i) w.push_back(window[i].get());
    if (tweak) tweak(c, plans, w);
    fake::FakeIoBackend fake(io);
    fake.files = bytes;
    std::exception_ptr error;
    IoQueue queue(fake, request_bytes);
    try {
      run_state_pass(queue, w, c, plans);
    } catch (...) {
      error = std::current_exception();  // nothing is in flight (Note [no I/O after a failure returns])
    }
    bytes = fake.files;
    requests = fake.records().size();
    shorts = fake.short_count();
    if (error) std::rethrow_exception(error);
    for (Param& p : params) p.crc = kind == PassKind::kRead ? p.crc : p.crc_next;
    if (kind == PassKind::kStep) ++step;
  }

  FakeIoConfig random_io() {
    // Random completion order, reaps of a random count, 30% of requests short.
    return FakeIoConfig{rng(), 1 + rng() % 8, true, 0.5, 0.3};
  }
  std::size_t random_request_bytes() { return std::size_t{3 * 4096} << (rng() % 3 * 4); }
  void run_random(PassKind kind) { run(kind, random_io(), random_request_bytes(), 1 + rng() % 3); }

  // What a step without faults submits at least (each extent in whole requests, read and written).
  std::size_t min_requests(std::size_t req) const {
    std::size_t n = 0;
    for (const Param& p : params) {
      for (std::int64_t b = 0; b < p.numel; b += kQ) {
        for (const ArrayFormat& f : arrays) n += 2 * ((region_bytes(f, std::min(kQ, p.numel - b)) - 1) / req + 1);
      }
    }
    return n;
  }

  // The step on the plain arrays, as the pass just ran it (step already counted).
  void model_step() {
    const optim::AdamWScalars s = optim::adamw_scalars(hyper, step);
    for (Param& p : params) {
      auto common = [&](auto& a) {
        a.param = f32(p.model[0]);
        a.grad = p.grad.data();
        a.grad_type = a.out_type = type;
        a.param_out = p.model_out.data();
      };
      if (format == StateFormat::kFloat32) {
        optim::AdamWArrays a;
        common(a);
        a.exp_avg = f32(p.model[1]);
        a.exp_avg_sq = f32(p.model[2]);
        a.max_exp_avg_sq = amsgrad ? f32(p.model[3]) : nullptr;
        optim::adamw_cpu(a, s, 0, p.numel);
        continue;
      }
      optim::AdamW8bitArrays a;
      common(a);
      a.exp_avg = {p.model[1].data(), f32(p.model[2])};
      a.exp_avg_sq = {p.model[3].data(), f32(p.model[4])};
      if (amsgrad) a.max_exp_avg_sq = {p.model[5].data(), f32(p.model[6])};
      optim::adamw8bit_cpu(a, s, 0, p.numel);
    }
  }

  std::vector<Bytes> slot_bytes(int s) {
    std::vector<Bytes> out;
    for (std::size_t a = 0; a < arrays.size(); ++a) out.push_back(bytes[file(s, a)->fd]);
    return out;
  }
  std::vector<Bytes> outs() const {
    std::vector<Bytes> out;
    for (const Param& p : params) out.push_back(p.out);
    return out;
  }

  // Slot s holds the model: its bytes, zero padding, and the checksums recorded.
  void expect_files_hold_model(int s) {
    for (std::size_t i = 0; i < params.size(); ++i) {
      const Param& p = params[i];
      for (std::size_t a = 0; a < arrays.size(); ++a) {
        SCOPED_TRACE("parameter " + std::to_string(i) + " array " + std::to_string(a));
        const std::uint64_t used = array_bytes(arrays[a], p.numel), region = region_bytes(arrays[a], p.numel);
        ASSERT_GE(bytes[file(s, a)->fd].size(), p.offsets[a] + region);
        const unsigned char* at = bytes[file(s, a)->fd].data() + p.offsets[a];
        EXPECT_EQ(std::memcmp(at, p.model[a].data(), used), 0);
        EXPECT_TRUE(std::all_of(at + used, at + region, [](unsigned char b) { return b == 0; })) << "padding";
        for (std::int64_t c = 0; c < p.chunks(); ++c) {
          const std::uint64_t begin = array_bytes(arrays[a], c * kQ);
          const std::uint64_t n = array_bytes(arrays[a], std::min(kQ, p.numel - c * kQ));
          EXPECT_EQ(p.crc[c * arrays.size() + a], crc32c(at + begin, n)) << "chunk " << c;
        }
      }
    }
  }
  void expect_outs_hold_model() const {
    for (const Param& p : params) EXPECT_TRUE(p.out == p.model_out) << "parameter of " << p.numel;
  }
  // kRead copies every array out and converts the master into `type`.
  void expect_read_back() {
    dests.clear();
    read_out.clear();
    for (const Param& p : params) {
      dests.emplace_back();
      for (std::size_t a = 0; a < arrays.size(); ++a) dests.back().emplace_back(p.model[a].size(), 0xee);
      read_out.emplace_back(p.out.size(), 0xee);
    }
    run_random(PassKind::kRead);
    for (std::size_t i = 0; i < params.size(); ++i) {
      for (std::size_t a = 0; a < arrays.size(); ++a) EXPECT_TRUE(dests[i][a] == params[i].model[a]) << i << " " << a;
      const Bytes want = cast(params[i].model[0].data(), ElementType::kFloat32, type, params[i].numel);
      EXPECT_TRUE(read_out[i] == want) << "parameter " << i << ": the master converted";
    }
  }
};

class DiskStatePassSteps : public ::testing::TestWithParam<std::tuple<StateFormat, bool, ElementType>> {};

TEST_P(DiskStatePassSteps, ThreeStepsEqualTheInMemoryStepBitForBit) {
  const auto [format, amsgrad, type] = GetParam();
  // 3 chunks (a partial last one), 2 chunks (a last one of 1 element), 1 tiny chunk.
  Store st(format, amsgrad, type, {2 * kQ + 4099, kQ + 1, 300}, 17 + static_cast<int>(format) * 4 + amsgrad * 2);
  st.run_random(PassKind::kFill);
  st.expect_files_hold_model(0);
  std::size_t shorts = 0;
  for (int k = 0; k < 3; ++k) {
    SCOPED_TRACE("step " + std::to_string(k + 1));
    st.new_grads();
    const int read = st.slot();
    const std::vector<Bytes> before = st.slot_bytes(read);
    st.run_random(PassKind::kStep);
    shorts += st.shorts;
    st.model_step();
    EXPECT_TRUE(st.slot_bytes(read) == before) << "the slot read changed";
    st.expect_outs_hold_model();
    st.expect_files_hold_model(st.slot());
    st.expect_read_back();
  }
  EXPECT_GT(shorts, 0u) << "no short transfer was tried";
}

INSTANTIATE_TEST_SUITE_P(Formats, DiskStatePassSteps,
                         ::testing::Combine(::testing::Values(StateFormat::kFloat32, StateFormat::kUint8),
                                            ::testing::Bool(),
                                            ::testing::Values(ElementType::kBFloat16, ElementType::kFloat32)),
                         [](const auto& i) {  // (no structured binding: its commas would split the macro's arguments)
                           const char* out = std::get<2>(i.param) == ElementType::kFloat32 ? "_f32out" : "_bf16out";
                           return std::string(std::get<0>(i.param) == StateFormat::kUint8 ? "uint8" : "float32") +
                                  (std::get<1>(i.param) ? "_amsgrad" : "") + out;
                         });

TEST(DiskStatePass, EioDuringAStepLeavesEveryParameterAsItWas) {
  for (std::uint64_t seed = 0; seed < 24; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    Store st(seed % 2 ? StateFormat::kUint8 : StateFormat::kFloat32, seed / 2 % 2 == 1,
             seed / 4 % 2 ? ElementType::kFloat32 : ElementType::kBFloat16, {kQ + kQ / 2, kQ + 700, 300}, seed);
    st.run_random(PassKind::kFill);
    st.step_with_new_grads();
    st.new_grads();
    const std::vector<Bytes> outs = st.outs(), read = st.slot_bytes(st.slot());
    FakeIoConfig io = st.random_io();
    const std::size_t request_bytes = st.random_request_bytes();
    io.fail_request = static_cast<std::int64_t>(st.rng() % st.min_requests(request_bytes));
    EXPECT_THROW(st.run(PassKind::kStep, io, request_bytes, 1 + seed % 3), IoFailure);
    EXPECT_TRUE(st.outs() == outs) << "a parameter kept the failed step (request " << io.fail_request << ")";
    EXPECT_TRUE(st.slot_bytes(st.slot()) == read) << "the slot read changed";
    st.run_random(PassKind::kStep);  // the same step again, without the fault
    st.model_step();
    st.expect_outs_hold_model();
    st.expect_files_hold_model(st.slot());
  }
}

TEST(DiskStatePass, ATornChunkIsAChecksumMismatchNamingFileAndOffset) {
  Store st(StateFormat::kUint8, true, ElementType::kBFloat16, {kQ + 5, 2 * kQ + 9}, 5);
  st.run_random(PassKind::kFill);
  st.step_with_new_grads();
  st.new_grads();
  const std::vector<Bytes> outs = st.outs();
  const std::size_t a = 3;  // exp_avg_sq codes of parameter 1's chunk 1
  const FileRef& f = *st.file(st.slot(), a);
  const std::uint64_t at = st.params[1].offsets[a] + array_bytes(st.arrays[a], kQ);
  st.bytes[f.fd][at + 17] ^= 0x40;
  try {
    st.run_random(PassKind::kStep);
    ADD_FAILURE() << "no ChecksumMismatch";
  } catch (const ChecksumMismatch& e) {
    EXPECT_NE(std::string(e.what()).find(f.path), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("offset " + std::to_string(at) + " "), std::string::npos) << e.what();
  }
  EXPECT_TRUE(st.outs() == outs) << "the chunks stepped before the mismatch were not undone";
}

TEST(DiskStatePass, LoadWritesTheBytesGivenAndReadCopiesThemBack) {
  Store st(StateFormat::kUint8, true, ElementType::kFloat16, {kQ + 3000, 77}, 9);
  st.null_source = 3;  // exp_avg_sq's codes: no source, filled with fill[3]
  st.fill[3] = 0x5a;
  for (Param& p : st.params) {
    for (std::size_t a = 1; a < st.arrays.size(); ++a) {
      for (auto& b : p.model[a]) b = a == 3 ? 0x5a : static_cast<unsigned char>(st.rng());
    }
  }
  st.run_random(PassKind::kLoad);
  st.expect_files_hold_model(st.slot());
  st.expect_read_back();
}

TEST(DiskStatePass, BadPlansAreRejectedBeforeAnyIo) {
  Store st(StateFormat::kFloat32, true, ElementType::kBFloat16, {kQ + 10, 300}, 3);
  st.new_grads();
  st.run_random(PassKind::kFill);
  const std::map<int, Bytes> files = st.bytes;
  const std::vector<Bytes> outs = st.outs();
  auto expect_rejected = [&](PassKind kind, const char* what, Tweak tweak) {
    st.tweak = std::move(tweak);
    EXPECT_THROW(st.run(kind, st.random_io(), 65536, 2), std::invalid_argument) << what;
    EXPECT_EQ(st.requests, 0u) << what << ": I/O before the rejection";
    EXPECT_TRUE(st.bytes == files && st.outs() == outs) << what;
    st.tweak = nullptr;
  };
  using PP = std::vector<ParamPass>;  // the plans
  using W = std::vector<void*>;       // the window
  expect_rejected(PassKind::kStep, "chunk_numel 2^18 + 256", [](PassConfig& c, PP&, W&) { c.chunk_numel = kQ + 256; });
  expect_rejected(PassKind::kFill, "chunk_numel 0", [](PassConfig& c, PP&, W&) { c.chunk_numel = 0; });
  expect_rejected(PassKind::kStep, "a misaligned buffer",
                  [](PassConfig&, PP&, W& w) { w[1] = static_cast<char*>(w[1]) + 512; });
  expect_rejected(PassKind::kRead, "no buffer", [](PassConfig&, PP&, W& w) { w.clear(); });
  expect_rejected(PassKind::kStep, "no crc_in", [](PassConfig&, PP& p, W&) { p[1].crc_in = nullptr; });
  expect_rejected(PassKind::kFill, "no crc_out", [](PassConfig&, PP& p, W&) { p[1].crc_out = nullptr; });
  expect_rejected(PassKind::kStep, "no gradient", [](PassConfig&, PP& p, W&) { p[1].grad = nullptr; });
  expect_rejected(PassKind::kStep, "a read file short", [](PassConfig&, PP& p, W&) { p[1].read_files.pop_back(); });
  expect_rejected(PassKind::kStep, "a null read file", [](PassConfig&, PP& p, W&) { p[1].read_files[2] = nullptr; });
  expect_rejected(PassKind::kFill, "a null write file", [](PassConfig&, PP& p, W&) { p[1].write_files[0] = nullptr; });
  expect_rejected(PassKind::kLoad, "sources short", [](PassConfig&, PP& p, W&) { p[0].sources.pop_back(); });
  expect_rejected(PassKind::kFill, "numel 0", [](PassConfig&, PP& p, W&) { p[1].numel = 0; });
}

}  // namespace
}  // namespace hipferry::disk
