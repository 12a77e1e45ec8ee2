// clang_compat.h: force-included (-include) into the C++ sources of the
// ThreadSanitizer build, which uses Clang (see scripts/sanitize.sh).
// NOTE: Clang (16 included) rejects __builtin_cpu_supports("f16c") ("invalid cpu
// feature string for builtin"), which kernels/cpu/kernels.cpp uses to choose the
// AVX2 kernels. This maps the builtin to one that answers "f16c" from CPUID (leaf
// 1, ECX bit 29; F16C needs the OS-enabled AVX state, which
// __builtin_cpu_supports("avx") checks) and passes other features to the real
// builtin. The GCC builds do not use this file.
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
  return 0;
}
#define __builtin_cpu_supports(feature) colibri_compat_cpu_supports(feature)
#endif
