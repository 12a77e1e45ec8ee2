// omp_race_canary.cpp: proves that the ThreadSanitizer setup of scripts/sanitize.sh
// is meaningful for OpenMP code. Built with the TSan build's compiler and flags:
// without -DCANARY_RACE it must run clean (results written in a parallel loop and
// read after its implicit barrier: a false positive unless Archer tells TSan about
// the barrier); with -DCANARY_RACE (an unsynchronised shared accumulator) TSan must
// report a data race.
#include <omp.h>

#include <cstdio>
#include <vector>

int main() {
  std::vector<float> y(4096, 0.f);
  float racy = 0.f;
#pragma omp parallel for schedule(static) num_threads(2)
  for (int i = 0; i < 4096; ++i) {
    y[i] = static_cast<float>(i) * 0.5f;
#ifdef CANARY_RACE
    racy += y[i];
#endif
  }
  float total = 0.f;
  for (float v : y) total += v;
  std::printf("%g %g\n", static_cast<double>(total), static_cast<double>(racy));
  return 0;
}
