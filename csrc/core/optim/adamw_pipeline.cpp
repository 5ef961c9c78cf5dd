// The streamed AdamW schedule (see Note [GPU-streamed AdamW] in adamw_pipeline.h).
#include "csrc/core/optim/adamw_pipeline.h"

#include <algorithm>
#include <exception>
#include <stdexcept>
#include <string>
#include <utility>

namespace hipferry::optim {
namespace {

using schedule::Label;
using schedule::Range;

std::size_t element_bytes(ElementType t) { return t == ElementType::kFloat32 ? 4 : 2; }

}  // namespace

int adamw_arrays_per_slot(const std::vector<StreamedArrays>& params, bool amsgrad) {
  bool master = false;
  for (const auto& p : params) master = master || p.master != nullptr;
  return 2 + (amsgrad ? 1 : 0) + (master ? 1 : 0);
}

AdamWPipeline::AdamWPipeline(std::int64_t chunk_numel, int slots, std::unique_ptr<schedule::SlotRing> ring)
    : chunk_numel_(chunk_numel), slots_(slots), ring_(std::move(ring)) {
  if (chunk_numel < 1) throw std::invalid_argument("AdamWPipeline: chunk_numel must be >= 1");
  if (slots < 2) throw std::invalid_argument("AdamWPipeline: slots must be >= 2");
  if (!ring_) ring_ = std::make_unique<schedule::SlotRing>(static_cast<std::size_t>(slots));
  if (ring_->size() != static_cast<std::size_t>(slots)) throw std::invalid_argument("AdamWPipeline: ring size");
}

void AdamWPipeline::step(const std::vector<StreamedArrays>& params, const AdamWScalars& s, const AdamWStreams& st,
                         float* ring, int arrays_per_slot, bool ring_is_new, const AdamWLauncher& launch) {
  if (params.empty()) return;
  if (arrays_per_slot < adamw_arrays_per_slot(params, s.amsgrad)) {
    throw std::invalid_argument("AdamWPipeline::step: the ring has " + std::to_string(arrays_per_slot) +
                                " arrays per slot, these parameters need " +
                                std::to_string(adamw_arrays_per_slot(params, s.amsgrad)));
  }
  if (ring_is_new) st.in.wait(st.compute.record());
  if (finished_) st.in.wait(finished_);  // host state written back before it is read again
  const std::size_t slot_floats = static_cast<std::size_t>(arrays_per_slot) * static_cast<std::size_t>(chunk_numel_);
  for (const StreamedArrays& p : params) {
    // Host arrays in slot order: master (if any), exp_avg, exp_avg_sq, max (if any).
    std::vector<float*> state;
    if (p.master) state.push_back(p.master);
    state.push_back(p.exp_avg);
    state.push_back(p.exp_avg_sq);
    if (s.amsgrad) state.push_back(p.max_exp_avg_sq);
    const std::size_t pbytes = element_bytes(p.param_type), gbytes = element_bytes(p.grad_type);
    for (std::int64_t off = 0; off < p.numel; off += chunk_numel_) {
      const std::int64_t count = std::min(chunk_numel_, p.numel - off);
      const std::size_t k = ring_->next_slot();
      float* slot = ring + k * slot_floats;
      std::vector<float*> dev;
      for (std::size_t a = 0; a < state.size(); ++a) dev.push_back(slot + a * static_cast<std::size_t>(chunk_numel_));
      const std::size_t bytes = static_cast<std::size_t>(count) * sizeof(float);

      ring_->acquire(k, st.in);
      for (std::size_t a = 0; a < state.size(); ++a) {
        st.in.copy(dev[a], state[a] + off, bytes, Label{"adamw state in", "copy", bytes});
      }
      ring_->pass(k, st.in, st.compute);

      AdamWArrays arr;
      std::size_t a = 0;
      char* param_at = static_cast<char*>(p.param) + static_cast<std::size_t>(off) * pbytes;
      if (p.master) {
        arr.param = dev[a++];
        arr.param_out = param_at;
        arr.out_type = p.param_type;
        arr.adopt_out = true;  // the parameter itself: a write the master did not see is taken
      } else {
        arr.param = reinterpret_cast<float*>(param_at);
      }
      arr.exp_avg = dev[a++];
      arr.exp_avg_sq = dev[a++];
      if (s.amsgrad) arr.max_exp_avg_sq = dev[a++];
      arr.grad = static_cast<const char*>(p.grad) + static_cast<std::size_t>(off) * gbytes;
      arr.grad_type = p.grad_type;
      schedule::Work kernel;
      kernel.label = Label{"adamw chunk", "kernel", bytes * state.size()};
      kernel.on_host = [arr, s, count] { adamw_cpu(arr, s, 0, count); };
      if (launch) kernel.on_device = [arr, s, count, launch](schedule::NativeStream n) { launch(arr, s, count, n); };
      for (float* d : dev) {
        kernel.reads.push_back(Range{d, bytes});
        kernel.writes.push_back(Range{d, bytes});
      }
      kernel.reads.push_back(Range{arr.grad, static_cast<std::size_t>(count) * gbytes});
      kernel.writes.push_back(Range{param_at, static_cast<std::size_t>(count) * pbytes});
      if (!p.master) kernel.reads.push_back(Range{param_at, static_cast<std::size_t>(count) * pbytes});
      st.compute.enqueue(std::move(kernel));
      ring_->pass(k, st.compute, st.out);

      for (std::size_t b = 0; b < state.size(); ++b) {
        st.out.copy(state[b] + off, dev[b], bytes, Label{"adamw state out", "copy", bytes});
      }
      ring_->release(k, st.out);
      ++chunks_;
    }
  }
  finished_ = st.out.record();
}

void AdamWPipeline::synchronize() {
  // Every slot's release and the step's end are waited for before an error is thrown.
  std::exception_ptr error;
  try {
    ring_->synchronize();
  } catch (...) {
    error = std::current_exception();
  }
  try {
    if (finished_) finished_->synchronize();
  } catch (...) {
    if (!error) error = std::current_exception();
  }
  if (error) std::rethrow_exception(error);
}

bool AdamWPipeline::idle() { return ring_->idle() && (!finished_ || finished_->query()); }

}  // namespace hipferry::optim
