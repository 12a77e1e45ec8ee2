// emu_check.cpp: tests/cuda_checks.h (the checks of tests/cuda_check.cu) run on
// the CPU through the SIMT emulator (emu.h: what it proves and what it does not),
// against kernels/cuda/*.cu rewritten by prep.py. ctest runs it as
// cuda.emulated.dense (the dense layers) and cuda.emulated.ffn (to_bf16, the
// cuBLASLt GEMM, FfnRunner), with fixed seeds.
//
//   cuda_emu_check GROUP SEED...   GROUP: dense, ffn or all; exit 0 all passed, 1 a failure
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <random>

#include "tests/cuda_checks.h"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s dense|ffn|all SEED...\n", argv[0]);
    return 2;
  }
  const std::string group = argv[1];
  const bool dense = group == "dense" || group == "all", ffn = group == "ffn" || group == "all";
  if (!dense && !ffn) {
    std::fprintf(stderr, "unknown group %s\n", argv[1]);
    return 2;
  }
  for (int a = 2; a < argc; ++a) {
    const uint64_t seed = std::strtoull(argv[a], nullptr, 10);
    std::printf("cuda_emu_check %s: seed %llu\n", argv[1], (unsigned long long)seed);
    std::fflush(stdout);
    std::mt19937_64 rng(seed);
    const int failed_before = failures;
    try {
      if (ffn) check_ffn_kernels(rng);
      if (dense) check_dense_kernels(rng);
    } catch (const std::exception& e) {
      std::printf("FAIL (seed %llu): %s\n", (unsigned long long)seed, e.what());
      return 1;
    }
    if (failures > failed_before) std::printf("seed %llu: %d failed\n", (unsigned long long)seed, failures - failed_before);
  }
  std::printf("%d checks, %d failed, %lld kernel launches emulated\n", checks, failures, emu::sched.launches);
  return failures ? 1 : 0;
}
