// router.h: turns router logits into (expert, weight) pairs with the model
// family's exact semantics (see RoutingConfig in model/config.h).
#pragma once
#include <cstdint>

#include "model/config.h"

namespace colibri {

// logits: [rows][num_experts] (the router bias, if any, already added);
// score_bias: [num_experts] correction added to the scores for selection only
// (DeepSeek-V3 / GLM e_score_correction_bias), or null.
// experts, weights: [rows][k], slot 0 = highest selection score; ties go to
// the lower expert index.
// The routing's scoring and group selection, parsed from the config's names;
// throws Error(Unsupported) for an unknown one.
enum class RouteScoring { Softmax = 0, Sigmoid = 1, TopkSoftmax = 2 };
enum class RouteGroups { None = 0, Max = 1, Top2Sum = 2 };
RouteScoring route_scoring(const RoutingConfig& cfg);
RouteGroups route_groups(const RoutingConfig& cfg);

// The routing resolved once at load (no names compared per call).
struct RoutePlan {
  RouteScoring scoring = RouteScoring::Softmax;
  RouteGroups groups = RouteGroups::None;
  int64_t n_group = 1, topk_group = 1;
  bool norm_topk_prob = true;
  float routed_scaling_factor = 1.0f;
  static RoutePlan of(const RoutingConfig& cfg);  // Error(Unsupported) for an unknown name
};

void route(const RoutePlan& plan, const float* logits, int64_t rows, int64_t num_experts, int64_t k,
           const float* score_bias, int32_t* experts, float* weights);
inline void route(const RoutingConfig& cfg, const float* logits, int64_t rows, int64_t num_experts, int64_t k,
                  const float* score_bias, int32_t* experts, float* weights) {
  route(RoutePlan::of(cfg), logits, rows, num_experts, k, score_bias, experts, weights);
}

}  // namespace colibri
