// gpu_dense.h: the coordinator's dense part on one GPU (--device cuda):
// embedding, RMSNorms, attention (grouped-query or latent) over a KV cache in
// device memory, dense and shared-expert FFNs, the router and its top-k, final
// norm and LM head, all with the kernels of kernels/cuda/ (matrices as bf16
// through cuBLASLt, the router's product in f32). The routed experts go through
// the host: each MoE layer downloads its normalised rows and the router's
// choices, a hook (the engine's dispatcher: replay, trace, exchange, the local
// worker) returns the combined expert output, which is uploaded again; or,
// with device_moe, the rows stay on the GPU and the hook gets device pointers
// (the dispatcher packs, exchanges and combines them there).
// Built only with CUDA; make_gpu_dense throws Error(Unsupported) otherwise.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "coordinator/layer_weights.h"
#include "coordinator/stage_clock.h"
#include "model/colibri_file.h"

namespace colibri {

class GpuDense {
 public:
  virtual ~GpuDense() = default;
  // One MoE layer (moe_layer: its index among the MoE layers): xn [n][hidden]
  // the routed experts' input, experts/weights [n][k] the router's choices in
  // host memory (the hook may replace them), out [n][hidden] for the combined
  // output of the routed experts. stream null: xn and out are host memory;
  // else device memory, and the hook queues its work on `stream`.
  using MoeHook = std::function<void(int moe_layer, int64_t n, const float* xn, int32_t* experts, float* weights,
                                     float* out, void* stream)>;
  // Engine::forward on the GPU: the logits of the rows with want_logits[i]
  // go to `logits` (host, [rows wanted][vocab], in order).
  virtual void forward(int64_t n, const int32_t* tokens, const int32_t* seqs, const int32_t* pos,
                       const uint8_t* want_logits, float* logits, const MoeHook& moe) = 0;
  virtual uint64_t kv_cache_bytes() const = 0;
};

struct GpuDenseOptions {
  int device = 0;
  int rank = 0;  // for messages
  int64_t rows_cap = 0, max_batch = 0, max_ctx = 0;
  // The engine's rotary tables, [max_ctx][rope_dim / 2] (host).
  const float* rope_cos = nullptr;
  const float* rope_sin = nullptr;
  // The engine's stage clock (required). With sync_stages the stream is
  // synchronised at each stage boundary so that the GPU's time is charged to
  // the stage that spent it (bench); without, the GPU runs ahead and its time
  // is charged where the host waits for it (the router, before the routed
  // experts, and the LM head).
  StageClock* clock = nullptr;
  bool sync_stages = false;
  // The MoE hook takes device rows (MoeDispatcher::forward_device).
  bool device_moe = false;
};

// Uploads the dense weights (matrices as bf16; norms, biases, the router and
// the embedding table as stored) and allocates the KV cache and activations.
// Throws Error(Unsupported) without CUDA, without that GPU or for quantised
// dense matrices, Error(OutOfMemory) with the sizes when they do not fit.
std::unique_ptr<GpuDense> make_gpu_dense(std::shared_ptr<const ColibriFile> file, const std::vector<LayerWeights>& layers,
                                         const std::vector<float>& final_norm, const GpuDenseOptions& opts);

}  // namespace colibri
