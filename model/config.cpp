// config.cpp: parsing and validation of model hyper-parameters.
#include "model/config.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "model/error.h"

namespace colibri {

using nlohmann::json;

const std::vector<std::string>& supported_architectures() {
  static const std::vector<std::string> archs = {"MixtralForCausalLM"};
  return archs;
}

namespace {

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + v[i];
  return s;
}

// NOTE: nlohmann converts a float to an integer with a plain cast (undefined
// behaviour out of range, silent truncation otherwise): integers must be integers.
template <typename T>
T get_value(const json& v, const char* key, const char* what) {
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
    if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<T>::max())))
      throw Error(Status::Format, std::string(what) + ": field '" + key + "' is not an integer in range: " +
                                  (v.is_structured() ? std::string(v.type_name()) : v.dump()));
  }
  try {
    return v.get<T>();
  } catch (const json::exception& e) {
    throw Error(Status::Format, std::string(what) + ": field '" + key + "' has the wrong type (" + e.what() + ")");
  }
}

template <typename T>
T get_required(const json& j, const char* key, const char* what) {
  if (!j.contains(key) || j[key].is_null())
    throw Error(Status::Format, std::string(what) + ": missing required field '" + key + "'");
  return get_value<T>(j[key], key, what);
}

template <typename T>
T get_or(const json& j, const char* key, T fallback, const char* what) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  return get_value<T>(j[key], key, what);
}

// eos_token_id may be an int or a list of ints in HF configs; take the first.
int64_t token_id(const json& j, const char* key) {
  if (!j.contains(key) || j[key].is_null()) return -1;
  if (j[key].is_number_integer()) return j[key].get<int64_t>();
  if (j[key].is_array() && !j[key].empty() && j[key][0].is_number_integer()) return j[key][0].get<int64_t>();
  return -1;
}

}  // namespace

ModelConfig ModelConfig::from_hf(const json& hf) {
  const char* what = "config.json";
  if (!hf.is_object()) throw Error(Status::Format, "config.json: not a JSON object");
  std::string arch;
  if (hf.contains("architectures") && hf["architectures"].is_array() && !hf["architectures"].empty() &&
      hf["architectures"][0].is_string())
    arch = hf["architectures"][0].get<std::string>();
  else
    arch = get_or<std::string>(hf, "model_type", "", what);
  const auto& sup = supported_architectures();
  if (arch == "mixtral") arch = "MixtralForCausalLM";
  if (std::find(sup.begin(), sup.end(), arch) == sup.end())
    throw Error(Status::Unsupported, "unsupported architecture '" + (arch.empty() ? std::string("(none)") : arch) +
                                         "'; supported: " + join(sup));

  ModelConfig c;
  c.architecture = "mixtral";
  c.vocab_size = get_required<int64_t>(hf, "vocab_size", what);
  c.hidden_size = get_required<int64_t>(hf, "hidden_size", what);
  c.intermediate_size = get_required<int64_t>(hf, "intermediate_size", what);
  c.num_layers = get_required<int64_t>(hf, "num_hidden_layers", what);
  c.num_heads = get_required<int64_t>(hf, "num_attention_heads", what);
  c.num_kv_heads = get_or<int64_t>(hf, "num_key_value_heads", c.num_heads, what);
  c.head_dim = get_or<int64_t>(hf, "head_dim", c.num_heads > 0 ? c.hidden_size / c.num_heads : 0, what);
  c.num_experts = get_required<int64_t>(hf, "num_local_experts", what);
  c.experts_per_token = get_required<int64_t>(hf, "num_experts_per_tok", what);
  c.max_position_embeddings = get_or<int64_t>(hf, "max_position_embeddings", 4096, what);
  c.sliding_window = get_or<int64_t>(hf, "sliding_window", 0, what);
  c.rope_theta = get_or<double>(hf, "rope_theta", 1e6, what);
  if (hf.contains("rope_parameters") && hf["rope_parameters"].is_object()) {
    const auto& rp = hf["rope_parameters"];
    c.rope_theta = get_or<double>(rp, "rope_theta", c.rope_theta, what);
    std::string type = get_or<std::string>(rp, "rope_type", "default", what);
    if (type != "default") throw Error(Status::Unsupported, "config.json: rope_type '" + type + "' is not supported for Mixtral");
  }
  if (hf.contains("rope_scaling") && !hf["rope_scaling"].is_null()) {
    std::string type = get_or<std::string>(hf["rope_scaling"], "rope_type",
                                           get_or<std::string>(hf["rope_scaling"], "type", "default", what), what);
    if (type != "default") throw Error(Status::Unsupported, "config.json: rope_scaling '" + type + "' is not supported for Mixtral");
  }
  c.rms_norm_eps = get_or<double>(hf, "rms_norm_eps", 1e-5, what);
  c.tie_word_embeddings = get_or<bool>(hf, "tie_word_embeddings", false, what);
  c.hidden_act = get_or<std::string>(hf, "hidden_act", "silu", what);
  c.bos_token_id = token_id(hf, "bos_token_id");
  c.eos_token_id = token_id(hf, "eos_token_id");
  c.routing.scoring = "softmax";
  c.routing.norm_topk_prob = true;  // Mixtral always renormalises over the k
  c.routing.routed_scaling_factor = 1.0f;
  c.validate();
  return c;
}

json ModelConfig::to_json() const {
  return json{
      {"architecture", architecture},
      {"vocab_size", vocab_size},
      {"hidden_size", hidden_size},
      {"intermediate_size", intermediate_size},
      {"num_layers", num_layers},
      {"num_heads", num_heads},
      {"num_kv_heads", num_kv_heads},
      {"head_dim", head_dim},
      {"num_experts", num_experts},
      {"experts_per_token", experts_per_token},
      {"max_position_embeddings", max_position_embeddings},
      {"sliding_window", sliding_window},
      {"rope_theta", rope_theta},
      {"rms_norm_eps", rms_norm_eps},
      {"tie_word_embeddings", tie_word_embeddings},
      {"hidden_act", hidden_act},
      {"bos_token_id", bos_token_id},
      {"eos_token_id", eos_token_id},
      {"routing",
       {{"scoring", routing.scoring},
        {"norm_topk_prob", routing.norm_topk_prob},
        {"routed_scaling_factor", routing.routed_scaling_factor}}},
  };
}

ModelConfig ModelConfig::from_json(const json& j) {
  const char* what = "model config";
  if (!j.is_object()) throw Error(Status::Format, "model config: not a JSON object");
  ModelConfig c;
  c.architecture = get_required<std::string>(j, "architecture", what);
  c.vocab_size = get_required<int64_t>(j, "vocab_size", what);
  c.hidden_size = get_required<int64_t>(j, "hidden_size", what);
  c.intermediate_size = get_required<int64_t>(j, "intermediate_size", what);
  c.num_layers = get_required<int64_t>(j, "num_layers", what);
  c.num_heads = get_required<int64_t>(j, "num_heads", what);
  c.num_kv_heads = get_required<int64_t>(j, "num_kv_heads", what);
  c.head_dim = get_required<int64_t>(j, "head_dim", what);
  c.num_experts = get_required<int64_t>(j, "num_experts", what);
  c.experts_per_token = get_required<int64_t>(j, "experts_per_token", what);
  c.max_position_embeddings = get_required<int64_t>(j, "max_position_embeddings", what);
  c.sliding_window = get_required<int64_t>(j, "sliding_window", what);
  c.rope_theta = get_required<double>(j, "rope_theta", what);
  c.rms_norm_eps = get_required<double>(j, "rms_norm_eps", what);
  c.tie_word_embeddings = get_required<bool>(j, "tie_word_embeddings", what);
  c.hidden_act = get_required<std::string>(j, "hidden_act", what);
  c.bos_token_id = get_or<int64_t>(j, "bos_token_id", -1, what);
  c.eos_token_id = get_or<int64_t>(j, "eos_token_id", -1, what);
  if (!j.contains("routing") || !j["routing"].is_object())
    throw Error(Status::Format, "model config: missing required object 'routing'");
  const auto& r = j["routing"];
  c.routing.scoring = get_required<std::string>(r, "scoring", what);
  c.routing.norm_topk_prob = get_required<bool>(r, "norm_topk_prob", what);
  c.routing.routed_scaling_factor = get_required<float>(r, "routed_scaling_factor", what);
  c.validate();
  return c;
}

void ModelConfig::validate() const {
  auto check = [](bool ok, const std::string& msg) {
    if (!ok) throw Error(Status::Format, "invalid model config: " + msg);
  };
  // NOTE: the upper bounds keep every size product far from int64 overflow and
  // reject absurd values from hostile files before anything is allocated.
  constexpr int64_t kMaxDim = 1 << 20;
  auto in_range = [&](int64_t v, int64_t lo, int64_t hi, const char* name) {
    check(v >= lo && v <= hi, std::string(name) + " = " + std::to_string(v) + " is outside [" + std::to_string(lo) +
                                   ", " + std::to_string(hi) + "]");
  };
  check(architecture == "mixtral", "architecture '" + architecture + "' is not supported (supported: mixtral)");
  in_range(vocab_size, 1, 1 << 24, "vocab_size");
  in_range(hidden_size, 1, kMaxDim, "hidden_size");
  in_range(intermediate_size, 1, kMaxDim, "intermediate_size");
  in_range(num_layers, 1, 4096, "num_layers");
  in_range(num_heads, 1, 4096, "num_heads");
  in_range(num_kv_heads, 1, num_heads, "num_kv_heads");
  check(num_heads % num_kv_heads == 0, "num_heads (" + std::to_string(num_heads) +
                                           ") is not a multiple of num_kv_heads (" + std::to_string(num_kv_heads) + ")");
  in_range(head_dim, 2, 4096, "head_dim");
  check(head_dim % 2 == 0, "head_dim must be even for rotary embeddings");
  in_range(num_experts, 1, 65536, "num_experts");
  in_range(experts_per_token, 1, num_experts, "experts_per_token");
  in_range(max_position_embeddings, 1, 1 << 24, "max_position_embeddings");
  in_range(sliding_window, 0, 1 << 30, "sliding_window");
  check(rope_theta > 0 && rope_theta < 1e30, "rope_theta must be positive");
  check(rms_norm_eps > 0 && rms_norm_eps < 1, "rms_norm_eps must be in (0, 1)");
  check(hidden_act == "silu", "hidden_act '" + hidden_act + "' is not supported (supported: silu)");
  check(std::isfinite(routing.routed_scaling_factor) && routing.routed_scaling_factor > 0,
        "routing.routed_scaling_factor must be a positive finite number");
  check(routing.scoring == "softmax", "routing.scoring '" + routing.scoring + "' is not supported");
  check(eos_token_id < vocab_size && bos_token_id < vocab_size, "bos/eos token id outside the vocabulary");
}

}  // namespace colibri
