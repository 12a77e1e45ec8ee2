// expert_ffn.h: one expert's SwiGLU feed-forward on a group of rows:
// y = down(silu(gate(x)) * up(x)).
#pragma once
#include <cstdint>

#include "model/colibri_file.h"

namespace colibri {

// x: [rows][hidden]; y: [rows][hidden]; scratch_gate, scratch_up: [rows][intermediate].
void expert_ffn(const ExpertView& e, int64_t hidden, int64_t inter, const float* x, int64_t rows, float* y,
                float* scratch_gate, float* scratch_up);

}  // namespace colibri
