// config.h: the model hyper-parameters the forward pass needs, parsed from a
// Hugging Face config.json and stored as JSON inside every .colibri file.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace colibri {

// How router logits become (expert, weight) pairs. Mixtral: softmax over all
// experts in f32, top-k, then renormalise the k weights to sum to one.
struct RoutingConfig {
  std::string scoring = "softmax";  // "softmax": softmax over all experts before top-k
  bool norm_topk_prob = true;       // renormalise the selected k weights to sum to 1
  float routed_scaling_factor = 1.0f;
};

struct ModelConfig {
  std::string architecture;  // "mixtral"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;  // per expert
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t num_experts = 0;
  int64_t experts_per_token = 0;
  int64_t max_position_embeddings = 0;
  int64_t sliding_window = 0;  // 0: full attention
  double rope_theta = 10000.0;
  double rms_norm_eps = 1e-5;
  bool tie_word_embeddings = false;
  std::string hidden_act = "silu";
  int64_t bos_token_id = -1;
  int64_t eos_token_id = -1;
  RoutingConfig routing;

  // Parses a Hugging Face config.json. Throws Error(Unsupported) naming the
  // supported architectures when `architectures` is not one of them.
  static ModelConfig from_hf(const nlohmann::json& hf);
  // The embedded form used in .colibri files (all fields explicit).
  static ModelConfig from_json(const nlohmann::json& j);
  nlohmann::json to_json() const;

  // Throws Error(Format) naming the first field out of range.
  void validate() const;
};

// The Hugging Face architecture names this build can convert.
const std::vector<std::string>& supported_architectures();

}  // namespace colibri
