// kernels_impl.cpp: compiled once per ISA: the scalar reference
// (COLIBRI_ISA=generic), AVX2+FMA+F16C (avx2) and AVX-512 F/BW/VL/DQ (avx512);
// kernels.cpp picks one at run time.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define COLIBRI_SIMD 16
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define COLIBRI_SIMD 8
#else
#define COLIBRI_SIMD 0
#endif

namespace colibri::kernels {
namespace COLIBRI_ISA {

namespace {

inline float wload(const float* w, int64_t i, DType) { return w[i]; }
inline float wload(const uint16_t* w, int64_t i, DType t) {
  return t == DType::F16 ? f16_to_f32(w[i]) : bf16_to_f32(w[i]);
}

#if COLIBRI_SIMD == 16
using vf = __m512;
constexpr int kLanes = 16;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vload(const uint16_t* p, DType t) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if (t == DType::F16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vset1(float a) { return _mm512_set1_ps(a); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
// A fixed reduction tree (halves, then quarters...), the same for every call.
inline float hsum(vf v) {
  __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}
#elif COLIBRI_SIMD == 8
using vf = __m256;
constexpr int kLanes = 8;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vload(const uint16_t* p, DType t) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if (t == DType::F16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vset1(float a) { return _mm256_set1_ps(a); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline float hsum(vf v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}
#endif

#if COLIBRI_SIMD == 16
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vfloor(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
inline vf vpow2i(vf n) {  // 2^n for integral n in [-126, 127]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
inline float hmax(vf v) { return _mm512_reduce_max_ps(v); }
#elif COLIBRI_SIMD == 8
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vfloor(vf a) { return _mm256_floor_ps(a); }
inline vf vpow2i(vf n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline float hmax(vf v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}
#endif

#if COLIBRI_SIMD
// exp(x) for every lane (Cephes expf: range reduction by ln 2 in two parts and a
// degree-6 polynomial; about 1 ulp, x clamped to [-87.3, 88.7]).
inline vf vexp(vf x) {
  x = vmin(vmax(x, vset1(-87.3365f)), vset1(88.7228f));
  const vf fx = vfloor(vfma(x, vset1(1.44269504088896341f), vset1(0.5f)));
  x = vfma(fx, vset1(-0.693359375f), x);
  x = vfma(fx, vset1(2.12194440e-4f), x);
  const vf z = vmul(x, x);
  vf y = vset1(1.9875691500e-4f);
  y = vfma(y, x, vset1(1.3981999507e-3f));
  y = vfma(y, x, vset1(8.3334519073e-3f));
  y = vfma(y, x, vset1(4.1665795894e-2f));
  y = vfma(y, x, vset1(1.6666665459e-1f));
  y = vfma(y, x, vset1(5.0000001201e-1f));
  y = vfma(y, z, vadd(x, vset1(1.0f)));
  return vmul(y, vpow2i(fx));
}

template <typename W>
inline vf wvec(const W* w, int64_t i, DType t) {
  if constexpr (sizeof(W) == 4) return vload(w + i);
  else return vload(w + i, t);
}

// An R x O tile of dot products over one K block: xs[r] and ws[o] point at
// the block's first element; it takes `len` of the `n` elements left from
// there. The last block (len == n) writes out[r * O + o] = x_r . w_o; an
// earlier one (len a multiple of 2L) leaves its lane accumulators in `part`,
// where the next block, `resume`d, starts from them instead of zero.
// NOTE: every element is computed by the same instruction sequence whatever R,
// O and the K blocks are (two L-lane accumulators over 2L-element steps, one
// L-step, a fixed horizontal sum, then a scalar FMA tail), which is what makes
// a batch bitwise equal to each of its rows alone, and the tiling free to change.
template <int R, int O, typename W>
inline void tile_k(const float* const* xs, const W* const* ws, DType t, bool resume, int64_t len, int64_t n,
                   float* part, float* out) {
  constexpr int64_t L = kLanes;
  vf a0[R][O], a1[R][O];
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) {
      if (resume) {
        a0[r][o] = vload(part + ((r * O + o) * 2) * L);
        a1[r][o] = vload(part + ((r * O + o) * 2 + 1) * L);
      } else {
        a0[r][o] = a1[r][o] = vzero();
      }
    }
  int64_t i = 0;
  for (; i + 2 * L <= len; i += 2 * L) {
    // The two halves one after the other: O weight vectors and one x vector
    // live at a time beside the accumulators (no register spills).
    for (int h = 0; h < 2; ++h) {
      vf wv[O];
      for (int o = 0; o < O; ++o) wv[o] = wvec(ws[o], i + h * L, t);
      for (int r = 0; r < R; ++r) {
        vf xv = vload(xs[r] + i + h * L);
        // NOTE: keeps x in a register for its O uses; left alone, GCC folds
        // the load into each FMA, and loads (not FMAs) then bound the loop.
        if constexpr (O > 1) asm("" : "+v"(xv));
        for (int o = 0; o < O; ++o) {
          if (h == 0) a0[r][o] = vfma(xv, wv[o], a0[r][o]);
          else a1[r][o] = vfma(xv, wv[o], a1[r][o]);
        }
      }
    }
  }
  if (len < n) {
    for (int r = 0; r < R; ++r)
      for (int o = 0; o < O; ++o) {
        vstore(part + ((r * O + o) * 2) * L, a0[r][o]);
        vstore(part + ((r * O + o) * 2 + 1) * L, a1[r][o]);
      }
    return;
  }
  if (i + L <= n) {
    for (int o = 0; o < O; ++o) {
      const vf w0 = wvec(ws[o], i, t);
      for (int r = 0; r < R; ++r) a0[r][o] = vfma(vload(xs[r] + i), w0, a0[r][o]);
    }
    i += L;
  }
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) {
      float s = hsum(vadd(a0[r][o], a1[r][o]));
      for (int64_t j = i; j < n; ++j) s = std::fma(xs[r][j], wload(ws[o], j, t), s);
      out[r * O + o] = s;
    }
}
#else
// Scalar reference: 16 lanes, sequential lane sums, then the tail; K blocks as
// above (the lanes kept in `part`; len a multiple of 16 when len < n).
template <int R, int O, typename W>
inline void tile_k(const float* const* xs, const W* const* ws, DType t, bool resume, int64_t len, int64_t n,
                   float* part, float* out) {
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) {
      float* p = part ? part + (r * O + o) * 16 : nullptr;
      float lane[16] = {0};
      if (resume) std::copy(p, p + 16, lane);
      int64_t i = 0;
      for (; i + 16 <= len; i += 16)
        for (int k = 0; k < 16; ++k) lane[k] += xs[r][i + k] * wload(ws[o], i + k, t);
      if (len < n) {
        std::copy(lane, lane + 16, p);
        continue;
      }
      float s = 0.f;
      for (int k = 0; k < 16; ++k) s += lane[k];
      for (; i < n; ++i) s += xs[r][i] * wload(ws[o], i, t);
      out[r * O + o] = s;
    }
}
#endif

template <int R, int O, typename W>
inline void tile(const float* const* xs, const W* const* ws, DType t, int64_t n, float* out) {
  tile_k<R, O>(xs, ws, t, false, n, n, nullptr, out);
}

// Tile shapes: rows x outputs per micro-kernel call, sized to the registers
// (AVX2: 16 ymm, 3 x 2 tile = 12 accumulators; AVX-512: 32 zmm, 4 x 3 = 24).
#if COLIBRI_SIMD == 16
constexpr int kTileR = 4, kTileO = 3;
#else
constexpr int kTileR = 3, kTileO = 2;
#endif
// K blocks (in floats; a multiple of 2 x 16 lanes) of rows longer than this:
// a tile's x rows (4 x 1024 floats = 16 KiB) then stay in L1 (48 KiB here)
// beside the weights streaming from L2 and the lane accumulators kept between
// blocks; a 4 x 3584 tile (56 KiB) did not, and ran 20 % slower.
constexpr int64_t kKBlock = 1024;
static_assert(kKBlock % 32 == 0, "a K block ends on a double step of every table");
// Decode (one row): one weight row at a time. NOTE: rows are contiguous, so
// this reads the matrix as one sequential stream; reading 2 or 4 rows at once
// (several streams 2*in bytes apart) measured 20-60 % slower here.
constexpr int kRowO = 1;

// Rows xs[0..R) (pointing at input i0) of outputs [o_begin, o_end) over the
// K block [i0, i1) of the `in` inputs (tile_k); `part` holds the lane
// accumulators of output o at part + (o - o_begin) * R * 2 * 16 between
// blocks; the last block writes y (row r at y + r * ldy).
template <int R, typename W, int O = (R == 1 ? kRowO : kTileO)>
void rows_tile(const float* const* xs, const W* w, DType t, int64_t in, int64_t o_begin, int64_t o_end, float* y,
               int64_t ldy, int64_t i0 = 0, int64_t i1 = -1, float* part = nullptr) {
  if (i1 < 0) i1 = in;
  float out[R * O];
  int64_t o = o_begin;
  for (; o + O <= o_end; o += O) {
    const W* ws[O];
    for (int k = 0; k < O; ++k) ws[k] = w + (o + k) * in + i0;
    tile_k<R, O>(xs, ws, t, i0 > 0, i1 - i0, in - i0, part ? part + (o - o_begin) * R * 2 * 16 : nullptr, out);
    if (i1 == in)
      for (int r = 0; r < R; ++r)
        for (int k = 0; k < O; ++k) y[r * ldy + o + k] = out[r * O + k];
  }
  for (; o < o_end; ++o) {
    const W* ws[1] = {w + o * in + i0};
    tile_k<R, 1>(xs, ws, t, i0 > 0, i1 - i0, in - i0, part ? part + (o - o_begin) * R * 2 * 16 : nullptr, out);
    if (i1 == in)
      for (int r = 0; r < R; ++r) y[r * ldy + o] = out[r];
  }
}

// Rows r0.. r0 + R of a block of f32 weights (outputs [0, n)), in K blocks
// of at most kKBlock inputs. Each block's x rows are first copied to `xb`
// (R x kKBlock floats, 64-byte aligned): the tiles then load x from one
// aligned, L1-resident buffer whatever the caller's alignment (misaligned x
// measured ~10 % slower).
template <int R, int O = kTileO>
void rows_tile_kb(const float* x, int64_t ldx, int64_t r0, const float* wb, int64_t in, int64_t n, float* y,
                  int64_t ldy, float* part, float* xb) {
  for (int64_t i0 = 0; i0 < in; i0 += kKBlock) {
    const int64_t i1 = in - i0 > kKBlock ? i0 + kKBlock : in;
    const float* xs[R];
    for (int r = 0; r < R; ++r) {
      const float* src = x + (r0 + r) * ldx + i0;
      std::copy(src, src + (i1 - i0), xb + r * kKBlock);
      xs[r] = xb + r * kKBlock;
    }
    rows_tile<R, float, O>(xs, wb, DType::F32, in, 0, n, y + r0 * ldy, ldy, i0, i1, part);
  }
}

template <typename W>
void gemm_t(const float* x, int64_t ldx, int64_t rows, const W* w, DType t, int64_t in, int64_t o_begin, int64_t o_end,
            float* y, int64_t ldy) {
  if (rows < kTileR) {
    // A small batch (decode): the weights read in place.
    int64_t r = 0;
    for (; r + 2 <= rows; r += 2) {
      const float* xs[2] = {x + r * ldx, x + (r + 1) * ldx};
      rows_tile<2>(xs, w, t, in, o_begin, o_end, y + r * ldy, ldy);
    }
    for (; r < rows; ++r) {
      const float* xs[1] = {x + r * ldx};
      rows_tile<1>(xs, w, t, in, o_begin, o_end, y + r * ldy, ldy);
    }
    return;
  }
  // Blocks of outputs whose weights, as f32, stay in L2 (512 KiB) while
  // every row tile passes over them; rows in register tiles inside. 16-bit
  // weights are widened once per block (exactly: bf16/f16 -> f32 is exact),
  // not once per row tile.
  const int64_t ob = std::max<int64_t>(kTileO, (512 * 1024) / std::max<int64_t>(in * 4, 1) / kTileO * kTileO);
  // NOTE: both scratch buffers start on a cache line: a vector load that
  // straddles two lines costs two, and a large vector's data starts 16 bytes
  // past a page (measured up to 20 % slower).
  thread_local std::vector<float> wfv, partv, xbv;
  auto aligned = [](std::vector<float>& v, int64_t n) {
    v.resize(static_cast<size_t>(n + 16));
    return v.data() + (16 - (reinterpret_cast<uintptr_t>(v.data()) / sizeof(float)) % 16) % 16;
  };
  // The lane accumulators of one row tile over a block's outputs, between K
  // blocks.
  float* part = in > kKBlock ? aligned(partv, ob * kTileR * 2 * 16) : nullptr;
  float* xb = aligned(xbv, kTileR * kKBlock);
  float* wf = sizeof(W) == 4 ? nullptr : aligned(wfv, ob * in);
  for (int64_t o0 = o_begin; o0 < o_end; o0 += ob) {
    const int64_t o1 = std::min(o_end, o0 + ob), n = o1 - o0;
    const float* wb;
    if constexpr (sizeof(W) == 4) {
      wb = w + o0 * in;
    } else {
      const W* src = w + o0 * in;
      int64_t i = 0;
#if COLIBRI_SIMD
      for (; i + kLanes <= n * in; i += kLanes) vstore(wf + i, vload(src + i, t));
#endif
      for (; i < n * in; ++i) wf[i] = wload(src, i, t);
      wb = wf;
    }
    // NOTE: the block's weights are addressed from output o0, so the tile
    // sees rows [0, n) and writes y columns o0.. through the offset. The
    // last rows (fewer than a tile) take a narrower tile over the same block.
    int64_t r = 0;
    for (; r + kTileR <= rows; r += kTileR) rows_tile_kb<kTileR>(x, ldx, r, wb, in, n, y + o0, ldy, part, xb);
    switch (rows - r) {
      case 3: rows_tile_kb<3>(x, ldx, r, wb, in, n, y + o0, ldy, part, xb); break;
      case 2: rows_tile_kb<2>(x, ldx, r, wb, in, n, y + o0, ldy, part, xb); break;
      case 1: rows_tile_kb<1>(x, ldx, r, wb, in, n, y + o0, ldy, part, xb); break;
      default: break;
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
  const float* ws[1] = {b};
  float out[1];
  tile<1, 1>(xs, ws, DType::F32, n, out);
  return out[0];
}

void rmsnorm(const float* x, const float* w, float* y, int64_t n, float eps) {
  float ss = dot(x, x, n);
  float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] * inv) * w[i];
}

void silu_mul(float* g, const float* u, int64_t n) {
  int64_t i = 0;
#if COLIBRI_SIMD
  const vf one = vset1(1.0f), zero = vzero();
  for (; i + kLanes <= n; i += kLanes) {
    const vf gv = vload(g + i);
    vstore(g + i, vmul(vdiv(gv, vadd(one, vexp(vsub(zero, gv)))), vload(u + i)));
  }
#endif
  for (; i < n; ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

void axpy(float* y, float a, const float* x, int64_t n) {
  int64_t i = 0;
#if COLIBRI_SIMD
  // NOTE: one fused multiply-add per element, vector or tail alike.
  const vf va = vset1(a);
  for (; i + kLanes <= n; i += kLanes) vstore(y + i, vfma(va, vload(x + i), vload(y + i)));
#endif
  for (; i < n; ++i) y[i] = std::fma(a, x[i], y[i]);
}

void rope(float* x, int64_t heads, int64_t stride, int64_t rd, bool interleaved, const float* cos, const float* sin) {
  const int64_t half = rd / 2;
  float tmp[1024];
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * stride;
    float *lo = v, *hi = v + half;
    if (interleaved) {
      // Pairs (2i, 2i+1), written back in half layout as transformers does.
      for (int64_t i = 0; i < half; ++i) tmp[i] = v[2 * i], tmp[i + half] = v[2 * i + 1];
      lo = tmp;
      hi = tmp + half;
    }
    int64_t i = 0;
#if COLIBRI_SIMD
    for (; i + kLanes <= half; i += kLanes) {
      const vf a = vload(lo + i), b = vload(hi + i), c = vload(cos + i), s = vload(sin + i);
      vstore(v + i, vsub(vmul(a, c), vmul(b, s)));
      vstore(v + half + i, vadd(vmul(b, c), vmul(a, s)));
    }
#endif
    for (; i < half; ++i) {
      const float a = lo[i], b = hi[i];
      v[i] = a * cos[i] - b * sin[i];
      v[i + half] = b * cos[i] + a * sin[i];
    }
  }
}

// The cache rows of positions first, first + 1, ... in order
// (KernelTable::attend): no division per position.
struct CacheRows {
  const int32_t* blocks;
  int64_t block_rows, blk, off;  // with a table: the block index and the offset in it; without: blk is the row
  CacheRows(const int32_t* b, int64_t br, int64_t first)
      : blocks(b), block_rows(br), blk(b ? first / br : first), off(b ? first % br : 0) {}
  int64_t row() const { return blocks ? static_cast<int64_t>(blocks[blk]) * block_rows + off : blk; }
  void next() {
    if (blocks && ++off < block_rows) return;
    off = 0;
    ++blk;
  }
};

// The softmax of attend: scores[t] = exp(scores[t] - m) with m the largest
// score (and the sink), returns 1 / their sum, to which the sink's term is
// added (it joins the denominator only).
float softmax_weights(float* scores, int64_t n, float mx, const float* sink) {
  if (sink) mx = std::max(mx, *sink);
  float sum = 0.f;
  int64_t t = 0;
#if COLIBRI_SIMD
  {
    const vf vm = vset1(mx);
    vf acc = vzero();
    for (; t + kLanes <= n; t += kLanes) {
      const vf e = vexp(vsub(vload(scores + t), vm));
      vstore(scores + t, e);
      acc = vadd(acc, e);
    }
    sum = hsum(acc);
  }
#endif
  for (; t < n; ++t) sum += (scores[t] = std::exp(scores[t] - mx));
  if (sink) sum += std::exp(*sink - mx);
  return 1.0f / sum;
}

void attend(const float* q, int64_t d, const float* k, const float* v, int64_t stride, const int32_t* blocks,
            int64_t block_rows, int64_t first, int64_t n, float scale, const float* sink, float* scores, float* out) {
  float mx = -INFINITY;
  CacheRows kr(blocks, block_rows, first);
  for (int64_t t = 0; t < n; ++t, kr.next()) {
    const float s = dot(q, k + kr.row() * stride, d) * scale;
    scores[t] = s;
    mx = std::max(mx, s);
  }
  const float inv = softmax_weights(scores, n, mx, sink);
  std::memset(out, 0, static_cast<size_t>(d) * sizeof(float));
  CacheRows vr(blocks, block_rows, first);
  for (int64_t t2 = 0; t2 < n; ++t2, vr.next()) axpy(out, scores[t2] * inv, v + vr.row() * stride, d);
}

// n 16-bit values to f32: exact conversions (a shift for bf16, F16C's for f16),
// so the same values as to_f32's.
void widen16(const uint16_t* src, DType t, int64_t n, float* dst) {
  int64_t i = 0;
#if COLIBRI_SIMD
  for (; i + kLanes <= n; i += kLanes) vstore(dst + i, vload(src + i, t));
#endif
  if (i < n) to_f32(src + i, t, n - i, dst + i);
}

// NOTE: the same operations as attend, in the same order, on each row widened
// into a buffer (exactly), so that the two agree bitwise.
void attend16(const float* q, int64_t d, const uint16_t* k, const uint16_t* v, int64_t stride, DType type,
              const int32_t* blocks, int64_t block_rows, int64_t first, int64_t n, float scale, const float* sink,
              float* scores, float* out) {
  alignas(64) float row[kMaxAttendDim];
  float mx = -INFINITY;
  CacheRows kr(blocks, block_rows, first);
  for (int64_t t = 0; t < n; ++t, kr.next()) {
    widen16(k + kr.row() * stride, type, d, row);
    const float s = dot(q, row, d) * scale;
    scores[t] = s;
    mx = std::max(mx, s);
  }
  const float inv = softmax_weights(scores, n, mx, sink);
  std::memset(out, 0, static_cast<size_t>(d) * sizeof(float));
  CacheRows vr(blocks, block_rows, first);
  for (int64_t t2 = 0; t2 < n; ++t2, vr.next()) {
    widen16(v + vr.row() * stride, type, d, row);
    axpy(out, scores[t2] * inv, row, d);
  }
}

}  // namespace

const KernelTable& table() {
  static const KernelTable t = {COLIBRI_SIMD == 16 ? "avx512" : COLIBRI_SIMD == 8 ? "avx2" : "generic",
                                gemm, dot, rmsnorm, silu_mul, axpy, rope, attend, attend16, widen16};
  return t;
}

}  // namespace COLIBRI_ISA
}  // namespace colibri::kernels
