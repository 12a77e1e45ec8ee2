// layer_weights.h: one decoder layer's dense weights as the coordinator reads
// them from a .colibri file: matrices as views into the mapped file, vectors
// (norms, biases, sinks) converted to f32. The CPU forward pass computes from
// them and the GPU one (coordinator/backend_cuda.cpp) uploads them.
#pragma once
#include <cstdint>
#include <vector>

#include "model/colibri_file.h"
#include "model/ffn.h"

namespace colibri {

struct LayerWeights {
  std::vector<float> attn_norm, ffn_norm;
  int64_t window = 0;
  // Grouped-query attention.
  const TensorView *wq = nullptr, *wk = nullptr, *wv = nullptr, *wo = nullptr;
  std::vector<float> bq, bk, bv, bo, q_norm, k_norm, sinks;
  // Multi-head latent attention.
  const TensorView *wq_a = nullptr, *wq_b = nullptr, *wkv_a = nullptr, *wk_b = nullptr, *wv_b = nullptr;
  std::vector<float> q_a_norm, kv_a_norm;
  // Feed-forward: a dense MLP, or routed experts (+ shared expert).
  int moe = -1;  // index among the MoE layers, -1: dense
  const TensorView* router = nullptr;
  std::vector<float> router_bias, score_bias, shared_gate;
  FfnWeights dense, shared;
};

}  // namespace colibri
