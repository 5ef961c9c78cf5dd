// Which build of the CPU loops runs: the portable baseline (SSE2 on x86-64),
// the AVX2 build or the AVX-512 build, picked at run time where the CPU has
// them. Written once here for every loop (AdamW, copy_cast). The loops are
// exact (correctly rounded operations only, no FMA, one canonical NaN), so
// every build gives the same bits; the override lets tests prove that on any
// machine.
//
//   HIPFERRY_CPU_ISA=auto      (default) the best build this CPU runs
//   HIPFERRY_CPU_ISA=baseline  force the portable loops
//   HIPFERRY_CPU_ISA=avx2      require AVX2 (an error where the CPU lacks it)
//   HIPFERRY_CPU_ISA=avx512    require AVX-512 F/BW/VL (an error where the CPU lacks it)
//
// The AVX2 and AVX-512 builds exist on x86-64 with GCC or Clang unless
// HIPFERRY_NO_ISA_DISPATCH is defined (ThreadSanitizer builds: GCC instruments
// the CPU-feature resolver that runs before TSan's runtime is up).
#pragma once

#include <string>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(HIPFERRY_NO_ISA_DISPATCH)
#define HIPFERRY_HAVE_AVX2_BUILD 1
#define HIPFERRY_HAVE_AVX512_BUILD 1
// The one target of every kAvx2 function: what best_isa() checks the CPU for.
#define HIPFERRY_AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
// The one target of every kAvx512 function (a superset of the AVX2 target).
#define HIPFERRY_AVX512_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl")))
#endif

namespace hipferry::cpu {

// Ordered: a CPU that runs one build runs every build before it.
enum class Isa { kBaseline, kAvx2, kAvx512 };

const char* isa_name(Isa isa);

// The best build this CPU can run (kAvx2 needs AVX2, FMA and F16C; kAvx512
// also AVX-512 F, BW and VL, with the OS saving their registers).
Isa best_isa();

// Parses a HIPFERRY_CPU_ISA value against `best` (what this CPU can run).
// Throws std::invalid_argument naming the variable for an unknown value or
// for a build beyond `best`.
Isa parse_isa(const std::string& value, Isa best);

// HIPFERRY_CPU_ISA parsed once (the first call; later calls return the same):
// the build every CPU loop uses. Throws like parse_isa.
Isa active_isa();

}  // namespace hipferry::cpu
