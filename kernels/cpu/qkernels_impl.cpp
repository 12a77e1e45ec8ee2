// qkernels_impl.cpp: quantised-weight kernels (see qkernels.h), compiled three
// times: the scalar reference (COLIBRI_ISA=generic), with -mavx2 -mfma -mf16c
// (COLIBRI_ISA=avx2) and with AVX-512 F/BW/VL/VNNI added (COLIBRI_ISA=avx512);
// qkernels.cpp picks one at run time.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/qkernels.h"
#include "model/dtype.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QK_AVX2 1
#else
#define QK_AVX2 0
#endif
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
// NOTE: GCC 12 warns about the deliberately undefined lanes inside its own
// AVX-512 intrinsics (_mm512_undefined_*); the warnings are false positives.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#if QK_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define QK_AVX512 1
#else
#define QK_AVX512 0
#endif

namespace colibri::qkernels {

namespace generic { const QKernelTable& table(); }

namespace COLIBRI_ISA {

namespace {

// Blocks whose largest magnitude is below this are quantised to zero (their
// reciprocal scale would overflow); a non-finite value makes the block's scale NaN.
constexpr float kTinyBlock = 1e-30f;

inline int32_t weight_offset(QuantType t) { return t == QuantType::Int4 ? 8 : 128; }

// ---------------------------------------------------------------------------
// Activation quantisation. NOTE: the SIMD version is bitwise the scalar one:
// the maximum is exact in any order, d and 1/d are computed in scalar code,
// x * (1/d) is one IEEE multiply and both round half to even.

void quantize_block_scalar(const float* x, int64_t B, int32_t off, int8_t* q, float* d, int32_t* corr) {
  bool finite = true;
  float amax = 0.f;
  for (int64_t j = 0; j < B; ++j) {
    const float a = std::fabs(x[j]);
    if (!(a < INFINITY)) finite = false;
    else if (a > amax) amax = a;
  }
  if (!finite || !(amax >= kTinyBlock)) {
    std::memset(q, 0, static_cast<size_t>(B));
    *d = finite ? 0.f : NAN;
  } else {
    const float db = amax / 127.0f, id = 1.0f / db;
    *d = db;
    for (int64_t j = 0; j < B; ++j) q[j] = static_cast<int8_t>(static_cast<int>(std::nearbyint(x[j] * id)));
  }
  // Lane k: -off * (q[4k] + ... + q[4k+3]) (the lanes of the SIMD dot products).
  for (int64_t k = 0; k < 8; ++k) {
    int32_t s = 0;
    if (4 * k < B)
      for (int64_t j = 4 * k; j < 4 * k + 4; ++j) s += q[j];
    corr[k] = -off * s;
  }
}

#if QK_AVX2
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

// One block of 32.
void quantize_block32(const float* x, int32_t off, int8_t* q, float* d, int32_t* corr) {
  const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
  __m256 v[4], mx = _mm256_setzero_ps();
  int finite = 0xFF;
  for (int k = 0; k < 4; ++k) {
    v[k] = _mm256_loadu_ps(x + 8 * k);
    const __m256 a = _mm256_andnot_ps(sign, v[k]);
    finite &= _mm256_movemask_ps(_mm256_cmp_ps(a, inf, _CMP_LT_OQ));
    mx = _mm256_max_ps(mx, a);
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  const float amax = _mm_cvtss_f32(m);
  if (finite != 0xFF || !(amax >= kTinyBlock)) {
    quantize_block_scalar(x, 32, off, q, d, corr);  // zero or NaN block: same rule
    return;
  }
  const float db = amax / 127.0f, id = 1.0f / db;
  *d = db;
  const __m256 vid = _mm256_set1_ps(id);
  __m256i iv[4];
  for (int k = 0; k < 4; ++k)
    iv[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[k], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m256i p16a = _mm256_packs_epi32(iv[0], iv[1]), p16b = _mm256_packs_epi32(iv[2], iv[3]);
  __m256i p8 = _mm256_packs_epi16(p16a, p16b);
  p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), p8);
  // Sums of 4 consecutive codes per lane, times -off.
  const __m256i s4 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), p8), _mm256_set1_epi16(1));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(corr), _mm256_mullo_epi32(s4, _mm256_set1_epi32(-off)));
}
#endif

// Block b of 32 (codes q, corrections c) into its quad (QActs::quad_q,
// quad_corr). NOTE: each block writes only its own bytes (blocks of one quad may
// be quantised by different threads); the last block also zeroes the quad's rest.
void store_quad_block(const QActs& a, int64_t b, const int8_t* q, const int32_t* c, int8_t* qq, int32_t* qc) {
  const int64_t j = b & 3;
  qq += (b >> 2) * 128;
  qc += (b >> 2) * 16;
  std::memcpy(qq + j * 16, q, 16);
  std::memcpy(qq + 64 + j * 16, q + 16, 16);
  for (int k = 0; k < 4; ++k) qc[j * 4 + k] = c[k] + c[k + 4];
  if (b == a.nb - 1 && j < 3) {
    std::memset(qq + (j + 1) * 16, 0, static_cast<size_t>(3 - j) * 16);
    std::memset(qq + 64 + (j + 1) * 16, 0, static_cast<size_t>(3 - j) * 16);
    std::memset(qc + (j + 1) * 4, 0, static_cast<size_t>(3 - j) * 4 * sizeof(int32_t));
  }
}

void quantize_blocks(const float* x, int64_t ldx, int64_t r_begin, int64_t r_end, int64_t b_begin, int64_t b_end,
                     QuantType t, QActBuffer& buf) {
  const QActs& a = buf.acts();
  const int32_t off = weight_offset(t);
  for (int64_t r = r_begin; r < r_end; ++r) {
    const float* xr = x + r * ldx;
    int8_t* q = buf.q() + r * a.q_stride;
    float* d = buf.d() + r * a.nb;
    int32_t* c = buf.corr() + r * a.nb * 8;
    float* d8 = buf.d8() + r * a.nb * 8;
    int8_t* qq = buf.quad_q() + r * a.nquads * 128;
    int32_t* qc = buf.quad_corr() + r * a.nquads * 16;
    for (int64_t b = b_begin; b < b_end; ++b) {
#if QK_AVX2
      if (a.block == 32) {
        quantize_block32(xr + b * 32, off, q + b * 32, d + b, c + b * 8);
        _mm256_storeu_ps(d8 + b * 8, _mm256_set1_ps(d[b]));
        store_quad_block(a, b, q + b * 32, c + b * 8, qq, qc);
        continue;
      }
#endif
      quantize_block_scalar(xr + b * a.block, a.block, off, q + b * a.block, d + b, c + b * 8);
      for (int k = 0; k < 8; ++k) d8[b * 8 + k] = d[b];
      if (a.block == 32) store_quad_block(a, b, q + b * 32, c + b * 8, qq, qc);
    }
  }
}

void quantize(const float* x, int64_t ldx, int64_t r_begin, int64_t r_end, QuantType t, QActBuffer& buf) {
  quantize_blocks(x, ldx, r_begin, r_end, 0, buf.acts().nb, t, buf);
}

// ---------------------------------------------------------------------------
// Products.

#if !QK_AVX2
// The scalar reference: per block the exact integer dot product of the signed
// codes, times (weight scale * activation scale), accumulated in order.
void gemm(const QActs& a, const QMatrix& w, int64_t o_begin, int64_t o_end, float* y, int64_t ldy) {
  const int64_t B = a.block, nb = a.nb, G = w.group, ng = w.in / G, half = B / 2;
  const uint64_t rb = quant_row_bytes(w.type, w.in);
  const bool i4 = w.type == QuantType::Int4;
  for (int64_t o = o_begin; o < o_end; ++o) {
    const uint8_t* wr = w.codes + static_cast<uint64_t>(o) * rb;
    const uint16_t* sr = w.scales + o * ng;
    for (int64_t r = 0; r < a.rows; ++r) {
      const int8_t* xq = a.q + r * a.q_stride;
      const float* xd = a.d + r * nb;
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const int8_t* xb = xq + b * B;
        int32_t isum = 0;
        if (i4) {
          const uint8_t* wb = wr + b * half;
          for (int64_t j = 0; j < half; ++j)
            isum += ((wb[j] & 0x0F) - 8) * xb[j] + ((wb[j] >> 4) - 8) * xb[j + half];
        } else {
          const int8_t* wb = reinterpret_cast<const int8_t*>(wr) + b * B;
          for (int64_t j = 0; j < B; ++j) isum += wb[j] * xb[j];
        }
        const float dd = f16_to_f32(sr[(b * B) / G]) * xd[b];
        acc += static_cast<float>(isum) * dd;
      }
      y[r * ldy + o] = acc;
    }
  }
}
#else

#if QK_AVX512
// R rows with one weight row, by quads of 4 blocks of 32 (QActs::quad_q): one
// 512-bit step per quad, lanes 4j..4j+3 for its block j (each the exact signed
// partial dot product of 8 elements: 4 of the block's first 16, 4 of its last
// 16, from the quad's corrections plus unsigned codes times the activations).
// `sr` points to the row's f16 scales, GS = log2(group / 32). Each block's factor
// is ws * d, one f32 multiply as in the scalar reference, spread to its 4 lanes.
// NOTE: per row the instruction sequence is the same for every R (two
// accumulators over alternate quads, a fixed reduction), so a batch gives each
// row bitwise its value alone. The weights need no more than one 64-byte load
// (int4) or a pair of lane permutes (int8) per quad, shared by the R rows.
// (Reading two weight rows per pass to share the activation loads was tried:
// two interleaved streams cut this machine's single-core DRAM bandwidth from 32
// to 19-24 GB/s, a net loss.)
constexpr int64_t kPrefetchAhead = 4096;  // bytes

template <int R, bool I4, int GS>
inline void dot_rows_quads(const QActs& a, int64_t r0, const uint8_t* wr, const uint16_t* sr, float* out) {
  const int64_t nb = a.nb, nq = a.nquads, full = nb / 4;
  const int8_t* xq[R];
  const int32_t* xc[R];
  const float* xd[R];
  for (int r = 0; r < R; ++r) {
    xq[r] = a.quad_q + (r0 + r) * nq * 128;
    xc[r] = a.quad_corr + (r0 + r) * nq * 16;
    xd[r] = a.d + (r0 + r) * nb;
  }
  const __m512i m4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  // int8: 128 code bytes [b0 | b1 | b2 | b3] -> first halves [b0 0-15 | b1 0-15 | ...], then second halves.
  const __m512i first = _mm512_setr_epi64(0, 1, 4, 5, 8, 9, 12, 13), second = _mm512_setr_epi64(2, 3, 6, 7, 10, 11, 14, 15);
  const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  __m512 acc[2][R];
  for (int r = 0; r < R; ++r) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
  // Quad s into accumulator k; `tail`: the last quad, with nb - 4s < 4 blocks
  // (the codes and scales past the row are masked off; the activations are zero there).
  auto quad = [&](int64_t s, int k, bool tail) {
    const int nv = tail ? static_cast<int>(nb - 4 * s) : 4;
    const __mmask8 m4f = static_cast<__mmask8>((1u << nv) - 1);
    __m512i w0, w1;  // unsigned codes: first and second halves of the 4 blocks
    // Software prefetch of the codes 4 KB ahead (into the next rows): the
    // hardware prefetcher alone leaves a core's stream 10-20% below the bandwidth
    // here (measured: 4-8 KB ahead are equal, 1 KB too close).
    _mm_prefetch(reinterpret_cast<const char*>(wr + s * (I4 ? 64 : 128) + kPrefetchAhead), _MM_HINT_T0);
    if constexpr (!I4) _mm_prefetch(reinterpret_cast<const char*>(wr + s * 128 + 64 + kPrefetchAhead), _MM_HINT_T0);
    if constexpr (I4) {
      // A block's 16 bytes hold its elements 0-15 in the low nibbles, 16-31 in the high.
      const uint8_t* p = wr + s * 64;
      const __m512i v = tail ? _mm512_maskz_loadu_epi8((1ULL << (16 * nv)) - 1, p) : _mm512_loadu_si512(p);
      w0 = _mm512_and_si512(v, m4);
      w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    } else {
      const uint8_t* p = wr + s * 128;
      const __m512i v0 = tail ? _mm512_maskz_loadu_epi8(nv >= 2 ? ~0ULL : 0xFFFFFFFFULL, p) : _mm512_loadu_si512(p);
      const __m512i v1 = tail ? _mm512_maskz_loadu_epi8(nv == 3 ? 0xFFFFFFFFULL : 0ULL, p + 64) : _mm512_loadu_si512(p + 64);
      w0 = _mm512_xor_si512(_mm512_permutex2var_epi64(v0, first, v1), flip);
      w1 = _mm512_xor_si512(_mm512_permutex2var_epi64(v0, second, v1), flip);
    }
    __m128 wv;  // the 4 blocks' weight scales (f16 -> f32 here: no staging through memory)
    if constexpr (GS == 0) {
      wv = _mm_cvtph_ps(tail ? _mm_maskz_loadu_epi16(m4f, sr + 4 * s) : _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sr + 4 * s)));
    } else if constexpr (GS == 1) {
      const __m128 g2 = _mm_cvtph_ps(tail ? _mm_maskz_loadu_epi16(1, sr + 2 * s) : _mm_loadu_si32(sr + 2 * s));
      wv = _mm_unpacklo_ps(g2, g2);
    } else {
      wv = _mm_cvtph_ps(_mm_set1_epi16(static_cast<short>(sr[s])));  // group 128: one per quad
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* xs = xq[r] + s * 128;
      __m512i p = _mm512_loadu_si512(xc[r] + s * 16);
      p = _mm512_dpbusd_epi32(p, w0, _mm512_loadu_si512(xs));
      p = _mm512_dpbusd_epi32(p, w1, _mm512_loadu_si512(xs + 64));
      const __m128 dv = tail ? _mm_maskz_loadu_ps(m4f, xd[r] + 4 * s) : _mm_loadu_ps(xd[r] + 4 * s);
      const __m512 f = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_mul_ps(wv, dv)));
      acc[k][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), f, acc[k][r]);
    }
  };
  int64_t s = 0;
  for (; s + 2 <= full; s += 2) {
    quad(s, 0, false);
    quad(s + 1, 1, false);
  }
  if (s < full) {
    quad(s, 0, false);
    if (s + 1 < nq) quad(s + 1, 1, true);
  } else if (s < nq) {
    quad(s, 0, true);
  }
  for (int r = 0; r < R; ++r) {
    const __m512 t = _mm512_add_ps(acc[0][r], acc[1][r]);
    out[r] = hsum(_mm256_add_ps(_mm512_castps512_ps256(t), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t), 1))));
  }
}
#else
// R rows with one weight row, blocks of 32; `ws` holds the row's scales in
// f32. NOTE: per row the instruction sequence is the same for every R (two
// accumulators over alternate blocks, a fixed reduction), so a batch gives each
// row bitwise its value alone. Each block's factor is ws * d, one f32 multiply
// as in the scalar reference.
template <int R, bool I4>
inline void dot_rows(const QActs& a, int64_t r0, const uint8_t* wr, const float* ws, int gshift, float* out) {
  const int64_t nb = a.nb;
  const int8_t* xq[R];
  const float* xd[R];
  const int32_t* xc[R];
  for (int r = 0; r < R; ++r) {
    xq[r] = a.q + (r0 + r) * a.q_stride;
    xd[r] = a.d8 + (r0 + r) * nb * 8;
    xc[r] = a.corr + (r0 + r) * nb * 8;
  }
  const __m256i ones = _mm256_set1_epi16(1), m4 = _mm256_set1_epi8(0x0F);
  __m256 acc[2][R];
  for (int r = 0; r < R; ++r) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
  auto block = [&](int64_t b, int k) {
    const __m256 wv = _mm256_broadcast_ss(ws + (b >> gshift));
    __m256i wq, aw;
    if constexpr (I4) {
      // 16 bytes -> 32 unsigned codes: low nibbles are elements 0..15, high 16..31.
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + b * 16));
      wq = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), m4);
      aw = wq;
    } else {
      wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + b * 32));
      aw = _mm256_sign_epi8(wq, wq);  // |w| (the sign moves to x below)
    }
    for (int r = 0; r < R; ++r) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[r] + b * 32));
      __m256i p;
      if constexpr (I4) {
        // (q + 8) . x, then -8 * sum(x) per lane from the block's correction.
        p = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(aw, xv), ones),
                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc[r] + b * 8)));
      } else {
        p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, wq)), ones);
      }
      acc[k][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(wv, _mm256_loadu_ps(xd[r] + b * 8)), acc[k][r]);
    }
  };
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    block(b, 0);
    block(b + 1, 1);
  }
  if (b < nb) block(b, 0);
  for (int r = 0; r < R; ++r) out[r] = hsum(_mm256_add_ps(acc[0][r], acc[1][r]));
}
#endif

#if QK_AVX512
template <bool I4, int GS>
void gemm_t(const QActs& a, const QMatrix& w, int64_t o_begin, int64_t o_end, float* y, int64_t ldy) {
  const int64_t ng = w.in / w.group;
  const uint64_t rb = quant_row_bytes(w.type, w.in);
  for (int64_t o = o_begin; o < o_end; ++o) {
    const uint8_t* wr = w.codes + static_cast<uint64_t>(o) * rb;
    const uint16_t* sr = w.scales + o * ng;
    int64_t r = 0;
    for (; r + 4 <= a.rows; r += 4) {
      float out[4];
      dot_rows_quads<4, I4, GS>(a, r, wr, sr, out);
      for (int k = 0; k < 4; ++k) y[(r + k) * ldy + o] = out[k];
    }
    for (; r < a.rows; ++r) {
      float out[1];
      dot_rows_quads<1, I4, GS>(a, r, wr, sr, out);
      y[r * ldy + o] = out[0];
    }
  }
}
#else
template <bool I4>
void gemm_t(const QActs& a, const QMatrix& w, int64_t o_begin, int64_t o_end, float* y, int64_t ldy) {
  const int64_t ng = w.in / w.group;
  const uint64_t rb = quant_row_bytes(w.type, w.in);
  const int gshift = w.group == 128 ? 2 : w.group == 64 ? 1 : 0;
  // The row's f16 scales in f32 (+ spare), on the stack up to 1024 groups
  // (widths 16384 to 131072).
  alignas(64) float local[1024 + 16];
  std::vector<float> heap;
  float* ws = local;
  if (ng + 16 > 1024 + 16) {
    heap.assign(static_cast<size_t>(ng + 16), 0.f);
    ws = heap.data();
  } else {
    std::memset(local + ng, 0, 16 * sizeof(float));
  }
  for (int64_t o = o_begin; o < o_end; ++o) {
    const uint8_t* wr = w.codes + static_cast<uint64_t>(o) * rb;
    const uint16_t* sr = w.scales + o * ng;
    int64_t g = 0;
    for (; g + 8 <= ng; g += 8)
      _mm256_storeu_ps(ws + g, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sr + g))));
    for (; g < ng; ++g) ws[g] = _cvtsh_ss(sr[g]);
    int64_t r = 0;
    for (; r + 4 <= a.rows; r += 4) {
      float out[4];
      dot_rows<4, I4>(a, r, wr, ws, gshift, out);
      for (int k = 0; k < 4; ++k) y[(r + k) * ldy + o] = out[k];
    }
    for (; r < a.rows; ++r) {
      float out[1];
      dot_rows<1, I4>(a, r, wr, ws, gshift, out);
      y[r * ldy + o] = out[0];
    }
  }
}
#endif

void gemm(const QActs& a, const QMatrix& w, int64_t o_begin, int64_t o_end, float* y, int64_t ldy) {
  if (a.block != 32) {
    // Group sizes below 32 (tiny models only) run the scalar reference.
    generic::table().gemm(a, w, o_begin, o_end, y, ldy);
    return;
  }
#if QK_AVX512
  const bool i4 = w.type == QuantType::Int4;
  if (w.group == 32)
    i4 ? gemm_t<true, 0>(a, w, o_begin, o_end, y, ldy) : gemm_t<false, 0>(a, w, o_begin, o_end, y, ldy);
  else if (w.group == 64)
    i4 ? gemm_t<true, 1>(a, w, o_begin, o_end, y, ldy) : gemm_t<false, 1>(a, w, o_begin, o_end, y, ldy);
  else
    i4 ? gemm_t<true, 2>(a, w, o_begin, o_end, y, ldy) : gemm_t<false, 2>(a, w, o_begin, o_end, y, ldy);
#else
  if (w.type == QuantType::Int4)
    gemm_t<true>(a, w, o_begin, o_end, y, ldy);
  else
    gemm_t<false>(a, w, o_begin, o_end, y, ldy);
#endif
}
#endif

}  // namespace

const QKernelTable& table() {
  static const QKernelTable t = {QK_AVX512 ? "avx512" : QK_AVX2 ? "avx2" : "generic", quantize, quantize_blocks, gemm};
  return t;
}

}  // namespace COLIBRI_ISA
}  // namespace colibri::qkernels
