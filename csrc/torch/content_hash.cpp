// hipferry._C._content_hash: the fingerprint a speculative step's commit
// compares (Note [speculative step] in hipferry/optim/speculation.py): the
// worker fingerprints what the speculative step read (gradient, parameter or
// master, state), step() fingerprints what the ordinary step would read now,
// and the speculation is committed only where the two are equal.
//
// The hash: 64 bits over the bytes, position-dependent (moving, swapping or
// changing any byte changes it), the same whatever the number of threads or
// the CPU build. The bytes are cut into fixed 64 KiB blocks, hashed apart
// over torch's thread pool and folded in order. A block is hashed in eight
// 64-bit lanes, after XXH3's accumulation: each word is keyed by its position
// (the key steps by an odd constant each stripe, so no key table), and its
// lane adds the product of the keyed word's two 32-bit halves (one vector
// instruction per 2 or 4 lanes) and the word itself, so that no bit is lost
// where a half happens to be zero. The lanes are GCC/Clang vectors: the
// baseline build runs them as SSE2, the AVX2 build (cpu::active_isa, as the
// AdamW loop) as AVX2, with the same bits.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "csrc/core/cpu/cpu_isa.h"
#include "csrc/core/errors.h"
#include "csrc/torch/python_errors.h"
#include "csrc/torch/stable.h"
#include "csrc/torch/tensor_bridge.h"

namespace py = pybind11;

namespace hipferry {
namespace {

constexpr std::int64_t kBlockBytes = 1 << 16;
constexpr std::int64_t kStripeBytes = 64;
constexpr std::int64_t kBlocksPerTask = 16;  // 1 MiB: smaller inputs are hashed on the calling thread
constexpr std::uint64_t kPrime1 = 0x9E3779B185EBCA87ULL;
constexpr std::uint64_t kPrime2 = 0xC2B2AE3D27D4EB4FULL;
constexpr std::uint64_t kPrime3 = 0x165667B19E3779F9ULL;

// murmur3's 64-bit finalizer: every input bit flips every output bit with probability 1/2.
inline std::uint64_t mix64(std::uint64_t x) {
  x ^= x >> 33;
  x *= 0xFF51AFD7ED558CCDULL;
  x ^= x >> 33;
  x *= 0xC4CEB9FE1A85EC53ULL;
  x ^= x >> 33;
  return x;
}

using Lanes = std::uint64_t __attribute__((vector_size(32)));  // four 64-bit lanes; a block has two

// Inlined into each build's function below, so it compiles for that build's instruction set.
[[gnu::always_inline]] inline std::uint64_t block_body(const unsigned char* p, std::int64_t bytes, std::uint64_t seed) {
  Lanes acc[2], key[2];
  for (int j = 0; j < 8; ++j) {
    acc[j / 4][j % 4] = seed ^ (kPrime3 * static_cast<std::uint64_t>(j + 1));
    key[j / 4][j % 4] = mix64(seed + kPrime1 * static_cast<std::uint64_t>(j + 1));
  }
  constexpr std::uint64_t kLow = 0xFFFFFFFFULL, kStep = kPrime2 * 8;  // (odd: distinct keys for 2^61 stripes)
  const Lanes low = {kLow, kLow, kLow, kLow}, step = {kStep, kStep, kStep, kStep};
  unsigned char tail[kStripeBytes] = {};
  const std::int64_t whole = bytes / kStripeBytes * kStripeBytes;
  for (std::int64_t i = 0; i < whole + (whole < bytes ? kStripeBytes : 0); i += kStripeBytes) {
    const unsigned char* stripe = p + i;
    if (i == whole) {  // the last partial stripe, zero-padded (the length is folded in below)
      std::memcpy(tail, p + whole, static_cast<std::size_t>(bytes - whole));
      stripe = tail;
    }
    for (int h = 0; h < 2; ++h) {
      Lanes w;
      std::memcpy(&w, stripe + 32 * h, sizeof(w));
      const Lanes x = w ^ key[h];
      acc[h] += (x & low) * (x >> 32) + w;
      key[h] += step;
    }
  }
  std::uint64_t h = mix64(seed ^ (static_cast<std::uint64_t>(bytes) * kPrime1));
  for (int j = 0; j < 8; ++j) h = mix64(h ^ acc[j / 4][j % 4]) * kPrime2;
  return mix64(h);
}

std::uint64_t hash_block_baseline(const unsigned char* p, std::int64_t bytes, std::uint64_t seed) {
  return block_body(p, bytes, seed);
}

#ifdef HIPFERRY_HAVE_AVX2_BUILD
HIPFERRY_AVX2_TARGET std::uint64_t hash_block_avx2(const unsigned char* p, std::int64_t bytes, std::uint64_t seed) {
  return block_body(p, bytes, seed);
}
#endif

std::uint64_t hash_block(cpu::Isa isa, const unsigned char* p, std::int64_t bytes, std::uint64_t seed) {
#ifdef HIPFERRY_HAVE_AVX2_BUILD
  if (isa == cpu::Isa::kAvx2) return hash_block_avx2(p, bytes, seed);
#endif
  (void)isa;
  return hash_block_baseline(p, bytes, seed);
}

struct Span {
  const unsigned char* data;
  std::int64_t bytes;
};

std::uint64_t content_hash(const std::vector<Span>& spans) {
  std::vector<std::int64_t> first_block(spans.size() + 1, 0);  // block index where each span starts
  for (std::size_t t = 0; t < spans.size(); ++t) {
    const std::int64_t blocks = spans[t].bytes == 0 ? 0 : (spans[t].bytes + kBlockBytes - 1) / kBlockBytes;
    first_block[t + 1] = first_block[t] + blocks;
  }
  const std::int64_t total = first_block.back();
  std::vector<std::uint64_t> block_hash(static_cast<std::size_t>(total));
  std::vector<std::size_t> span_of(static_cast<std::size_t>(total));
  for (std::size_t t = 0; t < spans.size(); ++t) {
    for (std::int64_t b = first_block[t]; b < first_block[t + 1]; ++b) span_of[b] = t;
  }
  const cpu::Isa isa = cpu::active_isa();
  torch::stable::parallel_for(0, total, kBlocksPerTask, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t b = begin; b < end; ++b) {
      const std::size_t t = span_of[b];
      const std::int64_t offset = (b - first_block[t]) * kBlockBytes;
      const std::int64_t bytes = std::min(kBlockBytes, spans[t].bytes - offset);
      // Seeded by the block's place in the input: equal blocks at other places hash apart.
      const std::uint64_t seed = mix64(static_cast<std::uint64_t>(b) * kPrime3 + t);
      block_hash[b] = hash_block(isa, spans[t].data + offset, bytes, seed);
    }
  });
  std::uint64_t h = kPrime1;
  for (std::size_t t = 0; t < spans.size(); ++t) {
    std::uint64_t ht = mix64(static_cast<std::uint64_t>(spans[t].bytes) ^ kPrime2);
    for (std::int64_t b = first_block[t]; b < first_block[t + 1]; ++b) ht = mix64(ht ^ block_hash[b]) * kPrime1;
    h = mix64(h ^ ht) + kPrime3;
  }
  return h;
}

}  // namespace

void bind_content_hash(py::module_& m) {
  m.def(
      "_content_hash",
      [](py::object tensors) {
        return translate_errors([&]() -> std::uint64_t {
          const bool one = PyObject_IsInstance(tensors.ptr(), torch_tensor_type()) == 1;
          std::vector<Tensor> ts = one ? std::vector<Tensor>{tensor_from_python(tensors, "hipferry._content_hash: t")}
                                       : tensors_from_python(tensors, "hipferry._content_hash: tensors");
          std::vector<Span> spans;
          for (std::size_t i = 0; i < ts.size(); ++i) {
            const Tensor& t = ts[i];
            HF_CHECK_VALUE(t.is_cpu() && t.layout() == torch::headeronly::Layout::Strided && t.is_contiguous(),
                           "hipferry._content_hash: ", one ? "t" : "tensors[" + std::to_string(i) + "]",
                           " must be a contiguous dense CPU tensor");
            spans.push_back(
                {static_cast<const unsigned char*>(t.const_data_ptr()), static_cast<std::int64_t>(nbytes_of(t))});
          }
          py::gil_scoped_release no_gil;
          return content_hash(spans);
        });
      },
      py::arg("tensors"),
      "A 64-bit fingerprint of the bytes of a contiguous CPU tensor, or of a sequence of them in order "
      "(position-dependent; the same for any number of threads; torch's thread pool).");
}

}  // namespace hipferry
