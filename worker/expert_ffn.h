// expert_ffn.h: a gated feed-forward block (an expert, a shared expert or a
// dense MLP) on a group of rows on the CPU; the shapes and activations are
// model/ffn.h's.
#pragma once
#include <cstdint>

#include "model/colibri_file.h"
#include "model/config.h"
#include "model/ffn.h"

namespace colibri {

// x: [rows][hidden]; y: [rows][hidden]; scratch_gate, scratch_up: [rows][inter].
void ffn(const FfnWeights& w, const FfnShape& s, const float* x, int64_t rows, float* y, float* scratch_gate,
         float* scratch_up);

inline void expert_ffn(const ExpertView& e, const FfnShape& s, const float* x, int64_t rows, float* y, float* g, float* u) {
  ffn(FfnWeights::of(e), s, x, rows, y, g, u);
}

}  // namespace colibri
