// Which build of the CPU loops runs: the portable baseline (SSE2 on x86-64) or
// the AVX2 build picked at run time where the CPU has it. Written once here for
// every loop (AdamW, copy_cast). The loops are exact (correctly rounded
// operations only, no FMA), so both builds give the same bits; the override
// lets tests prove that on any machine.
//
//   HIPFERRY_CPU_ISA=auto      (default) the best build this CPU runs
//   HIPFERRY_CPU_ISA=baseline  force the portable loops
//   HIPFERRY_CPU_ISA=avx2      require AVX2 (an error where the CPU lacks it)
//
// The AVX2 builds exist on x86-64 with GCC or Clang unless
// HIPFERRY_NO_ISA_DISPATCH is defined (ThreadSanitizer builds: GCC instruments
// the CPU-feature resolver that runs before TSan's runtime is up).
#pragma once

#include <string>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(HIPFERRY_NO_ISA_DISPATCH)
#define HIPFERRY_HAVE_AVX2_BUILD 1
// The one target of every kAvx2 function: what best_isa() checks the CPU for.
#define HIPFERRY_AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#endif

namespace hipferry::cpu {

enum class Isa { kBaseline, kAvx2 };

const char* isa_name(Isa isa);

// The best build this CPU can run (kAvx2 needs AVX2, FMA and F16C).
Isa best_isa();

// Parses a HIPFERRY_CPU_ISA value against `best` (what this CPU can run).
// Throws std::invalid_argument naming the variable for an unknown value or
// for "avx2" on a CPU without it.
Isa parse_isa(const std::string& value, Isa best);

// HIPFERRY_CPU_ISA parsed once (the first call; later calls return the same):
// the build every CPU loop uses. Throws like parse_isa.
Isa active_isa();

}  // namespace hipferry::cpu
