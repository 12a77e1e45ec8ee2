// kernels_impl.cpp: compiled twice, as the scalar reference (COLIBRI_ISA=generic)
// and with -mavx2 -mfma -mf16c (COLIBRI_ISA=avx2); kernels.cpp picks one.
#include <cmath>
#include <cstring>

#include "kernels/cpu/kernels.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define COLIBRI_SIMD 1
#else
#define COLIBRI_SIMD 0
#endif

namespace colibri::kernels {
namespace COLIBRI_ISA {

namespace {

#if COLIBRI_SIMD
// Loads 8 weights as f32.
inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load8(const uint16_t* w, DType t) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  if (t == DType::F16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}
#endif

inline float wload(const float* w, int64_t i, DType) { return w[i]; }
inline float wload(const uint16_t* w, int64_t i, DType t) {
  return t == DType::F16 ? f16_to_f32(w[i]) : bf16_to_f32(w[i]);
}

// R dot products of x rows with one weight row. NOTE: per element the
// operation sequence is the same for every R (two 8-lane accumulators over
// 16-element steps, one 8-step, a fixed horizontal sum, then a scalar tail),
// which is what makes batched and single rows bitwise equal.
template <int R, typename W>
inline void dot_rows(const float* const* xs, const W* w, DType t, int64_t n, float* out) {
#if COLIBRI_SIMD
  __m256 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256 w0, w1;
    if constexpr (sizeof(W) == 4) { w0 = load8(w + i); w1 = load8(w + i + 8); }
    else { w0 = load8(w + i, t); w1 = load8(w + i + 8, t); }
    for (int r = 0; r < R; ++r) {
      a0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xs[r] + i), w0, a0[r]);
      a1[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xs[r] + i + 8), w1, a1[r]);
    }
  }
  if (i + 8 <= n) {
    __m256 w0;
    if constexpr (sizeof(W) == 4) w0 = load8(w + i);
    else w0 = load8(w + i, t);
    for (int r = 0; r < R; ++r) a0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xs[r] + i), w0, a0[r]);
    i += 8;
  }
  for (int r = 0; r < R; ++r) {
    float s = hsum(_mm256_add_ps(a0[r], a1[r]));
    for (int64_t j = i; j < n; ++j) s = std::fma(xs[r][j], wload(w, j, t), s);
    out[r] = s;
  }
#else
  // Scalar reference: 16 lanes, pairwise-free sequential lane sums.
  for (int r = 0; r < R; ++r) {
    float lane[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
      for (int k = 0; k < 16; ++k) lane[k] += xs[r][i + k] * wload(w, i + k, t);
    float s = 0.f;
    for (int k = 0; k < 16; ++k) s += lane[k];
    for (; i < n; ++i) s += xs[r][i] * wload(w, i, t);
    out[r] = s;
  }
#endif
}

template <typename W>
void gemm_t(const float* x, int64_t ldx, int64_t rows, const W* w, DType t, int64_t in, int64_t o_begin, int64_t o_end,
            float* y, int64_t ldy) {
  for (int64_t o = o_begin; o < o_end; ++o) {
    const W* wr = w + o * in;
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {
      const float* xs[4] = {x + r * ldx, x + (r + 1) * ldx, x + (r + 2) * ldx, x + (r + 3) * ldx};
      float out[4];
      dot_rows<4>(xs, wr, t, in, out);
      for (int k = 0; k < 4; ++k) y[(r + k) * ldy + o] = out[k];
    }
    for (; r < rows; ++r) {
      const float* xs[1] = {x + r * ldx};
      float out[1];
      dot_rows<1>(xs, wr, t, in, out);
      y[r * ldy + o] = out[0];
    }
  }
}

void gemm(const float* x, int64_t ldx, int64_t rows, const void* w, DType wt, int64_t in, int64_t o_begin,
          int64_t o_end, float* y, int64_t ldy) {
  if (wt == DType::F32)
    gemm_t(x, ldx, rows, static_cast<const float*>(w), wt, in, o_begin, o_end, y, ldy);
  else
    gemm_t(x, ldx, rows, static_cast<const uint16_t*>(w), wt, in, o_begin, o_end, y, ldy);
}

float dot(const float* a, const float* b, int64_t n) {
  const float* xs[1] = {a};
  float out[1];
  dot_rows<1>(xs, b, DType::F32, n, out);
  return out[0];
}

void rmsnorm(const float* x, const float* w, float* y, int64_t n, float eps) {
  float ss = dot(x, x, n);
  float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] * inv) * w[i];
}

void silu_mul(float* g, const float* u, int64_t n) {
  for (int64_t i = 0; i < n; ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

void axpy(float* y, float a, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

}  // namespace

const KernelTable& table() {
  static const KernelTable t = {COLIBRI_SIMD ? "avx2" : "generic", gemm, dot, rmsnorm, silu_mul, axpy};
  return t;
}

}  // namespace COLIBRI_ISA
}  // namespace colibri::kernels
