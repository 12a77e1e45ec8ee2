// model.h: the model definition: one decoder forward pass of every supported
// family, written once in the operations of coordinator/backend.h and run by
// the CPU and the CUDA backend alike. What differs between families is in the
// plan (coordinator/model_plan.h), resolved at load; what differs between
// backends is in the backends.
#pragma once
#include <cstdint>

#include "coordinator/backend.h"
#include "coordinator/model_plan.h"

namespace colibri {

// What the forward pass asks of the engine that runs it.
class ForwardHost {
 public:
  virtual ~ForwardHost() = default;
  // The routed experts of MoE layer `moe` (its index among the MoE layers) on
  // io.xn: the router's choices replayed or traced as asked, the rows
  // exchanged, the combined output written to io.out.
  virtual void routed(int moe, int64_t rows, const MoeIo& io) = 0;
  // --check-numerics: rows [0, rows) of x (host memory, `width` wide) after
  // `stage` of `layer` (-1: before the first) are finite; with normed_next
  // (the residual stream) within what the next RMSNorm can square.
  virtual void check(const char* stage, int layer, const float* x, int64_t width, bool normed_next) = 0;
};

// One forward pass of the rows given to backend.begin(): the logits of the
// rows that want them into `logits` (host, [wanted][vocab], in row order).
// With checks, every stage's output goes through host.check (CPU backend).
void forward_pass(const ModelPlan& plan, DenseBackend& backend, ForwardHost& host, int64_t rows, bool checks,
                  float* logits);

}  // namespace colibri
