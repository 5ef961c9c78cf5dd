// hipferry._C._content_hash: the fingerprint a speculative step's commit
// compares (Note [speculative step] in hipferry/optim/speculation.py): the
// worker fingerprints what the speculative step read (gradient, parameter or
// master, state), step() fingerprints what the ordinary step would read now,
// and the speculation is committed only where the two are equal.
//
// The hash: 64 bits over the bytes, position-dependent (moving, swapping or
// changing any byte changes it), the same whatever the number of threads.
// The bytes are cut into fixed 64 KiB blocks, hashed apart over torch's
// thread pool and folded in order. A block is hashed in eight 64-bit lanes,
// XXH3's accumulation: each word is keyed by its position (the key steps by
// an odd constant, so no key table), the product of the keyed word's two
// 32-bit halves goes into its lane (one vector instruction per 4 lanes in the
// SSE2 and AVX2 builds) and the word itself into the neighbouring lane, so
// that no bit is lost where a half happens to be zero.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

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

struct Lanes {
  std::uint64_t acc[8];
  std::uint64_t key[8];

  explicit Lanes(std::uint64_t seed) {
    for (int j = 0; j < 8; ++j) {
      acc[j] = seed ^ (kPrime3 * static_cast<std::uint64_t>(j + 1));
      key[j] = mix64(seed + kPrime1 * static_cast<std::uint64_t>(j + 1));
    }
  }

  void stripe(const unsigned char* p) {
    std::uint64_t w[8];
    std::memcpy(w, p, sizeof(w));
    for (int j = 0; j < 8; ++j) {
      const std::uint64_t x = w[j] ^ key[j];
      acc[j] += static_cast<std::uint64_t>(static_cast<std::uint32_t>(x)) * (x >> 32);
      acc[j ^ 1] += w[j];
      key[j] += kPrime2 * 8;  // the key of the word one stripe on (odd step: distinct for 2^61 stripes)
    }
  }

  std::uint64_t fold(std::uint64_t seed, std::int64_t bytes) const {
    std::uint64_t h = mix64(seed ^ (static_cast<std::uint64_t>(bytes) * kPrime1));
    for (int j = 0; j < 8; ++j) h = mix64(h ^ acc[j]) * kPrime2;
    return mix64(h);
  }
};

std::uint64_t hash_block(const unsigned char* p, std::int64_t bytes, std::uint64_t seed) {
  Lanes lanes(seed);
  const std::int64_t whole = bytes / kStripeBytes * kStripeBytes;
  for (std::int64_t i = 0; i < whole; i += kStripeBytes) lanes.stripe(p + i);
  if (whole < bytes) {  // the last partial stripe, zero-padded (the length is folded in below)
    unsigned char tail[kStripeBytes] = {};
    std::memcpy(tail, p + whole, static_cast<std::size_t>(bytes - whole));
    lanes.stripe(tail);
  }
  return lanes.fold(seed, bytes);
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
  torch::stable::parallel_for(0, total, kBlocksPerTask, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t b = begin; b < end; ++b) {
      const std::size_t t = span_of[b];
      const std::int64_t offset = (b - first_block[t]) * kBlockBytes;
      const std::int64_t bytes = std::min(kBlockBytes, spans[t].bytes - offset);
      // Seeded by the block's place in the input: equal blocks at other places hash apart.
      block_hash[b] = hash_block(spans[t].data + offset, bytes, mix64(static_cast<std::uint64_t>(b) * kPrime3 + t));
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
  m.def("_content_hash",
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
              spans.push_back({static_cast<const unsigned char*>(t.const_data_ptr()),
                               static_cast<std::int64_t>(nbytes_of(t))});
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
