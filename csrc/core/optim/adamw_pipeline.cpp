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

constexpr std::size_t kRegionAlign = 256;  // each state array of a slot starts on such a boundary

std::size_t element_bytes(ElementType t) { return t == ElementType::kFloat32 ? 4 : 2; }
std::size_t aligned_up(std::size_t n) { return (n + kRegionAlign - 1) / kRegionAlign * kRegionAlign; }

// One state array of a chunk on the host: where, and its bytes.
struct Region {
  char* host;
  std::size_t bytes;
};

// The state of elements [off, off + count) of p, in slot order: the master (if any),
// then each moment: its float32 values, or its 8-bit codes and their scales.
std::vector<Region> regions(const StreamedArrays& p, bool amsgrad, std::int64_t off, std::int64_t count) {
  std::vector<Region> r;
  const auto n = static_cast<std::size_t>(count);
  const auto values = [&](float* a) { r.push_back({reinterpret_cast<char*>(a + off), n * sizeof(float)}); };
  if (p.master) values(p.master);
  if (!p.quant8) {
    values(p.exp_avg);
    values(p.exp_avg_sq);
    if (amsgrad) values(p.max_exp_avg_sq);
    return r;
  }
  const auto codes = [&](const Quant8Array& a) {
    r.push_back({reinterpret_cast<char*>(a.codes + off), n});
    r.push_back({reinterpret_cast<char*>(a.absmax + off / q8::kBlock),
                 static_cast<std::size_t>(q8::block_count(count)) * sizeof(float)});
  };
  codes(p.exp_avg8);
  codes(p.exp_avg_sq8);
  if (amsgrad) codes(p.max_exp_avg_sq8);
  return r;
}

std::size_t slot_bytes_of(const std::vector<Region>& regs) {
  std::size_t total = 0;
  for (const Region& r : regs) total += aligned_up(r.bytes);
  return total;
}

// What either kernel's arrays take beside the state: the low-precision parameter written
// from the master (the parameter itself: a write the master did not see is taken), and
// the gradient.
template <class Arrays>
void set_out_and_grad(Arrays& arr, const StreamedArrays& p, char* param_at, const void* grad_at) {
  if (p.master) {
    arr.param_out = param_at;
    arr.out_type = p.param_type;
    arr.adopt_out = true;
  }
  arr.grad = grad_at;
  arr.grad_type = p.grad_type;
}

// The kernel of one chunk: `dev` holds its state regions in the slot (regions' order).
schedule::Work chunk_kernel(const StreamedArrays& p, const AdamWScalars& s, std::int64_t off, std::int64_t count,
                            const std::vector<char*>& dev, const AdamWLaunchers& launch) {
  const std::size_t pbytes = element_bytes(p.param_type), gbytes = element_bytes(p.grad_type);
  char* param_at = static_cast<char*>(p.param) + static_cast<std::size_t>(off) * pbytes;
  const void* grad_at = static_cast<const char*>(p.grad) + static_cast<std::size_t>(off) * gbytes;
  std::size_t a = 0;
  float* target = p.master ? reinterpret_cast<float*>(dev[a++]) : reinterpret_cast<float*>(param_at);
  schedule::Work kernel;
  if (!p.quant8) {
    AdamWArrays arr;
    arr.param = target;
    arr.exp_avg = reinterpret_cast<float*>(dev[a++]);
    arr.exp_avg_sq = reinterpret_cast<float*>(dev[a++]);
    if (s.amsgrad) arr.max_exp_avg_sq = reinterpret_cast<float*>(dev[a++]);
    set_out_and_grad(arr, p, param_at, grad_at);
    kernel.on_host = [arr, s, count] { adamw_cpu(arr, s, 0, count); };
    if (launch.float32) {
      kernel.on_device = [arr, s, count, f = launch.float32](schedule::NativeStream n) { f(arr, s, count, n); };
    }
  } else {
    AdamW8bitArrays arr;
    arr.param = target;
    const auto moment = [&] {
      Quant8Array q{reinterpret_cast<std::uint8_t*>(dev[a]), reinterpret_cast<float*>(dev[a + 1])};
      a += 2;
      return q;
    };
    arr.exp_avg = moment();
    arr.exp_avg_sq = moment();
    if (s.amsgrad) arr.max_exp_avg_sq = moment();
    set_out_and_grad(arr, p, param_at, grad_at);
    kernel.on_host = [arr, s, count] { adamw8bit_cpu(arr, s, 0, count); };
    if (launch.quant8) {
      kernel.on_device = [arr, s, count, f = launch.quant8](schedule::NativeStream n) { f(arr, s, count, n); };
    }
  }
  kernel.reads.push_back(Range{grad_at, static_cast<std::size_t>(count) * gbytes});
  kernel.writes.push_back(Range{param_at, static_cast<std::size_t>(count) * pbytes});
  if (!p.master) kernel.reads.push_back(Range{param_at, static_cast<std::size_t>(count) * pbytes});
  return kernel;
}

}  // namespace

std::size_t adamw_slot_bytes(const std::vector<StreamedArrays>& params, bool amsgrad, std::int64_t chunk_numel) {
  std::size_t most = 0;
  for (const StreamedArrays& p : params) {
    most = std::max(most, slot_bytes_of(regions(p, amsgrad, 0, std::min(chunk_numel, p.numel))));
  }
  return most;
}

AdamWPipeline::AdamWPipeline(std::int64_t chunk_numel, int slots, std::unique_ptr<schedule::SlotRing> ring)
    : chunk_numel_(chunk_numel), slots_(slots), ring_(std::move(ring)) {
  if (chunk_numel < 1) throw std::invalid_argument("AdamWPipeline: chunk_numel must be >= 1");
  if (slots < 2) throw std::invalid_argument("AdamWPipeline: slots must be >= 2");
  if (!ring_) ring_ = std::make_unique<schedule::SlotRing>(static_cast<std::size_t>(slots));
  if (ring_->size() != static_cast<std::size_t>(slots)) throw std::invalid_argument("AdamWPipeline: ring size");
}

void AdamWPipeline::step(const std::vector<StreamedArrays>& params, const AdamWScalars& s, const AdamWStreams& st,
                         void* ring, std::size_t slot_bytes, bool ring_is_new, const AdamWLaunchers& launch) {
  if (params.empty()) return;
  const std::size_t need = adamw_slot_bytes(params, s.amsgrad, chunk_numel_);
  if (slot_bytes < need) {
    throw std::invalid_argument("AdamWPipeline::step: the ring has " + std::to_string(slot_bytes) +
                                " bytes per slot, these parameters need " + std::to_string(need));
  }
  for (const StreamedArrays& p : params) {
    if (p.quant8 && chunk_numel_ % q8::kBlock != 0) {
      throw std::invalid_argument("AdamWPipeline::step: 8-bit state streams in whole blocks of 256; chunk_numel " +
                                  std::to_string(chunk_numel_) + " is not a multiple of 256");
    }
  }
  if (ring_is_new) st.in.wait(st.compute.record());
  if (finished_) st.in.wait(finished_);  // host state written back before it is read again
  for (const StreamedArrays& p : params) {
    for (std::int64_t off = 0; off < p.numel; off += chunk_numel_) {
      const std::int64_t count = std::min(chunk_numel_, p.numel - off);
      const std::size_t k = ring_->next_slot();
      const std::vector<Region> regs = regions(p, s.amsgrad, off, count);
      std::vector<char*> dev;
      char* at = static_cast<char*>(ring) + k * slot_bytes;
      std::size_t total = 0;
      for (const Region& r : regs) {
        dev.push_back(at);
        at += aligned_up(r.bytes);
        total += r.bytes;
      }

      ring_->acquire(k, st.in);
      for (std::size_t i = 0; i < regs.size(); ++i) {
        st.in.copy(dev[i], regs[i].host, regs[i].bytes, Label{"adamw state in", "copy", regs[i].bytes});
      }
      ring_->pass(k, st.in, st.compute);

      schedule::Work kernel = chunk_kernel(p, s, off, count, dev, launch);
      kernel.label = Label{"adamw chunk", "kernel", total};
      for (std::size_t i = 0; i < regs.size(); ++i) {
        kernel.reads.push_back(Range{dev[i], regs[i].bytes});
        kernel.writes.push_back(Range{dev[i], regs[i].bytes});
      }
      st.compute.enqueue(std::move(kernel));
      ring_->pass(k, st.compute, st.out);

      for (std::size_t i = 0; i < regs.size(); ++i) {
        st.out.copy(regs[i].host, dev[i], regs[i].bytes, Label{"adamw state out", "copy", regs[i].bytes});
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
