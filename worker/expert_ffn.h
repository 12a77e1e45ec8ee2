// expert_ffn.h: a gated feed-forward block (an expert, a shared expert or a
// dense MLP) on a group of rows:
//   silu:       y = down(silu(gate(x)) * up(x))
//   swiglu_oai: g = min(gate(x) + bg, limit), u = clamp(up(x) + bu, -limit, limit),
//               y = down((u + 1) * g * sigmoid(alpha * g)) + bd      (gpt-oss)
#pragma once
#include <cstdint>

#include "model/colibri_file.h"
#include "model/config.h"

namespace colibri {

struct FfnSpec {
  int64_t hidden = 0, inter = 0;
  bool oai = false;  // swiglu_oai activation
  float alpha = 1.702f, limit = 7.0f;
  // The routed experts' FFN of a model.
  static FfnSpec experts(const ModelConfig& c);
  // A plain SiLU FFN (dense layers, shared experts).
  static FfnSpec silu(int64_t hidden, int64_t inter);
};

struct FfnWeights {
  DType dtype = DType::F32;
  const void *gate = nullptr, *up = nullptr, *down = nullptr;  // [inter, hidden], [inter, hidden], [hidden, inter]
  const float *gate_bias = nullptr, *up_bias = nullptr, *down_bias = nullptr;  // optional
  // Quantised matrices (routed experts of an expert_quant file): gate, up and
  // down are codes with these f16 scales, and `dtype` is unused.
  QuantType quant = QuantType::None;
  int64_t quant_group = 0;
  const uint16_t *gate_scales = nullptr, *up_scales = nullptr, *down_scales = nullptr;
  static FfnWeights of(const ExpertView& e);
};

// x: [rows][hidden]; y: [rows][hidden]; scratch_gate, scratch_up: [rows][inter].
void ffn(const FfnWeights& w, const FfnSpec& s, const float* x, int64_t rows, float* y, float* scratch_gate,
         float* scratch_up);

inline void expert_ffn(const ExpertView& e, const FfnSpec& s, const float* x, int64_t rows, float* y, float* g, float* u) {
  ffn(FfnWeights::of(e), s, x, rows, y, g, u);
}

}  // namespace colibri
