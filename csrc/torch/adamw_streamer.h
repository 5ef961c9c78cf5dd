// The GPU-streamed AdamW step: optimizer state on the host, streamed through a
// small ring of device buffers chunk by chunk.
//
// The schedule itself is torch-free: csrc/core/optim/adamw_pipeline.h (Note
// [GPU-streamed AdamW]) on the copy scheduler's streams. This class is its
// torch layer (stable ABI): it checks the tensors, owns the device ring and the two copy
// streams, and keeps the host tensors of the last step alive until
// synchronize() (the Python optimizer calls it before state_dict,
// load_state_dict and any engine switch; the destructor synchronizes too, so
// the ring is never returned to torch's allocator while a copy still uses it).
// device == -1 runs the same schedule on the host, synchronously (CPU
// streams, a CPU ring, the CPU loop for the kernel): the tests check the
// schedule on machines without a GPU.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "csrc/core/optim/adamw_pipeline.h"
#include "csrc/core/optim/adamw_update.h"
#include "csrc/core/schedule/stream.h"
#include "csrc/torch/stable.h"

namespace hipferry {

// One parameter's tensors for a streamed step. `param` and `grad` are on the
// device; the state is on the host, contiguous, with param's numel: float32 moments,
// or 8-bit ones (uint8 codes, and float32 scales, one per block of 256: quant8.h).
struct StreamedParam {
  Tensor param;                  // float32 (updated in place) or float16/bfloat16 (written from the master)
  Tensor grad;                   // float32, float16 or bfloat16, on param's device
  std::optional<Tensor> master;  // float32 host master, present exactly when param is low precision
  Tensor exp_avg;
  Tensor exp_avg_sq;
  std::optional<Tensor> max_exp_avg_sq;  // amsgrad only
  // 8-bit moments: the scales of exp_avg, exp_avg_sq (and max_exp_avg_sq), whose codes
  // are then uint8; all present or all absent (float32 moments).
  std::optional<Tensor> exp_avg_absmax, exp_avg_sq_absmax, max_exp_avg_sq_absmax;
};

class AdamWStreamer {
 public:
  AdamWStreamer(int device, std::int64_t chunk_numel, int slots);
  ~AdamWStreamer();
  AdamWStreamer(const AdamWStreamer&) = delete;
  AdamWStreamer& operator=(const AdamWStreamer&) = delete;

  // Enqueues the whole step; returns without waiting for the device.
  // Validates every parameter before it enqueues anything.
  void step(const std::vector<StreamedParam>& params, const optim::AdamWScalars& scalars);
  // Blocks until the last step's state is back on the host.
  void synchronize();
  std::int64_t ring_bytes() const { return ring_.defined() ? static_cast<std::int64_t>(nbytes_of(ring_)) : 0; }
  int device() const { return device_; }
  std::int64_t chunk_numel() const { return chunk_numel_; }
  int slots() const { return slots_; }

 private:
  // True when a new ring was allocated (its first copies must wait for the compute stream).
  bool ensure_ring(std::size_t slot_bytes);

  int device_;
  std::int64_t chunk_numel_;               // elements per chunk (each array of a slot holds this many floats)
  int slots_;                              // ring slots (>= 2)
  std::size_t slot_bytes_ = 0;             // bytes per slot the ring was sized for
  std::unique_ptr<schedule::Stream> in_;   // host->device copies of state (GPU stream, or the host)
  std::unique_ptr<schedule::Stream> out_;  // device->host copies of state
  optim::AdamWPipeline pipeline_;
  Tensor ring_;                    // slots_ * slot_bytes_ bytes on device_ (undefined at first)
  std::vector<Tensor> in_flight_;  // host state of the last step, kept until synchronize()
};

}  // namespace hipferry
