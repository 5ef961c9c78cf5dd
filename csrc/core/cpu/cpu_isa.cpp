#include "csrc/core/cpu/cpu_isa.h"

#include <cstdlib>
#include <stdexcept>

namespace hipferry::cpu {

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "baseline";
  }
}

Isa best_isa() {
#ifdef HIPFERRY_HAVE_AVX2_BUILD
  // Every AVX2 CPU has F16C (Intel Haswell+, AMD since Piledriver), checked
  // all the same; older Clang rejects the "f16c" name here. The AVX-512
  // checks include the OS's support for the registers (XCR0).
  static const Isa best = [] {
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return Isa::kBaseline;
    const bool avx512 =
        __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
    return avx512 ? Isa::kAvx512 : Isa::kAvx2;
  }();
  return best;
#else
  return Isa::kBaseline;
#endif
}

Isa parse_isa(const std::string& value, Isa best) {
  if (value.empty() || value == "auto") return best;
  for (Isa isa : {Isa::kBaseline, Isa::kAvx2, Isa::kAvx512}) {
    if (value != isa_name(isa)) continue;
    if (isa > best) {
      throw std::invalid_argument(std::string("HIPFERRY_CPU_ISA=") + value + ", but this CPU (or this build) has no " +
                                  (isa == Isa::kAvx2 ? "AVX2" : "AVX-512") + " loops; the best here is " +
                                  isa_name(best) + " (use auto, or a build up to that one)");
    }
    return isa;
  }
  throw std::invalid_argument("HIPFERRY_CPU_ISA must be auto, baseline, avx2 or avx512, got '" + value + "'");
}

Isa active_isa() {
  static const Isa isa = [] {
    const char* env = std::getenv("HIPFERRY_CPU_ISA");
    return parse_isa(env ? env : "", best_isa());
  }();
  return isa;
}

}  // namespace hipferry::cpu
