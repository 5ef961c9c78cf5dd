#include "csrc/core/disk/state_pass.h"

#include <algorithm>
#include <cstring>
#include <sstream>

#include "csrc/core/copy_cast_cpu.h"
#include "csrc/core/disk/chunk_pipeline.h"
#include "csrc/core/disk/crc32c.h"
#include "csrc/core/optim/adamw8bit_cpu.h"
#include "csrc/core/optim/adamw_cpu.h"

namespace hipferry::disk {
namespace {

constexpr std::uint64_t kPage = 4096;
constexpr std::int64_t kBlock = 256;  // optim::q8::kBlock: elements per 8-bit scale

std::uint64_t round_page(std::uint64_t n) { return (n + kPage - 1) / kPage * kPage; }

// A chunk of the pass: parameter, chunk index, first element and length.
struct ChunkRef {
  std::size_t param;
  std::int64_t chunk;
  std::int64_t begin;
  std::int64_t numel;
};

// Where each array's chunk sits in a window buffer.
std::vector<std::size_t> buffer_offsets(const std::vector<ArrayFormat>& arrays, std::int64_t chunk_numel) {
  std::vector<std::size_t> out;
  std::size_t at = 0;
  for (const ArrayFormat& f : arrays) {
    out.push_back(at);
    at += round_page(array_bytes(f, chunk_numel));
  }
  out.push_back(at);  // the total
  return out;
}

bool all_open(const std::vector<const FileRef*>& files) {
  return std::all_of(files.begin(), files.end(), [](const FileRef* f) { return f != nullptr; });
}

void check_plan(const PassConfig& c, const std::vector<ParamPass>& params, std::size_t arrays) {
  if (c.chunk_numel <= 0 || c.chunk_numel % kChunkQuantum != 0) {
    throw std::invalid_argument("run_state_pass: chunk_numel must be a positive multiple of 2^18");
  }
  const bool reads = c.kind == PassKind::kStep || c.kind == PassKind::kRead;
  const bool writes = c.kind != PassKind::kRead;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const ParamPass& p = params[i];
    const bool ok = p.numel > 0 && p.offsets.size() == arrays && (!reads || p.read_files.size() == arrays) &&
                    (!writes || p.write_files.size() == arrays) && (!reads || p.crc_in) && (!writes || p.crc_out) &&
                    (c.kind != PassKind::kStep || p.grad) && (c.kind != PassKind::kFill || p.source) &&
                    (c.kind == PassKind::kStep || c.kind == PassKind::kRead || p.fill_bytes.size() == arrays) &&
                    (c.kind != PassKind::kLoad || p.sources.size() == arrays) &&
                    // A null file would only be found when its chunk is planned, after
                    // other chunks' I/O (and a step's changes to `out`) began.
                    all_open(p.read_files) && all_open(p.write_files);
    if (!ok) {
      std::ostringstream m;
      m << "run_state_pass: parameter " << i << " has an incomplete plan for this pass";
      throw std::invalid_argument(m.str());
    }
  }
}

// The longest chunk of the pass: chunk_numel, or less when every parameter is smaller
// (rounded up to kChunkQuantum, so every array's part of a buffer stays page aligned).
std::int64_t longest_chunk(const PassConfig& c, const std::vector<ParamPass>& params) {
  std::int64_t longest = 0;
  for (const ParamPass& p : params) longest = std::max(longest, std::min(p.numel, c.chunk_numel));
  return std::max<std::int64_t>(kChunkQuantum, (longest + kChunkQuantum - 1) / kChunkQuantum * kChunkQuantum);
}

class Pass {
 public:
  Pass(const PassConfig& c, std::vector<ParamPass>& params)
      : c_(c),
        params_(params),
        arrays_(state_arrays(c.format, c.amsgrad)),
        offsets_(buffer_offsets(arrays_, longest_chunk(c, params))) {
    for (std::size_t i = 0; i < params.size(); ++i) {
      for (std::int64_t b = 0, k = 0; b < params[i].numel; b += c.chunk_numel, ++k) {
        chunks_.push_back({i, k, b, std::min(c.chunk_numel, params[i].numel - b)});
      }
    }
  }
  std::size_t count() const { return chunks_.size(); }
  std::size_t buffer_bytes() const { return offsets_.back(); }

  ChunkIo plan(std::size_t i, bool reads, bool writes, std::size_t only_array = SIZE_MAX) const {
    const ChunkRef& r = chunks_[i];
    const ParamPass& p = params_[r.param];
    ChunkIo io;
    for (std::size_t a = 0; a < arrays_.size(); ++a) {
      if (only_array != SIZE_MAX && a != only_array) continue;
      const ArrayFormat& f = arrays_[a];
      const std::uint64_t at = p.offsets[a] + array_bytes(f, r.begin);
      const std::size_t bytes = round_page(array_bytes(f, r.numel));
      if (reads) io.reads.push_back({p.read_files[a], at, offsets_[a], bytes});
      if (writes) io.writes.push_back({p.write_files[a], at, offsets_[a], bytes});
    }
    return io;
  }

  void compute(std::size_t i, void* buffer) {
    const ChunkRef& r = chunks_[i];
    ParamPass& p = params_[r.param];
    auto* buf = static_cast<std::uint8_t*>(buffer);
    if (c_.kind == PassKind::kStep || c_.kind == PassKind::kRead) verify(r, p, buf, SIZE_MAX);
    switch (c_.kind) {
      case PassKind::kStep: step(r, p, buf); break;
      case PassKind::kFill: fill(r, p, buf); break;
      case PassKind::kLoad: load(r, p, buf); break;
      case PassKind::kRead: read_out(r, p, buf); return;
    }
    for (std::size_t a = 0; a < arrays_.size(); ++a) {
      const std::uint64_t used = array_bytes(arrays_[a], r.numel);
      std::memset(buf + offsets_[a] + used, 0, round_page(used) - used);  // files hold no stale padding
    }
    const std::vector<std::uint32_t> crcs = checksums(r, buf, SIZE_MAX);
    std::copy(crcs.begin(), crcs.end(), p.crc_out + r.chunk * arrays_.size());
  }

  // The master of chunk i back into the parameter (a failed step's undo).
  void restore(std::size_t i, void* buffer) {
    const ChunkRef& r = chunks_[i];
    ParamPass& p = params_[r.param];
    auto* buf = static_cast<std::uint8_t*>(buffer);
    verify(r, p, buf, 0);
    if (p.out) convert(buf, ElementType::kFloat32, p.out, p.out_type, r.begin, r.numel);
  }

  const ChunkRef& chunk(std::size_t i) const { return chunks_[i]; }

 private:
  // The checksum of each array's part of chunk r in `buf`, the arrays on the thread pool (one
  // crc32c stream runs at about 8 bytes per 3 cycles; a step checks every byte twice).
  std::vector<std::uint32_t> checksums(const ChunkRef& r, const std::uint8_t* buf, std::size_t only) const {
    std::vector<std::uint32_t> out(arrays_.size(), 0);
    c_.parallel(static_cast<std::int64_t>(arrays_.size()), 1, [&](std::int64_t b, std::int64_t e) {
      for (std::int64_t a = b; a < e; ++a) {
        if (only == SIZE_MAX || static_cast<std::size_t>(a) == only) {
          out[a] = crc32c(buf + offsets_[a], array_bytes(arrays_[a], r.numel));
        }
      }
    });
    return out;
  }

  void verify(const ChunkRef& r, const ParamPass& p, const std::uint8_t* buf, std::size_t only) const {
    const std::vector<std::uint32_t> got = checksums(r, buf, only);
    for (std::size_t a = 0; a < arrays_.size(); ++a) {
      if (only != SIZE_MAX && a != only) continue;
      const std::uint64_t used = array_bytes(arrays_[a], r.numel);
      const std::uint32_t want = p.crc_in[r.chunk * arrays_.size() + a];
      if (got[a] != want) {
        std::ostringstream m;
        m << "checksum mismatch in " << p.read_files[a]->path << " at offset "
          << p.offsets[a] + array_bytes(arrays_[a], r.begin) << " (" << used << " bytes: chunk " << r.chunk
          << " of a parameter of " << p.numel << " elements): the file is torn or was changed outside hipferry";
        throw ChecksumMismatch(m.str());
      }
    }
  }

  // dst[begin + k] = src[k] (src element 0 of the chunk), converted.
  void convert(const std::uint8_t* src, ElementType st, void* dst, ElementType dt, std::int64_t begin,
               std::int64_t n) const {
    auto* d = static_cast<std::uint8_t*>(dst) + begin * element_size(dt);
    c_.parallel(n, 1 << 16, [&](std::int64_t b, std::int64_t e) { copy_cast_cpu(src, st, d, dt, b, e); });
  }

  void step(const ChunkRef& r, const ParamPass& p, std::uint8_t* buf) const {
    const auto* grad = static_cast<const std::uint8_t*>(p.grad) + r.begin * element_size(p.grad_type);
    void* out = p.out ? static_cast<std::uint8_t*>(p.out) + r.begin * element_size(p.out_type) : nullptr;
    auto f32 = [&](std::size_t a) { return reinterpret_cast<float*>(buf + offsets_[a]); };
    if (c_.format == StateFormat::kFloat32) {
      optim::AdamWArrays a;
      a.param = f32(0);
      a.grad = grad;
      a.grad_type = p.grad_type;
      a.exp_avg = f32(1);
      a.exp_avg_sq = f32(2);
      a.max_exp_avg_sq = c_.amsgrad ? f32(3) : nullptr;
      a.param_out = out;
      a.out_type = p.out_type;
      a.adopt_out = p.adopt && out;
      c_.parallel(r.numel, 1 << 15, [&](std::int64_t b, std::int64_t e) { optim::adamw_cpu(a, p.scalars, b, e); });
      return;
    }
    optim::AdamW8bitArrays a;
    a.param = f32(0);
    a.grad = grad;
    a.grad_type = p.grad_type;
    a.exp_avg = {buf + offsets_[1], f32(2)};
    a.exp_avg_sq = {buf + offsets_[3], f32(4)};
    if (c_.amsgrad) a.max_exp_avg_sq = {buf + offsets_[5], f32(6)};
    a.param_out = out;
    a.out_type = p.out_type;
    a.adopt_out = p.adopt && out;
    const std::int64_t blocks = optim::q8::block_count(r.numel);
    c_.parallel(blocks, 128, [&](std::int64_t b0, std::int64_t b1) {
      optim::adamw8bit_cpu(a, p.scalars, b0 * kBlock, std::min(b1 * kBlock, r.numel));
    });
  }

  void fill(const ChunkRef& r, const ParamPass& p, std::uint8_t* buf) const {
    const auto* src = static_cast<const std::uint8_t*>(p.source) + r.begin * element_size(p.source_type);
    c_.parallel(r.numel, 1 << 16, [&](std::int64_t b, std::int64_t e) {
      copy_cast_cpu(src, p.source_type, buf + offsets_[0], ElementType::kFloat32, b, e);
    });
    for (std::size_t a = 1; a < arrays_.size(); ++a) {
      std::memset(buf + offsets_[a], p.fill_bytes[a], array_bytes(arrays_[a], r.numel));
    }
  }

  void load(const ChunkRef& r, const ParamPass& p, std::uint8_t* buf) const {
    for (std::size_t a = 0; a < arrays_.size(); ++a) {
      const std::uint64_t used = array_bytes(arrays_[a], r.numel);
      if (p.sources[a] == nullptr) {
        std::memset(buf + offsets_[a], p.fill_bytes[a], used);
      } else {
        std::memcpy(buf + offsets_[a],
                    static_cast<const std::uint8_t*>(p.sources[a]) + array_bytes(arrays_[a], r.begin), used);
      }
    }
  }

  void read_out(const ChunkRef& r, const ParamPass& p, const std::uint8_t* buf) const {
    for (std::size_t a = 0; a < arrays_.size() && a < p.dests.size(); ++a) {
      if (p.dests[a] == nullptr) continue;
      std::memcpy(static_cast<std::uint8_t*>(p.dests[a]) + array_bytes(arrays_[a], r.begin), buf + offsets_[a],
                  array_bytes(arrays_[a], r.numel));
    }
    if (p.out) convert(buf, ElementType::kFloat32, p.out, p.out_type, r.begin, r.numel);
  }

  const PassConfig& c_;
  std::vector<ParamPass>& params_;
  std::vector<ArrayFormat> arrays_;
  std::vector<std::size_t> offsets_;
  std::vector<ChunkRef> chunks_;
};

// After a step failed: the parameters of chunks [0, computed) get their old master back.
void undo_step(IoQueue& queue, const std::vector<void*>& window, Pass& pass, std::size_t computed) {
  ChunkPipeline pipeline(queue, window);
  pipeline.run(
      computed, [&](std::size_t i) { return pass.plan(i, true, false, 0); },
      [&](std::size_t i, void* buffer) { pass.restore(i, buffer); });
}

}  // namespace

std::vector<ArrayFormat> state_arrays(StateFormat format, bool amsgrad) {
  const ArrayFormat f32{4, 1}, codes{1, 1}, scales{4, kBlock};
  if (format == StateFormat::kFloat32) {
    std::vector<ArrayFormat> out{f32, f32, f32};
    if (amsgrad) out.push_back(f32);
    return out;
  }
  std::vector<ArrayFormat> out{f32, codes, scales, codes, scales};
  if (amsgrad) out.insert(out.end(), {codes, scales});
  return out;
}

std::uint64_t array_bytes(const ArrayFormat& f, std::int64_t n) {
  return static_cast<std::uint64_t>((n + f.group - 1) / f.group) * f.unit_bytes;
}

std::uint64_t region_bytes(const ArrayFormat& f, std::int64_t n) { return round_page(array_bytes(f, n)); }

std::size_t chunk_buffer_bytes(StateFormat format, bool amsgrad, std::int64_t chunk_numel) {
  return buffer_offsets(state_arrays(format, amsgrad), chunk_numel).back();
}

std::size_t pass_buffer_bytes(const PassConfig& config, const std::vector<ParamPass>& params) {
  return chunk_buffer_bytes(config.format, config.amsgrad, longest_chunk(config, params));
}

void run_state_pass(IoQueue& queue, const std::vector<void*>& window, const PassConfig& config,
                    std::vector<ParamPass>& params) {
  const std::size_t arrays = state_arrays(config.format, config.amsgrad).size();
  check_plan(config, params, arrays);
  if (window.empty()) throw std::invalid_argument("run_state_pass: the window has no buffer");
  for (void* b : window) {
    if (reinterpret_cast<std::uintptr_t>(b) % kPage != 0) {
      throw std::invalid_argument("run_state_pass: window buffers must be page aligned (4096 bytes)");
    }
  }
  Pass pass(config, params);
  const bool reads = config.kind == PassKind::kStep || config.kind == PassKind::kRead;
  const bool writes = config.kind != PassKind::kRead;
  ChunkPipeline pipeline(queue, window);
  try {
    pipeline.run(
        pass.count(), [&](std::size_t i) { return pass.plan(i, reads, writes); },
        [&](std::size_t i, void* buffer) { pass.compute(i, buffer); });
  } catch (const std::exception& failure) {
    if (config.kind != PassKind::kStep || pipeline.computed() == 0) throw;
    // The step may have failed in the middle of chunk computed()-1's compute: undo it too.
    try {
      IoQueue again(queue.backend(), std::size_t{1} << 20);
      undo_step(again, window, pass, pipeline.computed());
    } catch (const std::exception& undo) {
      throw std::runtime_error(std::string(failure.what()) +
                               "; restoring the parameters from the state read also failed: " + undo.what());
    }
    throw;
  }
}

}  // namespace hipferry::disk
