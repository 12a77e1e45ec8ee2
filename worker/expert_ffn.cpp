// expert_ffn.cpp: gated feed-forward blocks on the CPU kernels.
#include "worker/expert_ffn.h"

#include <algorithm>
#include <cmath>

#include "kernels/cpu/kernels.h"

namespace colibri {

FfnSpec FfnSpec::experts(const ModelConfig& c) {
  FfnSpec s;
  s.hidden = c.hidden_size;
  s.inter = c.intermediate_size;
  s.oai = c.expert_act == "swiglu_oai";
  s.alpha = static_cast<float>(c.swiglu_alpha);
  s.limit = static_cast<float>(c.swiglu_limit);
  return s;
}

FfnSpec FfnSpec::silu(int64_t hidden, int64_t inter) {
  FfnSpec s;
  s.hidden = hidden;
  s.inter = inter;
  return s;
}

FfnWeights FfnWeights::of(const ExpertView& e) {
  FfnWeights w;
  w.dtype = e.dtype;
  w.gate = e.gate;
  w.up = e.up;
  w.down = e.down;
  w.gate_bias = e.gate_bias;
  w.up_bias = e.up_bias;
  w.down_bias = e.down_bias;
  return w;
}

void ffn(const FfnWeights& w, const FfnSpec& s, const float* x, int64_t rows, float* y, float* g, float* u) {
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
