// The GPU-streamed AdamW step: optimizer state on the host, streamed through a
// small ring of device buffers chunk by chunk.
//
// Note [GPU-streamed AdamW]
// The state (the float32 master when the parameter is low precision,
// exp_avg, exp_avg_sq, and max_exp_avg_sq with amsgrad) lives in pinned host
// memory. step() walks every parameter's elements in chunks of chunk_numel;
// chunk c uses ring slot k = c % slots:
//   in stream   waits free[k], copies the chunk's state host->device into
//               slot k, records loaded[k];
//   compute     (torch's current stream, where the gradient was produced and
//               where the next forward reads the parameter) waits loaded[k],
//               runs ONE fused kernel: reads the gradient, updates the state in
//               the slot and the float32 parameter (the device parameter
//               itself, or the master in the slot), writes the low-precision
//               parameter; records computed[k];
//   out stream  waits computed[k], copies the slot's state back to the host,
//               records free[k].
// So copies in, the kernel and copies out of consecutive chunks overlap, and
// the device memory used is the ring, never the state.
// Invariants:
//  - a slot is loaded again only after its previous chunk was copied out (free[k]);
//  - a step's first copy in waits for the previous step's last copy out
//    (`finished_`), so host state is never read before it was written back;
//  - a new ring's first copies in wait for torch's current stream: the caching
//    allocator may hand out memory whose last users are still queued there;
//  - the host tensors of the last step are referenced until synchronize(), so
//    the pool cannot reuse them while a copy still reads or writes them;
//  - the host must not read or write the state before synchronize() (the
//    Python optimizer calls it before state_dict, load_state_dict and any
//    engine switch); the destructor synchronizes too, so the ring is never
//    returned to torch's allocator while a copy still uses it.
// Not thread-safe: one optimizer drives one streamer from one thread.
// device == -1 runs the same chunk and slot schedule on the host, synchronously
// (no streams, a CPU ring, the CPU loop for the kernel): the tests check the
// schedule on machines without a GPU.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "optim/adamw_update.h"
#include "runtime.h"

namespace hipferry {

// One parameter's tensors for a streamed step. `param` and `grad` are on the
// device; the state is float32 on the host, contiguous, with param's numel.
struct StreamedParam {
  at::Tensor param;                   // float32 (updated in place) or float16/bfloat16 (written from the master)
  at::Tensor grad;                    // float32, float16 or bfloat16, on param's device
  std::optional<at::Tensor> master;   // float32 host master, present exactly when param is low precision
  at::Tensor exp_avg;
  at::Tensor exp_avg_sq;
  std::optional<at::Tensor> max_exp_avg_sq;  // amsgrad only
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
  std::int64_t ring_bytes() const { return ring_.defined() ? ring_.nbytes() : 0; }
  int device() const { return device_; }
  std::int64_t chunk_numel() const { return chunk_numel_; }
  int slots() const { return slots_; }

 private:
  void ensure_ring(int arrays_per_slot);

  int device_;
  std::int64_t chunk_numel_;     // elements per chunk (each array of a slot holds this many floats)
  int slots_;                    // ring slots (>= 2)
  int arrays_per_slot_ = 0;      // float arrays per slot the ring was sized for (2..4)
  // Streams and events: all null when device_ == -1 (host mode).
  std::unique_ptr<rt::Stream> in_;                    // host->device copies of state
  std::unique_ptr<rt::Stream> out_;                   // device->host copies of state
  std::vector<std::unique_ptr<rt::Event>> loaded_;    // per slot: its chunk is on the device
  std::vector<std::unique_ptr<rt::Event>> computed_;  // per slot: the kernel on it is done
  std::vector<std::unique_ptr<rt::Event>> free_;      // per slot: its state is back on the host
  std::vector<bool> free_recorded_;                   // per slot: free_ was recorded at least once
  std::unique_ptr<rt::Event> finished_;  // recorded on out_ after a step's last copy out
  bool finished_recorded_ = false;
  at::Tensor ring_;              // slots_ * arrays_per_slot_ * chunk_numel_ floats on device_
  std::vector<at::Tensor> in_flight_;  // host state of the last step, kept until synchronize()
};

}  // namespace hipferry
