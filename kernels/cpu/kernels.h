// kernels.h: CPU compute kernels on raw pointers (no engine types). Each kernel
// exists as a plain scalar reference ("generic"), an AVX2+FMA+F16C version and
// an AVX-512 version, chosen at run time from what the CPU supports.
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
  // Rotary embedding of the first `rd` dimensions of `heads` vectors `stride`
  // apart: element i pairs with i + rd/2 (or, interleaved, 2i with 2i+1,
  // written back in half layout); cos/sin hold rd/2 angles' values.
  void (*rope)(float* x, int64_t heads, int64_t stride, int64_t rd, bool interleaved, const float* cos,
               const float* sin);
  // One query over the n cached positions first, ..., first + n - 1:
  // out = sum_t softmax(scale * q.k_t)_t v_t; a non-null `sink` logit joins the
  // softmax denominator only (gpt-oss). scores: n floats of scratch.
  // Position p's key is row r(p) of k (rows `stride` floats apart; v alike):
  // r(p) = p without a block table; with one (a paged cache, blocks of
  // `block_rows` positions), r(p) = blocks[p / block_rows] * block_rows +
  // p % block_rows. The arithmetic is the same either way: only addresses differ.
  void (*attend)(const float* q, int64_t d, const float* k, const float* v, int64_t stride, const int32_t* blocks,
                 int64_t block_rows, int64_t first, int64_t n, float scale, const float* sink, float* scores,
                 float* out);
  // attend over a cache of 16-bit values (`t`: DType::BF16 or DType::F16; rows
  // `stride` values apart): each row is widened to f32 (exactly) and used as
  // attend uses an f32 row, so the result is bitwise attend's over the widened
  // cache. d <= kMaxAttendDim.
  void (*attend16)(const float* q, int64_t d, const uint16_t* k, const uint16_t* v, int64_t stride, DType t,
                   const int32_t* blocks, int64_t block_rows, int64_t first, int64_t n, float scale, const float* sink,
                   float* scores, float* out);
  // n bf16 or f16 values (`t`) to f32, exactly (what to_f32 gives, vectorised).
  void (*widen16)(const uint16_t* src, DType t, int64_t n, float* dst);
};

// The widest head attend16 takes (the latent attention of DeepSeek-V3 reads 576).
constexpr int64_t kMaxAttendDim = 1024;

// The AVX2 and AVX-512 tables (and the quantised ones in qkernels.h) are built
// only for x86-64 (CMakeLists.txt compiles kernels_impl.cpp per ISA there only).
// Elsewhere (aarch64: Grace) only "generic" exists: cpu_has_avx2/avx512() are
// false, table_named()/select() refuse the x86 names and avx2_table() /
// avx512_table() throw Error(Unsupported).
#if defined(__x86_64__)
#define COLIBRI_X86_KERNELS 1
#else
#define COLIBRI_X86_KERNELS 0
#endif

const KernelTable& generic_table();
const KernelTable& avx2_table();
const KernelTable& avx512_table();
bool cpu_has_avx2();    // AVX2 + FMA + F16C (false when not x86-64)
bool cpu_has_avx512();  // and AVX-512 F, BW, VL, DQ (false when not x86-64)
// The table of that name ("generic", "avx2", "avx512") when the CPU runs it, else null.
const KernelTable* table_named(const char* name);

// The table in use: the widest the CPU supports (AVX-512, AVX2, generic), or
// the one the environment variable COLIBRI_KERNELS names.
const KernelTable& active();
const KernelTable& default_kernels();
// Forces a table (tests, benchmarks); returns false when the CPU lacks it.
bool select(const char* name);

// Threaded wrappers (OpenMP over output columns; results independent of the
// thread count).
void gemm(const float* x, int64_t ldx, int64_t rows, const void* w, DType wt, int64_t in, int64_t out, float* y,
          int64_t ldy);
// Several independent products in one parallel region (one fork and join
// instead of one per product: attention's q, k and v, an FFN's gate and up).
// Each result is bitwise what gemm() gives for it alone.
struct GemmJob {
  const float* x;
  int64_t ldx, rows;
  const void* w;
  DType wt;
  int64_t in, out;
  float* y;
  int64_t ldy;
};
void gemm_many(const GemmJob* jobs, int n);
inline void gemv(const float* x, const void* w, DType wt, int64_t in, int64_t out, float* y) {
  gemm(x, in, 1, w, wt, in, out, y, out);
}

// Time and floating-point operations spent in gemm() (the matrix products of
// attention, dense FFNs, experts, router and LM head), for `colibri bench`.
// Off by default (one relaxed atomic load per call).
struct GemmStats {
  double flops = 0, seconds = 0;
  uint64_t calls = 0;
};
void enable_gemm_stats(bool on);
void reset_gemm_stats();
GemmStats gemm_stats();

// Converts `n` stored elements to f32.
void to_f32(const void* src, DType t, int64_t n, float* dst);

// The most compute threads accepted (--threads, colibri_config.n_threads):
// OpenMP crashes (SIGSEGV) when asked for far more threads than it can create.
constexpr int kMaxThreads = 1024;

// Sets the OpenMP thread count (0: all cores); returns the count in use.
// Error(InvalidArgument) outside [0, kMaxThreads].
int set_threads(int n);

}  // namespace colibri::kernels
