// kernels.h: CPU compute kernels on raw pointers (no engine types). Each kernel
// exists as a plain scalar reference ("generic") and an AVX2+FMA+F16C version,
// chosen at run time from what the CPU supports.
#pragma once
#include <cstdint>

#include "model/dtype.h"

namespace colibri::kernels {

// The per-ISA function table; both implementations fill one in.
struct KernelTable {
  const char* name;
  // y[r * ldy + o] = sum_i x[r * ldx + i] * w[o * in + i] for r < rows, o in [o_begin, o_end).
  // NOTE: every output element is computed by the same instruction sequence
  // whatever `rows` is, so a batch gives bitwise the same rows as each alone.
  void (*gemm)(const float* x, int64_t ldx, int64_t rows, const void* w, DType wt, int64_t in, int64_t o_begin,
               int64_t o_end, float* y, int64_t ldy);
  float (*dot)(const float* a, const float* b, int64_t n);
  // y = (x * rsqrt(mean(x^2) + eps)) * w
  void (*rmsnorm)(const float* x, const float* w, float* y, int64_t n, float eps);
  // g = silu(g) * u
  void (*silu_mul)(float* g, const float* u, int64_t n);
  // y += a * x
  void (*axpy)(float* y, float a, const float* x, int64_t n);
};

const KernelTable& generic_table();
const KernelTable& avx2_table();
bool cpu_has_avx2();

// The table in use: AVX2 when the CPU has AVX2, FMA and F16C, else generic.
const KernelTable& active();
// Forces "generic" or "avx2" (tests, benchmarks); returns false when unavailable.
bool select(const char* name);

// Threaded wrappers (OpenMP over output columns; results independent of the
// thread count).
void gemm(const float* x, int64_t ldx, int64_t rows, const void* w, DType wt, int64_t in, int64_t out, float* y,
          int64_t ldy);
inline void gemv(const float* x, const void* w, DType wt, int64_t in, int64_t out, float* y) {
  gemm(x, in, 1, w, wt, in, out, y, out);
}

// Converts `n` stored elements to f32.
void to_f32(const void* src, DType t, int64_t n, float* dst);

// Sets the OpenMP thread count (0: all cores); returns the count in use.
int set_threads(int n);

}  // namespace colibri::kernels
