// clang_compat.h: force-included (-include) into the C++ sources of the
// sanitizer builds, which use Clang 14 (see scripts/sanitize.sh); the GCC
// builds do not use it. It changes no behaviour, only two spellings Clang rejects:
//
// - __builtin_cpu_supports("f16c") (kernels/cpu/kernels.cpp): "invalid cpu feature
//   string for builtin" in Clang (16 too). Mapped to a function that answers "f16c"
//   from CPUID (leaf 1, ECX bit 29; F16C also needs the OS-enabled AVX state, which
//   __builtin_cpu_supports("avx") checks) and passes other features to the builtin.
// - _Float16 (model/dtype.h): Clang < 15 has no _Float16 on x86-64. __fp16 is the
//   same IEEE binary16 storage type; the code only converts it to and from float,
//   exactly (RNE) either way, and the build adds -mf16c so no library helper is needed.
//   (tests/fuzz/compat/model/dtype.h does the same for the fuzzers.)
#pragma once
#if defined(__clang__) && defined(__cplusplus) && (defined(__x86_64__) || defined(__i386__))
#include <cpuid.h>

#include <cstring>

static inline int colibri_compat_cpu_supports(const char* feature) {
  if (std::strcmp(feature, "f16c") == 0) {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) && __builtin_cpu_supports("avx");
  }
  if (std::strcmp(feature, "avx2") == 0) return __builtin_cpu_supports("avx2");
  if (std::strcmp(feature, "fma") == 0) return __builtin_cpu_supports("fma");
  if (std::strcmp(feature, "avx") == 0) return __builtin_cpu_supports("avx");
  if (std::strcmp(feature, "avx512f") == 0) return __builtin_cpu_supports("avx512f");
  if (std::strcmp(feature, "avx512bw") == 0) return __builtin_cpu_supports("avx512bw");
  if (std::strcmp(feature, "avx512dq") == 0) return __builtin_cpu_supports("avx512dq");
  if (std::strcmp(feature, "avx512vl") == 0) return __builtin_cpu_supports("avx512vl");
  if (std::strcmp(feature, "avx512vnni") == 0) return __builtin_cpu_supports("avx512vnni");
  // NOTE: a feature missing here would read as absent and silently skip its kernels.
  __builtin_trap();
}
#define __builtin_cpu_supports(feature) colibri_compat_cpu_supports(feature)

#if __clang_major__ < 15
#define _Float16 __fp16
#endif
#endif
