// One pass of the disk state store over parameters' state files, chunk by
// chunk through a ChunkPipeline: the optimizer step (read, verify, step,
// checksum, write), and the passes around it (fill a new state, load a saved
// one, read back). Torch-free: the torch layer hands raw pointers and its
// thread pool (ParallelFor); the C++ tests hand fakes.
//
// Note [disk state layout]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// Each state array (master, exp_avg, ...; state_arrays()) has its own files,
// one per slot (two slots: a step reads a parameter's state from the slot the
// journal names and writes the other one, so a crash leaves the old state
// whole). A parameter owns a region of each file, page aligned, the same
// offsets in both slots. Chunk c of a parameter covers elements
// [c * chunk_numel, (c + 1) * chunk_numel); chunk_numel is a multiple of
// kChunkQuantum, so every chunk of every array starts on a page. The
// checksum of each chunk of each array (crc32c of its bytes) is kept by the
// caller (the journal) and checked on every read: a torn or stale chunk is
// an error naming the file and offset, never numbers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "csrc/core/disk/io_queue.h"
#include "csrc/core/element_type.h"
#include "csrc/core/optim/adamw_update.h"

namespace hipferry::disk {

// 2^18 elements: a whole number of pages for 1-byte codes and for the 8-bit
// format's float32 scales (one per 256 elements).
constexpr std::int64_t kChunkQuantum = std::int64_t{1} << 18;

// An array stores unit_bytes per group of `group` elements.
struct ArrayFormat {
  std::size_t unit_bytes;
  std::int64_t group;
};

enum class StateFormat : std::uint8_t { kFloat32, kUint8 };

// float32: master, exp_avg, exp_avg_sq [, max_exp_avg_sq];
// uint8: master, exp_avg codes, exp_avg scales, exp_avg_sq codes, exp_avg_sq
// scales [, max_exp_avg_sq codes, scales] (csrc/core/optim/quant8.h).
std::vector<ArrayFormat> state_arrays(StateFormat format, bool amsgrad);

// Bytes of `n` elements of an array, and of its page-rounded region.
std::uint64_t array_bytes(const ArrayFormat& f, std::int64_t n);
std::uint64_t region_bytes(const ArrayFormat& f, std::int64_t n);
// The window buffer one chunk needs (every array's chunk, page aligned).
std::size_t chunk_buffer_bytes(StateFormat format, bool amsgrad, std::int64_t chunk_numel);

// A chunk whose bytes do not match their checksum.
struct ChecksumMismatch : std::runtime_error {
  using std::runtime_error::runtime_error;
};

enum class PassKind : std::uint8_t { kStep, kFill, kLoad, kRead };

// One parameter's part in a pass; pointers are element 0 of flat arrays.
struct ParamPass {
  std::int64_t numel = 0;
  std::vector<std::uint64_t> offsets;       // per array: the region's byte offset in its files
  std::vector<const FileRef*> read_files;   // per array; empty when the pass does not read
  std::vector<const FileRef*> write_files;  // per array; empty when it does not write
  const std::uint32_t* crc_in = nullptr;    // [chunk * arrays + array]: what the reads must match
  std::uint32_t* crc_out = nullptr;         // [chunk * arrays + array]: the checksums written
  // kStep: the gradient, and the parameter (or a host copy) written in out_type.
  const void* grad = nullptr;
  ElementType grad_type = ElementType::kFloat32;
  void* out = nullptr;
  ElementType out_type = ElementType::kFloat32;
  bool adopt = false;  // out is the parameter: a write the user made becomes the master first
  optim::AdamWScalars scalars{};
  // kFill: the master from `source`, every other array filled with fill_bytes[array].
  const void* source = nullptr;
  ElementType source_type = ElementType::kFloat32;
  std::vector<std::uint8_t> fill_bytes;
  // kLoad: per array, the bytes to write (nullptr: fill_bytes[array]).
  std::vector<const void*> sources;
  // kRead: per array, where to copy the bytes read (nullptr: not copied); the
  // master is also converted into `out` (out_type) when out is set.
  std::vector<void*> dests;
};

// Runs fn over [0, n) split into pieces of at least `grain` (the torch
// layer's thread pool; the tests run it serially).
using ParallelFor =
    std::function<void(std::int64_t n, std::int64_t grain, const std::function<void(std::int64_t, std::int64_t)>&)>;

struct PassConfig {
  PassKind kind = PassKind::kStep;
  StateFormat format = StateFormat::kFloat32;
  bool amsgrad = false;
  std::int64_t chunk_numel = std::int64_t{1} << 20;  // a multiple of kChunkQuantum
  ParallelFor parallel;
};

// The window buffer a pass needs: chunk_buffer_bytes() of the longest chunk
// its parameters have (small parameters need less than chunk_numel).
std::size_t pass_buffer_bytes(const PassConfig& config, const std::vector<ParamPass>& params);

// Runs the pass over every chunk of every parameter, `window` buffers of
// pass_buffer_bytes() each (page aligned). Throws IoFailure,
// ChecksumMismatch, or std::invalid_argument for a bad plan, before any I/O.
// A kStep pass that fails part way restores `out` of every chunk it stepped
// from the master it read (the slot read is untouched), then rethrows: the
// parameters are as before the step. (A user's write to a parameter since the
// last step is in the new master only, so a failed step loses it for the
// chunks stepped; docs/disk-state.md.)
void run_state_pass(IoQueue& queue, const std::vector<void*>& window, const PassConfig& config,
                    std::vector<ParamPass>& params);

}  // namespace hipferry::disk
