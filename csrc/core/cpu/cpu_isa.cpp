#include "csrc/core/cpu/cpu_isa.h"

#include <cstdlib>
#include <stdexcept>

namespace hipferry::cpu {

const char* isa_name(Isa isa) { return isa == Isa::kAvx2 ? "avx2" : "baseline"; }

Isa best_isa() {
#ifdef HIPFERRY_HAVE_AVX2_BUILD
  // Every AVX2 CPU has F16C (Intel Haswell+, AMD since Piledriver), checked
  // all the same; older Clang rejects the "f16c" name here.
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (yes) return Isa::kAvx2;
#endif
  return Isa::kBaseline;
}

Isa parse_isa(const std::string& value, Isa best) {
  if (value.empty() || value == "auto") return best;
  if (value == "baseline") return Isa::kBaseline;
  if (value == "avx2") {
    if (best != Isa::kAvx2) {
      throw std::invalid_argument(
          "HIPFERRY_CPU_ISA=avx2, but this CPU (or this build) has no AVX2 loops; use auto or baseline");
    }
    return Isa::kAvx2;
  }
  throw std::invalid_argument("HIPFERRY_CPU_ISA must be auto, baseline or avx2, got '" + value + "'");
}

Isa active_isa() {
  static const Isa isa = [] {
    const char* env = std::getenv("HIPFERRY_CPU_ISA");
    return parse_isa(env ? env : "", best_isa());
  }();
  return isa;
}

}  // namespace hipferry::cpu
