// ffn.h: a gated feed-forward block (a routed expert, a shared expert or a
// dense MLP): its shape, the one description every backend takes (the CPU's
// ffn() in worker/expert_ffn.h, the GPU's FfnRunner in kernels/cuda/ffn.h, the
// GPU packing in kernels/cuda/ffn_pack.h), and its weights as stored.
//   silu:       y = down(silu(gate(x)) * up(x))
//   swiglu_oai: g = min(gate(x) + bg, limit), u = clamp(up(x) + bu, -limit, limit),
//               y = down((u + 1) * g * sigmoid(alpha * g)) + bd      (gpt-oss)
// NOTE: FfnShape is plain C++17 with no other header of ours, so that nvcc
// compiles kernels/cuda/ffn.h with it; FfnWeights is host-only.
#pragma once
#include <cstdint>

namespace colibri {

struct ModelConfig;

struct FfnShape {
  int64_t hidden = 0, inter = 0;
  bool oai = false;  // swiglu_oai activation
  float alpha = 1.702f, limit = 7.0f;
  // The routed experts' FFN of a model (model/config.cpp).
  static FfnShape experts(const ModelConfig& c);
  // A plain SiLU FFN (dense layers, shared experts).
  static FfnShape silu(int64_t hidden, int64_t inter) {
    FfnShape s;
    s.hidden = hidden;
    s.inter = inter;
    return s;
  }
};

}  // namespace colibri

#ifndef __CUDACC__
#include "model/colibri_file.h"

namespace colibri {

struct FfnWeights {
  DType dtype = DType::F32;
  const void *gate = nullptr, *up = nullptr, *down = nullptr;  // [inter, hidden], [inter, hidden], [hidden, inter]
  const float *gate_bias = nullptr, *up_bias = nullptr, *down_bias = nullptr;  // optional
  // Quantised matrices (routed experts of an expert_quant file): gate, up and
  // down are codes with these f16 scales, and `dtype` is unused.
  QuantType quant = QuantType::None;
  int64_t quant_group = 0;
  const uint16_t *gate_scales = nullptr, *up_scales = nullptr, *down_scales = nullptr;
  static FfnWeights of(const ExpertView& e);  // worker/expert_ffn.cpp
};

}  // namespace colibri
#endif
