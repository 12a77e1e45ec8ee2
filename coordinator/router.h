// router.h: turns router logits into (expert, weight) pairs with the model
// family's exact semantics.
#pragma once
#include <cstdint>

#include "model/config.h"

namespace colibri {

// logits: [rows][num_experts]; experts, weights: [rows][k], slot 0 = highest score.
// Mixtral: softmax over all experts in f32, top-k (ties to the lower index),
// then the k weights renormalised to sum to one.
void route(const RoutingConfig& cfg, const float* logits, int64_t rows, int64_t num_experts, int64_t k,
           int32_t* experts, float* weights);

}  // namespace colibri
