// The streamed AdamW step's schedule: optimizer state on the host, streamed
// through a ring of device buffers chunk by chunk (Note [GPU-streamed AdamW]).
// Torch-free: raw arrays and the scheduler's streams (csrc/core/schedule),
// so the whole schedule runs against fake streams in the C++ tests.
//
// Note [GPU-streamed AdamW]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// The state (the float32 master when the parameter is low precision,
// exp_avg, exp_avg_sq, and max_exp_avg_sq with amsgrad) lives in host memory:
// the moments in float32, or in 8 bits (codes and a scale per block of 256,
// quant8.h; chunks are then whole blocks, so a chunk's blocks are the
// parameter's blocks and the chunked step gives the whole step's bits).
// step() walks every parameter's elements in chunks of chunk_numel; chunk c
// takes ring slot k = c % slots (a SlotRing):
//   in       waits for slot k's release, copies the chunk's state into slot k;
//   compute  (where the gradient was produced and the next forward reads the
//            parameter) waits for the copy in, runs ONE fused kernel: reads
//            the gradient, updates the state in the slot and the float32
//            parameter (the parameter itself, or the master in the slot),
//            writes the low-precision parameter (the 8-bit kernel also
//            dequantizes and quantizes the moments in the slot);
//   out      waits for the kernel, copies the slot's state back to the host:
//            the slot's release.
// So copies in, the kernel and copies out of consecutive chunks overlap, and
// the device memory used is the ring, never the state.
// Invariants:
//  - a slot is loaded again only after its previous chunk was copied out;
//  - a step's first copy in waits for the previous step's last copy out, so
//    host state is never read before it was written back;
//  - with `ring_is_new`, the first copies in wait for the compute stream
//    (a caching allocator may hand out memory whose last users are still
//    queued there);
//  - the host must not touch the state before synchronize() (the owner keeps
//    the host arrays alive until then).
// In host mode all three streams are ImmediateStreams: the same schedule runs
// synchronously on the calling thread (the CPU tests check it everywhere).
// Not thread-safe: one optimizer drives one pipeline from one thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "csrc/core/element_type.h"
#include "csrc/core/optim/adamw8bit_cpu.h"
#include "csrc/core/optim/adamw_cpu.h"
#include "csrc/core/schedule/slot_ring.h"

namespace hipferry::optim {

// One parameter of a streamed step.
struct StreamedArrays {
  std::int64_t numel = 0;
  void* param = nullptr;  // device: float32 updated in place, or low precision written from master
  ElementType param_type = ElementType::kFloat32;
  const void* grad = nullptr;  // device, grad_type
  ElementType grad_type = ElementType::kFloat32;
  float* master = nullptr;          // host float32 master: present exactly when param is low precision
  float* exp_avg = nullptr;         // host (float32 moments)
  float* exp_avg_sq = nullptr;      // host
  float* max_exp_avg_sq = nullptr;  // host, amsgrad only
  bool quant8 = false;              // the moments are 8-bit instead: these, on the host
  Quant8Array exp_avg8, exp_avg_sq8, max_exp_avg_sq8;
};

// Queue the fused kernel (float32 or 8-bit moments) for `count` elements on a GPU stream.
using AdamWLauncher =
    std::function<void(const AdamWArrays&, const AdamWScalars&, std::int64_t count, schedule::NativeStream)>;
using AdamW8bitLauncher =
    std::function<void(const AdamW8bitArrays&, const AdamWScalars&, std::int64_t count, schedule::NativeStream)>;
struct AdamWLaunchers {
  AdamWLauncher float32;
  AdamW8bitLauncher quant8;
};

struct AdamWStreams {
  schedule::Stream& in;
  schedule::Stream& compute;
  schedule::Stream& out;
};

// Bytes of one ring slot for these parameters in chunks of chunk_numel: the largest
// chunk's state arrays, each from a 256-byte boundary.
std::size_t adamw_slot_bytes(const std::vector<StreamedArrays>& params, bool amsgrad, std::int64_t chunk_numel);

class AdamWPipeline {
 public:
  // Throws std::invalid_argument for chunk_numel < 1 or slots < 2.
  AdamWPipeline(std::int64_t chunk_numel, int slots, std::unique_ptr<schedule::SlotRing> ring = nullptr);

  // Queues the whole step; returns without waiting. `ring` holds slots() * slot_bytes
  // where the compute stream reads (device memory; host memory in host mode),
  // slot_bytes >= adamw_slot_bytes(params, ..., chunk_numel()). `launch` queues the
  // kernels on GPU streams; CPU streams run adamw_cpu / adamw8bit_cpu. Throws
  // std::invalid_argument, queuing nothing, for a ring too small, or 8-bit state
  // with a chunk_numel that is not a multiple of 256.
  void step(const std::vector<StreamedArrays>& params, const AdamWScalars& scalars, const AdamWStreams& streams,
            void* ring, std::size_t slot_bytes, bool ring_is_new, const AdamWLaunchers& launch);
  // Blocks until the last step's state is back on the host; throws its error.
  void synchronize();
  // True once the last step's state is back (never blocks).
  bool idle();

  std::int64_t chunk_numel() const { return chunk_numel_; }
  int slots() const { return slots_; }
  std::uint64_t chunks_streamed() const { return chunks_; }

 private:
  std::int64_t chunk_numel_;
  int slots_;
  std::unique_ptr<schedule::SlotRing> ring_;
  std::shared_ptr<schedule::Event> finished_;  // after the last step's last copy out (nullptr: none yet)
  std::uint64_t chunks_ = 0;                   // chunks streamed, all steps
};

}  // namespace hipferry::optim
