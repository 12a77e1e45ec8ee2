// kernels.cpp: run-time ISA selection and the threaded wrappers.
#include "kernels/cpu/kernels.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstring>

namespace colibri::kernels {

namespace generic { const KernelTable& table(); }
namespace avx2 { const KernelTable& table(); }

const KernelTable& generic_table() { return generic::table(); }
const KernelTable& avx2_table() { return avx2::table(); }

bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

namespace {
// NOTE: chosen once at start-up (static initialisation), so concurrent
// readers never race with the lazy choice; select() changes it for tests.
std::atomic<const KernelTable*> g_active{nullptr};
const KernelTable* default_table() { return cpu_has_avx2() ? &avx2_table() : &generic_table(); }
[[maybe_unused]] const bool g_init = (g_active.store(default_table()), true);
}  // namespace

const KernelTable& active() {
  const KernelTable* t = g_active.load(std::memory_order_acquire);
  if (!t) {
    t = default_table();
    g_active.store(t);
  }
  return *t;
}

bool select(const char* name) {
  if (std::strcmp(name, "generic") == 0) {
    g_active = &generic_table();
    return true;
  }
  if (std::strcmp(name, "avx2") == 0 && cpu_has_avx2()) {
    g_active = &avx2_table();
    return true;
  }
  return false;
}

void gemm(const float* x, int64_t ldx, int64_t rows, const void* w, DType wt, int64_t in, int64_t out, float* y,
          int64_t ldy) {
  const KernelTable& k = active();
  // NOTE: threads split the output columns in blocks of 16; work per thread is
  // tiny below a few thousand multiply-adds, so small products stay serial.
  const int64_t work = rows * in * out;
  if (work < (1 << 15) || omp_get_max_threads() == 1 || omp_in_parallel()) {
    k.gemm(x, ldx, rows, w, wt, in, 0, out, y, ldy);
    return;
  }
  const int64_t blocks = (out + 15) / 16;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) k.gemm(x, ldx, rows, w, wt, in, b * 16, std::min(out, b * 16 + 16), y, ldy);
}

void to_f32(const void* src, DType t, int64_t n, float* dst) {
  convert_elements(src, t, dst, DType::F32, static_cast<size_t>(n));
}

int set_threads(int n) {
  if (n > 0) omp_set_num_threads(n);
  return omp_get_max_threads();
}

}  // namespace colibri::kernels
