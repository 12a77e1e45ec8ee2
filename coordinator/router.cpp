// router.cpp: softmax top-k routing.
#include "coordinator/router.h"

#include <cmath>
#include <vector>

#include "model/error.h"

namespace colibri {

void route(const RoutingConfig& cfg, const float* logits, int64_t rows, int64_t num_experts, int64_t k,
           int32_t* experts, float* weights) {
  if (cfg.scoring != "softmax") throw Error(Status::Unsupported, "routing scoring '" + cfg.scoring + "'");
  // NOTE: at most a few hundred experts; a fixed-size stack buffer would cap
  // that, so the scratch lives on the stack up to 1024 and falls back above.
  float stack[1024];
  std::vector<float> heap;
  float* p = stack;
  if (num_experts > 1024) {
    heap.resize(static_cast<size_t>(num_experts));
    p = heap.data();
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* l = logits + r * num_experts;
    float mx = l[0];
    for (int64_t e = 1; e < num_experts; ++e) mx = std::max(mx, l[e]);
    float sum = 0.f;
    for (int64_t e = 0; e < num_experts; ++e) sum += (p[e] = std::exp(l[e] - mx));
    for (int64_t e = 0; e < num_experts; ++e) p[e] /= sum;
    int32_t* ex = experts + r * k;
    float* w = weights + r * k;
    // Selection of the k largest, stable on ties (lower index first).
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < num_experts; ++e) {
        bool taken = false;
        for (int64_t i = 0; i < j; ++i) taken |= (ex[i] == e);
        if (!taken && (best < 0 || p[e] > p[best])) best = e;
      }
      ex[j] = static_cast<int32_t>(best);
      w[j] = p[best];
    }
    if (cfg.norm_topk_prob) {
      float s = 0.f;
      for (int64_t j = 0; j < k; ++j) s += w[j];
      for (int64_t j = 0; j < k; ++j) w[j] /= s;
    }
    if (cfg.routed_scaling_factor != 1.0f)
      for (int64_t j = 0; j < k; ++j) w[j] *= cfg.routed_scaling_factor;
  }
}

}  // namespace colibri
