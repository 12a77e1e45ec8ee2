// expert_ffn.cpp: gated feed-forward blocks on the CPU kernels.
#include "worker/expert_ffn.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include <omp.h>

#include "kernels/cpu/kernels.h"
#include "kernels/cpu/qkernels.h"

namespace colibri {

FfnWeights FfnWeights::of(const ExpertView& e) {
  FfnWeights w;
  w.dtype = e.dtype;
  w.gate = e.gate;
  w.up = e.up;
  w.down = e.down;
  w.gate_bias = e.gate_bias;
  w.up_bias = e.up_bias;
  w.down_bias = e.down_bias;
  w.quant = e.quant;
  w.quant_group = e.quant_group;
  w.gate_scales = e.gate_scales;
  w.up_scales = e.up_scales;
  w.down_scales = e.down_scales;
  return w;
}

namespace {

// Biases and activation of columns [c0, c1) of every row: g = act(g + bg, u + bu).
void activate(const FfnWeights& w, const FfnShape& s, float* g, float* u, int64_t I, int64_t rows, int64_t c0, int64_t c1) {
  for (int64_t r = 0; r < rows; ++r) {
    float* gr = g + r * I;
    float* ur = u + r * I;
    if (w.gate_bias)
      for (int64_t i = c0; i < c1; ++i) gr[i] += w.gate_bias[i];
    if (w.up_bias)
      for (int64_t i = c0; i < c1; ++i) ur[i] += w.up_bias[i];
    if (s.oai) {
      for (int64_t i = c0; i < c1; ++i) {
        const float gv = std::min(gr[i], s.limit);
        const float uv = std::clamp(ur[i], -s.limit, s.limit);
        const float glu = gv * (1.0f / (1.0f + std::exp(-(gv * s.alpha))));
        gr[i] = (uv + 1.0f) * glu;
      }
    } else {
      kernels::active().silu_mul(gr + c0, ur + c0, c1 - c0);
    }
  }
}

// The quantised FFN in one OpenMP region: x quantised (once, or by each thread
// for a few rows); gate and up over slices of whole activation blocks, each
// slice activated and re-quantised at once for down; then down. NOTE: threads split outputs (and blocks of the
// quantisation), never a sum, so the result is the same for any thread count,
// and every row's values are those it gets alone.
void ffn_quantized(const FfnWeights& w, const FfnShape& s, const float* x, int64_t rows, float* y, float* g, float* u) {
  const int64_t H = s.hidden, I = s.inter, unit = quant_unit(w.quant_group);
  const qkernels::QKernelTable& k = qkernels::active();
  // NOTE: the buffers belong to the calling thread (thread_local there), so the
  // OpenMP team's threads never own heap memory that outlives them.
  thread_local std::vector<qkernels::QActBuffer> xq_tls;  // [team thread]
  thread_local qkernels::QActBuffer gq_tls;
  qkernels::QActBuffer& gq = gq_tls;
  gq.prepare(rows, I, unit);
  const auto* gc = static_cast<const uint8_t*>(w.gate);
  const auto* uc = static_cast<const uint8_t*>(w.up);
  const auto* dc = static_cast<const uint8_t*>(w.down);
  const qkernels::QMatrix gm{w.quant, w.quant_group, H, gc, w.gate_scales}, um{w.quant, w.quant_group, H, uc, w.up_scales},
      dm{w.quant, w.quant_group, I, dc, w.down_scales};
  const int64_t xblocks = H / unit, slices = I / unit, dblocks = (H + 15) / 16;
  const bool par = rows * H * I >= (1 << 15) && omp_get_max_threads() > 1 && !omp_in_parallel();
  // Few rows (decode): every thread quantises x itself, which saves a barrier;
  // many rows: the team shares one quantisation.
  const bool own_x = !par || rows <= 16;
  const size_t team = par ? static_cast<size_t>(omp_get_max_threads()) : 1;
  if (xq_tls.size() < team) xq_tls.resize(team);
  std::vector<qkernels::QActBuffer>& xbufs = xq_tls;
  if (!own_x) xbufs[0].prepare(rows, H, unit);
#pragma omp parallel if (par)
  {
    qkernels::QActBuffer& xq = xbufs[own_x ? static_cast<size_t>(omp_get_thread_num()) : 0];
    if (own_x) {
      xq.prepare(rows, H, unit);
      k.quantize(x, H, 0, rows, w.quant, xq);
    } else {
      const int64_t chunks = std::min<int64_t>(xblocks, 64);
#pragma omp for schedule(static)
      for (int64_t c = 0; c < chunks; ++c)
        k.quantize_blocks(x, H, 0, rows, xblocks * c / chunks, xblocks * (c + 1) / chunks, w.quant, xq);
    }
#pragma omp for schedule(static)
    for (int64_t sl = 0; sl < slices; ++sl) {
      const int64_t o0 = sl * unit, o1 = o0 + unit;
      k.gemm(xq.acts(), gm, o0, o1, g, I);
      k.gemm(xq.acts(), um, o0, o1, u, I);
      activate(w, s, g, u, I, rows, o0, o1);
      k.quantize_blocks(g, I, 0, rows, sl, sl + 1, w.quant, gq);
    }
#pragma omp for schedule(static) nowait
    for (int64_t b = 0; b < dblocks; ++b) {
      const int64_t o0 = b * 16, o1 = std::min(H, o0 + 16);
      k.gemm(gq.acts(), dm, o0, o1, y, H);
      if (w.down_bias)
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t i = o0; i < o1; ++i) y[r * H + i] += w.down_bias[i];
    }
  }
}

}  // namespace

void ffn(const FfnWeights& w, const FfnShape& s, const float* x, int64_t rows, float* y, float* g, float* u) {
  if (w.quant != QuantType::None) {
    ffn_quantized(w, s, x, rows, y, g, u);
    return;
  }
  const int64_t H = s.hidden, I = s.inter;
  kernels::gemm(x, H, rows, w.gate, w.dtype, H, I, g, I);
  kernels::gemm(x, H, rows, w.up, w.dtype, H, I, u, I);
  if (w.gate_bias)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < I; ++i) g[r * I + i] += w.gate_bias[i];
  if (w.up_bias)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < I; ++i) u[r * I + i] += w.up_bias[i];
  if (s.oai) {
    for (int64_t r = 0; r < rows; ++r) {
      float* gr = g + r * I;
      const float* ur = u + r * I;
      for (int64_t i = 0; i < I; ++i) {
        const float gv = std::min(gr[i], s.limit);
        const float uv = std::clamp(ur[i], -s.limit, s.limit);
        const float glu = gv * (1.0f / (1.0f + std::exp(-(gv * s.alpha))));
        gr[i] = (uv + 1.0f) * glu;
      }
    }
  } else {
    const auto& k = kernels::active();
    for (int64_t r = 0; r < rows; ++r) k.silu_mul(g + r * I, u + r * I, I);
  }
  kernels::gemm(g, I, rows, w.down, w.dtype, I, H, y, H);
  if (w.down_bias)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < H; ++i) y[r * H + i] += w.down_bias[i];
}

}  // namespace colibri
