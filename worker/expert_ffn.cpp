// expert_ffn.cpp: grouped SwiGLU expert FFN on the CPU kernels.
#include "worker/expert_ffn.h"

#include "kernels/cpu/kernels.h"

namespace colibri {

void expert_ffn(const ExpertView& e, int64_t hidden, int64_t inter, const float* x, int64_t rows, float* y,
                float* g, float* u) {
  kernels::gemm(x, hidden, rows, e.gate, e.dtype, hidden, inter, g, inter);
  kernels::gemm(x, hidden, rows, e.up, e.dtype, hidden, inter, u, inter);
  const auto& k = kernels::active();
  for (int64_t r = 0; r < rows; ++r) k.silu_mul(g + r * inter, u + r * inter, inter);
  kernels::gemm(g, inter, rows, e.down, e.dtype, inter, hidden, y, hidden);
}

}  // namespace colibri
