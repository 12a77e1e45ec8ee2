// model_plan.h: what each decoder layer computes, resolved once at load from
// the config and the tensors present in the file: enums and sizes, never the
// config's strings, so that the forward pass (coordinator/model.h) compares
// nothing by name. The plan and the weights (coordinator/layer_weights.h) are
// all the model definition and every backend need to know about a family.
#pragma once
#include <cstdint>
#include <vector>

#include "coordinator/layer_weights.h"
#include "coordinator/router.h"
#include "model/colibri_file.h"

namespace colibri {

enum class AttentionKind : uint8_t {
  Grouped,  // multi-head / grouped-query attention over cached K and V
  Latent,   // multi-head latent attention (DeepSeek): a cached latent and a shared rotary key
};
enum class QkNorm : uint8_t {
  None,
  PerHead,  // an RMSNorm over each head of q and k (Qwen3)
  Full,     // an RMSNorm over all heads of q, and of k (OLMoE)
};
enum class FeedForwardKind : uint8_t { Dense, Moe };
enum class SharedExpert : uint8_t {
  None,
  Plain,  // added to the routed experts' output (DeepSeek)
  Gated,  // times sigmoid(x . w_gate) (Qwen2-MoE)
};

struct LayerPlan {
  AttentionKind attention = AttentionKind::Grouped;
  QkNorm qk_norm = QkNorm::None;
  bool q_lora = false;  // Latent: queries through the low-rank q_a / q_b
  bool bias_q = false, bias_k = false, bias_v = false, bias_o = false;
  bool sinks = false;   // a learned per-head logit in the softmax denominator (gpt-oss)
  int64_t window = 0;   // sliding window in positions, 0: full attention
  FeedForwardKind ffn = FeedForwardKind::Dense;
  int moe = -1;  // index among the MoE layers, -1: dense
  SharedExpert shared = SharedExpert::None;
  bool router_bias = false, score_bias = false;
};

struct ModelPlan {
  int64_t hidden = 0, vocab = 0, layers = 0;
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  int64_t q_width = 0;    // heads * head_dim
  int64_t kv_width = 0;   // a cached row: Grouped: kv_heads * head_dim (K, and V alike); Latent: latent + rotary key
  int64_t v_width = 0;    // a cached V row (Grouped), 0 for Latent
  int64_t att_width = 0;  // the attention output before the output projection
  int64_t rope_dim = 0;   // rotated dimensions per head
  bool rope_interleaved = false;
  // Latent attention: latent rank, queries' low rank, per-head sizes.
  int64_t kv_lora_rank = 0, q_lora_rank = 0, nope_dim = 0, v_head_dim = 0;
  float eps = 1e-5f;
  // NOTE: transformers builds q_a_layernorm and kv_a_layernorm with the RMSNorm
  // default eps 1e-6, whatever rms_norm_eps says (DeepSeek-V2 and V3 alike).
  float latent_eps = 1e-6f;
  float attn_scale = 1.0f;
  float clip_qkv = 0.0f;  // > 0: q, k and v clamped to [-clip, clip] (OLMoE)
  int64_t experts = 0, top_k = 0;
  int64_t dense_inter = 0, shared_inter = 0;
  int64_t ffn_inter = 0;  // the widest dense or shared FFN (scratch sizes)
  RoutePlan route;
  bool any_dense = false;
  std::vector<LayerPlan> layer;

  // Throws Error(Format) naming the tensor when the file's tensors disagree
  // with each other (a q norm without its k norm, say).
  static ModelPlan of(const ColibriFile& f);
};

// The layers' dense weights as views into the file (vectors converted to f32).
std::vector<LayerWeights> load_layer_weights(const ColibriFile& f, const ModelPlan& p);

}  // namespace colibri
