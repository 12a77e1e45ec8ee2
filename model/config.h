// config.h: the model hyper-parameters the forward pass needs, parsed from a
// Hugging Face config.json and stored as JSON inside every .colibri file.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace colibri {

// How router logits become (expert, weight) pairs (see coordinator/router.h):
//  scoring "softmax":      p = softmax(logits) over all experts; top-k of p
//                          (Mixtral, Qwen-MoE, OLMoE, DeepSeek-V2)
//          "sigmoid":      p = sigmoid(logits); selection on p + correction bias,
//                          weights from p (DeepSeek-V3, GLM-4.5)
//          "topk_softmax": top-k of the raw logits, softmax over those k (gpt-oss)
//  group_select "max":      keep the topk_group groups with the largest max score
//                          (DeepSeek-V2 group_limited_greedy)
//               "top2_sum": ... with the largest sum of their two best scores (V3)
//  then optionally renormalise the k weights, then multiply by routed_scaling_factor.
struct RoutingConfig {
  std::string scoring = "softmax";
  std::string group_select = "none";  // none | max | top2_sum
  int64_t n_group = 1, topk_group = 1;
  bool score_bias = false;   // per-layer e_score_correction_bias (selection only)
  bool router_bias = false;  // the router's linear layer has a bias (gpt-oss)
  bool norm_topk_prob = true;
  float routed_scaling_factor = 1.0f;
};

// YaRN (the only rope scaling implemented; "none" otherwise).
struct RopeScaling {
  std::string type = "none";  // none | yarn
  double factor = 1.0;
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 32.0, beta_slow = 1.0;
  double mscale = 0.0, mscale_all_dim = 0.0;  // 0: absent
  bool truncate = true;
  double attention_factor = 1.0;  // multiplies cos and sin (derived at conversion)
};

// The checkpoint's tokenizer, when the file embeds one (the "tokenizer" record
// of the tensor directory holds its file; docs/format.md, docs/tokenizer.md).
// Optional in the embedded JSON ("tokenizer" object), written only when `kind`
// is set, so files without a tokenizer stay byte for byte as before.
struct TokenizerSpec {
  std::string kind;             // "" (none), "hf_json" (tokenizer.json) or "sentencepiece" (tokenizer.model)
  int64_t vocab_size = 0;       // ids the tokenizer produces (max id + 1), <= the model's vocab_size
  bool add_bos = true;          // tokenizer_config.json add_bos_token (SentencePiece)
  bool add_eos = false;         // tokenizer_config.json add_eos_token
  bool legacy = false;          // tokenizer_config.json legacy (SentencePiece; TokenizerOptions::legacy)
  std::vector<int64_t> eos_token_ids;  // generation ends at any of these (config + generation_config)
  // Special tokens of tokenizer_config.json's added_tokens_decoder that the
  // tokenizer file lacks, as (id, content).
  std::vector<std::pair<int64_t, std::string>> extra_special;
  // The chat template (model/chat_template.h, docs/chat_templates.md):
  // tokenizer_config.json's chat_template (the one named "default" of a list),
  // or chat_template.jinja beside it, which wins as in transformers; "" when the
  // checkpoint has none. Optional in the embedded JSON ("chat_template"),
  // written only when set.
  std::string chat_template;
  // The special tokens transformers passes to the template (its
  // special_tokens_map: bos_token, eos_token, unk_token, sep_token, pad_token,
  // cls_token, mask_token) as (name, content). Optional ("special_tokens" object).
  std::vector<std::pair<std::string, std::string>> special_tokens;
  bool present() const { return !kind.empty(); }
  // The content of special token `name` ("bos_token", ...), "" when it has none.
  std::string special_token(const std::string& name) const {
    for (const auto& [n, c] : special_tokens)
      if (n == name) return c;
    return {};
  }
};

// The special token names of TokenizerSpec::special_tokens.
const std::vector<std::string>& chat_special_token_names();
// The largest TokenizerSpec::chat_template a file holds (real ones are < 20 KB).
inline constexpr size_t kMaxChatTemplateBytes = size_t{1} << 20;

struct ModelConfig {
  // mixtral | qwen2_moe | qwen3_moe | olmoe | deepseek_v2 | deepseek_v3 | glm4_moe | gpt_oss
  std::string architecture;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;  // per routed expert
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;  // MLA: qk_nope_head_dim + qk_rope_head_dim
  int64_t num_experts = 0;
  int64_t experts_per_token = 0;
  int64_t max_position_embeddings = 0;
  int64_t sliding_window = 0;  // 0: full attention (the window of the layers in layer_windows that slide)
  double rope_theta = 10000.0;
  double rms_norm_eps = 1e-5;
  bool tie_word_embeddings = false;
  std::string hidden_act = "silu";
  int64_t bos_token_id = -1;
  int64_t eos_token_id = -1;
  RoutingConfig routing;

  // Attention.
  std::string attention = "gqa";  // gqa | mla
  bool qkv_bias = false;          // q, k, v projections have biases
  bool o_bias = false;            // the output projection has a bias
  std::string qk_norm = "none";   // none | head (per-head RMSNorm) | full (over all heads, OLMoE)
  double clip_qkv = 0;            // > 0: clamp q, k, v to [-clip, clip] (OLMoE)
  bool attn_sinks = false;        // a learned per-head logit in the softmax denominator (gpt-oss)
  std::vector<int64_t> layer_windows;  // [num_layers] sliding window per layer, 0 = full
  double attn_scale = 0;          // softmax scale (derived at conversion)
  int64_t rope_dim = 0;           // rotated dimensions per head (partial rotary; MLA: qk_rope_head_dim)
  bool rope_interleaved = false;  // rotate pairs (2i, 2i+1) instead of (i, i + d/2) (DeepSeek)
  RopeScaling rope_scaling;
  // Multi-head latent attention (DeepSeek-V2/V3).
  int64_t q_lora_rank = 0;  // 0: a plain q projection
  int64_t kv_lora_rank = 0, qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;

  // Feed-forward.
  std::vector<int64_t> moe_layers;        // the layers with routed experts (ascending); the others are dense MLPs
  int64_t dense_intermediate_size = 0;    // the dense layers' MLP
  int64_t shared_intermediate_size = 0;   // 0: no shared expert
  bool shared_expert_gate = false;        // shared output scaled by sigmoid(x . w) (Qwen2-MoE)
  std::string expert_act = "silu";        // silu: down(silu(gate) * up); swiglu_oai: gpt-oss clamped SwiGLU
  double swiglu_alpha = 1.702, swiglu_limit = 7.0;
  bool expert_bias = false;               // experts' projections have biases (gpt-oss)
  // Routed experts' matrices stored quantised (docs/quantization.md): "none"
  // (in the expert dtype), "int8" or "int4", symmetric per `group_size`
  // consecutive inputs of each output row with an f16 scale. Optional in the
  // embedded JSON ("expert_quant" object), written only when not "none".
  struct QuantSpec {
    std::string type = "none";
    int64_t group_size = 0;
  };
  QuantSpec expert_quant;
  // The same for the dense matrices the coordinator multiplies (attention
  // projections, dense and shared-expert FFNs, the LM head; not the embedding
  // table, the routers or MLA's per-head k_b/v_b: TensorSpec::quantizable).
  // Optional ("dense_quant" object), written only when not "none".
  QuantSpec dense_quant;
  // The embedded tokenizer (kind "" when the file has none).
  TokenizerSpec tokenizer;

  // Index of `layer` among the MoE layers, or -1 for a dense layer. Placement,
  // routing traces and the expert index count MoE layers by this index.
  int moe_index(int64_t layer) const;
  int64_t num_moe_layers() const { return moe_layers.empty() ? num_layers : static_cast<int64_t>(moe_layers.size()); }
  int64_t window(int64_t layer) const { return layer_windows.empty() ? sliding_window : layer_windows[static_cast<size_t>(layer)]; }
  // Fills what a hand-made (Mixtral-like) config leaves empty: every layer MoE,
  // every layer with `sliding_window`, rope over the whole head, 1/sqrt(head_dim).
  void fill_defaults();

  // Parses a Hugging Face config.json. Throws Error(Unsupported) naming the
  // field (architecture, rope type, routing method...) the engine does not implement.
  static ModelConfig from_hf(const nlohmann::json& hf);
  // The embedded form used in .colibri files (all fields explicit).
  static ModelConfig from_json(const nlohmann::json& j);
  nlohmann::json to_json() const;

  // Throws Error(Format) naming the first field out of range.
  void validate() const;
};

// The Hugging Face architecture names this build can convert.
const std::vector<std::string>& supported_architectures();

// Rotary inverse frequencies [rope_dim / 2] in f32, computed as transformers
// does (default or YaRN).
std::vector<float> rope_inv_freq(const ModelConfig& c);

}  // namespace colibri
