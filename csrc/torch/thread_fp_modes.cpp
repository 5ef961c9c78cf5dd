// hipferry._C._thread_fp_modes / _set_thread_fp_modes: the denormal mode of
// each of torch's intra-op threads, read on one thread's team and set on
// another's. torch.set_flush_denormal sets the mode of the calling thread
// only (x86: MXCSR's FTZ and DAZ bits; aarch64: FPCR's FZ bit), and each
// intra-op thread keeps the mode of the thread that made it, so the chunks of
// one parallel loop may run under different modes. OffloadAdamW's speculative
// step runs on a worker thread with a team of its own; it gives each of that
// team's threads the mode of the thread that would run the same chunk in
// step() (Note [speculative step] in hipferry/optim/speculation.py).
//
// Index i of a parallel_for over [0, n) with grain 1 and n = the number of
// threads runs on intra-op thread i (OpenMP, torch's backend on Linux: one
// chunk per thread, the calling thread first), the thread that runs chunk i
// of every parallel loop of as many threads.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <vector>

#include "csrc/core/errors.h"
#include "csrc/torch/python_errors.h"
#include "csrc/torch/stable.h"

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace py = pybind11;

namespace hipferry {
namespace {

#if defined(__x86_64__) || defined(__i386__)
constexpr std::uint32_t kFlushBits = 0x8040;  // FTZ (bit 15) and DAZ (bit 6): what torch.set_flush_denormal sets
std::uint32_t read_mode() { return _mm_getcsr() & kFlushBits; }
void write_mode(std::uint32_t mode) { _mm_setcsr((_mm_getcsr() & ~kFlushBits) | (mode & kFlushBits)); }
#elif defined(__aarch64__)
constexpr std::uint64_t kFlushBits = 1ULL << 24;  // FPCR.FZ
std::uint32_t read_mode() {
  std::uint64_t fpcr;
  asm volatile("mrs %0, fpcr" : "=r"(fpcr));
  return static_cast<std::uint32_t>((fpcr & kFlushBits) >> 24);
}
void write_mode(std::uint32_t mode) {
  std::uint64_t fpcr;
  asm volatile("mrs %0, fpcr" : "=r"(fpcr));
  fpcr = (fpcr & ~kFlushBits) | (static_cast<std::uint64_t>(mode & 1) << 24);
  asm volatile("msr fpcr, %0" : : "r"(fpcr));
}
#else
std::uint32_t read_mode() { return 0; }  // no flush-to-zero mode torch sets on this architecture
void write_mode(std::uint32_t) {}
#endif

std::vector<std::uint32_t> thread_modes() {
  const std::int64_t n = torch::stable::get_num_threads();
  std::vector<std::uint32_t> modes(static_cast<std::size_t>(n), 0);
  torch::stable::parallel_for(0, n, 1, [&](std::int64_t begin, std::int64_t end) {
    const std::uint32_t mode = read_mode();
    for (std::int64_t i = begin; i < end; ++i) modes[i] = mode;
  });
  return modes;
}

void set_thread_modes(const std::vector<std::uint32_t>& modes) {
  const std::int64_t n = torch::stable::get_num_threads();
  HF_CHECK_VALUE(static_cast<std::int64_t>(modes.size()) == n, "hipferry._set_thread_fp_modes: modes has ",
                 modes.size(), " entries but this thread's parallel loops run on ", n,
                 " threads; expected one mode per thread (torch.set_num_threads first)");
  torch::stable::parallel_for(0, n, 1, [&](std::int64_t begin, std::int64_t end) { write_mode(modes[begin]); });
}

}  // namespace

void bind_thread_fp_modes(py::module_& m) {
  m.def(
      "_thread_fp_modes", [] { return translate_errors([] { return thread_modes(); }); },
      "The denormal mode of each of torch's intra-op threads as the calling thread's parallel loops use them "
      "(index i: the thread that runs chunk i; 0: denormals kept).");
  m.def(
      "_set_thread_fp_modes",
      [](const std::vector<std::uint32_t>& modes) { translate_errors([&] { set_thread_modes(modes); }); },
      py::arg("modes"),
      "Gives each of the calling thread's intra-op threads the mode at its index (from _thread_fp_modes).");
}

}  // namespace hipferry
