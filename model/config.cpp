// config.cpp: parsing and validation of model hyper-parameters.
#include "model/config.h"
#include "model/ffn.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "model/error.h"

namespace colibri {

using nlohmann::json;

const std::vector<std::string>& supported_architectures() {
  static const std::vector<std::string> archs = {"MixtralForCausalLM",    "Qwen2MoeForCausalLM",   "Qwen3MoeForCausalLM",
                                                 "OlmoeForCausalLM",      "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
                                                 "Glm4MoeForCausalLM",    "GptOssForCausalLM"};
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


namespace {

const char* kWhat = "config.json";

[[noreturn]] void unsupported(const std::string& arch, const std::string& msg) {
  throw Error(Status::Unsupported, "config.json (" + arch + "): " + msg);
}

// The Hugging Face architecture name -> our family name.
std::string family_of(const std::string& hf_arch) {
  static const std::pair<const char*, const char*> map[] = {
      {"MixtralForCausalLM", "mixtral"},         {"Qwen2MoeForCausalLM", "qwen2_moe"},
      {"Qwen3MoeForCausalLM", "qwen3_moe"},      {"OlmoeForCausalLM", "olmoe"},
      {"DeepseekV2ForCausalLM", "deepseek_v2"},  {"DeepseekV3ForCausalLM", "deepseek_v3"},
      {"Glm4MoeForCausalLM", "glm4_moe"},        {"GptOssForCausalLM", "gpt_oss"},
  };
  for (const auto& [a, f] : map)
    if (hf_arch == a || hf_arch == f) return f;
  return "";
}

const std::vector<std::string>& families() {
  static const std::vector<std::string> f = {"mixtral",     "qwen2_moe",   "qwen3_moe", "olmoe",
                                             "deepseek_v2", "deepseek_v3", "glm4_moe",  "gpt_oss"};
  return f;
}

double yarn_get_mscale(double scale, double mscale) { return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0; }

// rope_parameters (transformers 5) merged over rope_scaling (older configs).
json rope_params(const json& hf) {
  json rp = json::object();
  if (hf.contains("rope_scaling") && hf["rope_scaling"].is_object()) rp = hf["rope_scaling"];
  if (hf.contains("rope_parameters") && hf["rope_parameters"].is_object())
    for (auto it = hf["rope_parameters"].begin(); it != hf["rope_parameters"].end(); ++it) rp[it.key()] = it.value();
  return rp;
}

int64_t first_present(const json& hf, std::initializer_list<const char*> keys, const char* what) {
  for (const char* k : keys)
    if (hf.contains(k) && !hf[k].is_null()) return get_value<int64_t>(hf[k], k, what);
  throw Error(Status::Format, std::string(what) + ": missing required field '" + *keys.begin() + "'");
}

}  // namespace

void ModelConfig::fill_defaults() {
  if (layer_windows.empty() && num_layers > 0 && num_layers <= 4096)
    layer_windows.assign(static_cast<size_t>(num_layers), sliding_window);
  if (moe_layers.empty() && num_layers > 0 && num_layers <= 4096)
    for (int64_t l = 0; l < num_layers; ++l) moe_layers.push_back(l);
  if (rope_dim == 0) rope_dim = head_dim;
  if (attn_scale == 0 && head_dim > 0) attn_scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
}

int ModelConfig::moe_index(int64_t layer) const {
  if (moe_layers.empty()) return layer >= 0 && layer < num_layers ? static_cast<int>(layer) : -1;
  auto it = std::lower_bound(moe_layers.begin(), moe_layers.end(), layer);
  return it != moe_layers.end() && *it == layer ? static_cast<int>(it - moe_layers.begin()) : -1;
}

ModelConfig ModelConfig::from_hf(const json& hf) {
  const char* what = kWhat;
  if (!hf.is_object()) throw Error(Status::Format, "config.json: not a JSON object");
  std::string arch;
  if (hf.contains("architectures") && hf["architectures"].is_array() && !hf["architectures"].empty() &&
      hf["architectures"][0].is_string())
    arch = hf["architectures"][0].get<std::string>();
  else
    arch = get_or<std::string>(hf, "model_type", "", what);
  const std::string fam = family_of(arch);
  if (fam.empty())
    throw Error(Status::Unsupported, "config.json: field 'architectures': unsupported architecture '" +
                                         (arch.empty() ? std::string("(none)") : arch) +
                                         "'; supported: " + join(supported_architectures()));
  const bool mixtral = fam == "mixtral", qwen2 = fam == "qwen2_moe", qwen3 = fam == "qwen3_moe", olmoe = fam == "olmoe",
             dsv2 = fam == "deepseek_v2", dsv3 = fam == "deepseek_v3", glm = fam == "glm4_moe", oss = fam == "gpt_oss";
  const bool deepseek = dsv2 || dsv3;

  ModelConfig c;
  c.architecture = fam;
  c.vocab_size = get_required<int64_t>(hf, "vocab_size", what);
  c.hidden_size = get_required<int64_t>(hf, "hidden_size", what);
  c.num_layers = get_required<int64_t>(hf, "num_hidden_layers", what);
  // NOTE: checked now, not only in validate(): the layer pattern below loops over the
  // layers (a hostile 6e17 would spin for hours; the fuzzer found it).
  if (c.num_layers < 1 || c.num_layers > 4096)
    throw Error(Status::Format, "config.json: field 'num_hidden_layers' = " + std::to_string(c.num_layers) +
                                    " is outside [1, 4096]");
  c.num_heads = get_required<int64_t>(hf, "num_attention_heads", what);
  c.num_kv_heads = get_or<int64_t>(hf, "num_key_value_heads", c.num_heads, what);
  c.head_dim = get_or<int64_t>(hf, "head_dim", c.num_heads > 0 ? c.hidden_size / c.num_heads : 0, what);
  c.max_position_embeddings = get_or<int64_t>(hf, "max_position_embeddings", 4096, what);
  // NOTE: absent keys take the defaults of the family's transformers config class.
  const bool eps5 = mixtral || olmoe || glm || oss;
  c.rms_norm_eps = get_or<double>(hf, "rms_norm_eps", eps5 ? 1e-5 : 1e-6, what);
  c.tie_word_embeddings = get_or<bool>(hf, "tie_word_embeddings", false, what);
  c.hidden_act = get_or<std::string>(hf, "hidden_act", "silu", what);
  c.bos_token_id = token_id(hf, "bos_token_id");
  c.eos_token_id = token_id(hf, "eos_token_id");
  if (c.eos_token_id >= c.vocab_size) c.eos_token_id = -1;  // NOTE: HF defaults may name ids outside a tiny vocabulary
  if (c.bos_token_id >= c.vocab_size) c.bos_token_id = -1;
  if (c.hidden_act != "silu") unsupported(fam, "field 'hidden_act': '" + c.hidden_act + "' is not supported (supported: silu)");
  if (hf.contains("quantization_config") && hf["quantization_config"].is_object()) {
    std::string q = get_or<std::string>(hf["quantization_config"], "quant_method", "", what);
    if (!(oss && q == "mxfp4"))
      unsupported(fam, "field 'quantization_config.quant_method': '" + q +
                           "' checkpoints are not supported (only gpt-oss MXFP4 experts are read)");
  }

  // Experts and the dense/MoE layer pattern.
  c.num_experts = first_present(hf, {"num_local_experts", "num_experts", "n_routed_experts"}, what);
  if (deepseek || glm) c.num_experts = first_present(hf, {"n_routed_experts", "num_local_experts"}, what);
  c.experts_per_token = get_required<int64_t>(hf, "num_experts_per_tok", what);
  const int64_t inter = get_or<int64_t>(hf, "intermediate_size", 0, what);
  if (mixtral || olmoe || oss) {
    c.intermediate_size = get_required<int64_t>(hf, "intermediate_size", what);
  } else {
    c.intermediate_size = get_required<int64_t>(hf, "moe_intermediate_size", what);
    c.dense_intermediate_size = inter;
  }
  for (int64_t l = 0; l < c.num_layers; ++l) {
    bool moe = true;
    if (qwen2 || qwen3) {
      const int64_t step = get_or<int64_t>(hf, "decoder_sparse_step", 1, what);
      if (step < 1) throw Error(Status::Format, "config.json: field 'decoder_sparse_step' must be >= 1");
      bool only = false;
      if (hf.contains("mlp_only_layers") && hf["mlp_only_layers"].is_array())
        for (const auto& v : hf["mlp_only_layers"]) only |= v.is_number_integer() && v.get<int64_t>() == l;
      moe = !only && c.num_experts > 0 && (l + 1) % step == 0;
    } else if (deepseek || glm) {
      moe = l >= get_or<int64_t>(hf, "first_k_dense_replace", dsv3 ? 3 : glm ? 1 : 0, what);
      if (get_or<int64_t>(hf, "moe_layer_freq", 1, what) != 1)
        unsupported(fam, "field 'moe_layer_freq' other than 1 is not supported");
    }
    if (moe) c.moe_layers.push_back(l);
  }
  if (c.moe_layers.size() < static_cast<size_t>(c.num_layers) && c.dense_intermediate_size <= 0)
    throw Error(Status::Format, "config.json: field 'intermediate_size' (the dense layers' MLP) is missing");
  if (qwen2) {
    c.shared_intermediate_size = get_or<int64_t>(hf, "shared_expert_intermediate_size", 5632, what);
    c.shared_expert_gate = c.shared_intermediate_size > 0;
  }
  if (deepseek || glm)
    c.shared_intermediate_size = get_or<int64_t>(hf, "n_shared_experts", dsv2 ? 2 : 1, what) * c.intermediate_size;
  if (dsv2 && get_or<bool>(hf, "mlp_bias", false, what)) unsupported(fam, "field 'mlp_bias': true is not supported");

  // Routing.
  RoutingConfig& r = c.routing;
  if (mixtral) {
    r.norm_topk_prob = true;  // Mixtral always renormalises over the k
  } else if (qwen2 || qwen3 || olmoe) {
    r.norm_topk_prob = get_or<bool>(hf, "norm_topk_prob", false, what);
  } else if (dsv2) {
    // NOTE: transformers' DeepseekV2TopkRouter ignores norm_topk_prob; so do we.
    r.norm_topk_prob = false;
    r.routed_scaling_factor = get_or<float>(hf, "routed_scaling_factor", 1.0f, what);
    const std::string m = get_or<std::string>(hf, "topk_method", "greedy", what);
    if (m == "group_limited_greedy") {
      r.group_select = "max";
      r.n_group = get_required<int64_t>(hf, "n_group", what);
      r.topk_group = get_required<int64_t>(hf, "topk_group", what);
    } else if (m != "greedy") {
      unsupported(fam, "field 'topk_method': '" + m + "' is not supported (supported: greedy, group_limited_greedy)");
    }
  } else if (dsv3 || glm) {
    r.scoring = "sigmoid";
    r.group_select = "top2_sum";
    r.score_bias = true;
    r.n_group = get_or<int64_t>(hf, "n_group", dsv3 ? 8 : 1, what);
    r.topk_group = get_or<int64_t>(hf, "topk_group", dsv3 ? 4 : 1, what);
    r.norm_topk_prob = get_or<bool>(hf, "norm_topk_prob", true, what);
    r.routed_scaling_factor = get_or<float>(hf, "routed_scaling_factor", dsv3 ? 2.5f : 1.0f, what);
    if (dsv3 && hf.contains("topk_method") && get_or<std::string>(hf, "topk_method", "noaux_tc", what) != "noaux_tc")
      unsupported(fam, "field 'topk_method': '" + hf["topk_method"].get<std::string>() + "' (supported: noaux_tc)");
    if (hf.contains("scoring_func") && get_or<std::string>(hf, "scoring_func", "sigmoid", what) != "sigmoid")
      unsupported(fam, "field 'scoring_func': '" + hf["scoring_func"].get<std::string>() + "' (supported: sigmoid)");
  } else if (oss) {
    r.scoring = "topk_softmax";
    r.router_bias = true;
    r.norm_topk_prob = false;  // the softmax over the k sums to one already
  }

  // Attention.
  if (qwen2) c.qkv_bias = get_or<bool>(hf, "qkv_bias", true, what);
  if (qwen3 || olmoe || oss) c.qkv_bias = c.o_bias = get_or<bool>(hf, "attention_bias", oss, what);
  if (glm) c.qkv_bias = get_or<bool>(hf, "attention_bias", false, what);
  if (deepseek && get_or<bool>(hf, "attention_bias", false, what))
    unsupported(fam, "field 'attention_bias': true is not supported for multi-head latent attention");
  if (qwen3 || (glm && get_or<bool>(hf, "use_qk_norm", false, what))) c.qk_norm = "head";
  if (olmoe) {
    c.qk_norm = "full";
    c.clip_qkv = get_or<double>(hf, "clip_qkv", 0.0, what);
    if (c.clip_qkv < 0) throw Error(Status::Format, "config.json: field 'clip_qkv' must be positive");
  }
  c.attn_sinks = oss;
  if (deepseek) {
    c.attention = "mla";
    c.q_lora_rank = get_or<int64_t>(hf, "q_lora_rank", 0, what);
    c.kv_lora_rank = get_required<int64_t>(hf, "kv_lora_rank", what);
    c.qk_nope_head_dim = get_required<int64_t>(hf, "qk_nope_head_dim", what);
    c.qk_rope_head_dim = get_required<int64_t>(hf, "qk_rope_head_dim", what);
    c.v_head_dim = get_required<int64_t>(hf, "v_head_dim", what);
    c.head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim;
    c.num_kv_heads = c.num_heads;  // the latent is shared; every head has its own K and V
    c.rope_dim = c.qk_rope_head_dim;
    c.rope_interleaved = dsv2 || get_or<bool>(hf, "rope_interleave", true, what);
  }

  // Sliding windows per layer.
  {
    int64_t win = 0;
    std::vector<bool> sliding(static_cast<size_t>(c.num_layers), false);
    if (mixtral) {
      win = get_or<int64_t>(hf, "sliding_window", 0, what);
      sliding.assign(sliding.size(), win > 0);
    } else if (qwen3) {
      win = get_or<bool>(hf, "use_sliding_window", false, what) ? get_or<int64_t>(hf, "sliding_window", 0, what) : 0;
      sliding.assign(sliding.size(), win > 0);
    } else if (qwen2 || oss) {
      const bool use = oss || get_or<bool>(hf, "use_sliding_window", false, what);
      win = use ? get_or<int64_t>(hf, "sliding_window", 0, what) : 0;
      if (hf.contains("layer_types") && hf["layer_types"].is_array()) {
        if (hf["layer_types"].size() != static_cast<size_t>(c.num_layers))
          throw Error(Status::Format, "config.json: field 'layer_types' has " + std::to_string(hf["layer_types"].size()) +
                                          " entries for " + std::to_string(c.num_layers) + " layers");
        for (size_t l = 0; l < sliding.size(); ++l) {
          const json& t = hf["layer_types"][l];
          std::string s = t.is_string() ? t.get<std::string>() : "";
          if (s != "sliding_attention" && s != "full_attention")
            unsupported(fam, "field 'layer_types': '" + (t.is_string() ? s : t.dump()) + "' is not supported");
          sliding[l] = s == "sliding_attention";
        }
      } else {
        const int64_t max_window_layers = get_or<int64_t>(hf, "max_window_layers", c.num_layers, what);
        for (int64_t l = 0; l < c.num_layers; ++l)
          sliding[static_cast<size_t>(l)] = oss ? (l + 1) % 2 == 1 : (use && (l + 1) % 2 == 1 && l < max_window_layers);
      }
      for (size_t l = 0; l < sliding.size(); ++l)
        if (sliding[l] && win <= 0)
          throw Error(Status::Format, "config.json: layer " + std::to_string(l) +
                                          " slides but field 'sliding_window' is not a positive number");
    } else if (hf.contains("sliding_window") && !hf["sliding_window"].is_null() &&
               get_or<int64_t>(hf, "sliding_window", 0, what) > 0 && get_or<bool>(hf, "use_sliding_window", false, what)) {
      unsupported(fam, "field 'sliding_window' is not supported for this family");
    }
    c.sliding_window = win;
    c.layer_windows.assign(static_cast<size_t>(c.num_layers), 0);
    for (size_t l = 0; l < sliding.size(); ++l) c.layer_windows[l] = sliding[l] ? win : 0;
  }

  // Rotary embedding.
  json rp = rope_params(hf);
  if (oss && rp.empty())  // GptOssConfig's default rope_parameters
    rp = json{{"rope_type", "yarn"}, {"factor", 32.0}, {"beta_fast", 32.0}, {"beta_slow", 1.0}, {"truncate", false},
              {"original_max_position_embeddings", 4096}};
  const double default_theta = mixtral ? 1e6 : oss ? 150000.0 : 10000.0;
  c.rope_theta = get_or<double>(rp, "rope_theta", get_or<double>(hf, "rope_theta", default_theta, what), what);
  if (!c.rope_dim) {
    const double partial = get_or<double>(rp, "partial_rotary_factor",
                                          get_or<double>(hf, "partial_rotary_factor", glm ? 0.5 : 1.0, what), what);
    if (!(partial > 0 && partial <= 1)) throw Error(Status::Format, "config.json: field 'partial_rotary_factor' must be in (0, 1]");
    c.rope_dim = static_cast<int64_t>(static_cast<double>(c.head_dim) * partial);
  }
  // NOTE: the type may sit in rope_scaling ("type" or "rope_type", older
  // configs) and in rope_parameters (transformers 5); they must not disagree.
  auto type_of = [&](const char* key) -> std::string {
    if (!hf.contains(key) || !hf[key].is_object()) return "default";
    const json& o = hf[key];
    return get_or<std::string>(o, "rope_type", get_or<std::string>(o, "type", "default", what), what);
  };
  const std::string t_scaling = type_of("rope_scaling"), t_params = type_of("rope_parameters");
  if (t_scaling != "default" && t_params != "default" && t_scaling != t_params)
    throw Error(Status::Format, "config.json: fields 'rope_scaling.type' ('" + t_scaling +
                                    "') and 'rope_parameters.rope_type' ('" + t_params + "') disagree");
  std::string rope_type = t_scaling != "default" ? t_scaling : t_params;
  if (rope_type == "default" && rp.contains("rope_type") && rp["rope_type"].is_string())
    rope_type = rp["rope_type"].get<std::string>();  // gpt-oss's default YaRN
  if (rope_type == "yarn") {
    RopeScaling& y = c.rope_scaling;
    y.type = "yarn";
    y.original_max_position_embeddings =
        get_or<int64_t>(rp, "original_max_position_embeddings", c.max_position_embeddings, what);
    y.factor = get_or<double>(rp, "factor", 0.0, what);
    if (y.factor == 0.0 && y.original_max_position_embeddings > 0)
      y.factor = static_cast<double>(c.max_position_embeddings) / static_cast<double>(y.original_max_position_embeddings);
    y.beta_fast = get_or<double>(rp, "beta_fast", 32.0, what);
    y.beta_slow = get_or<double>(rp, "beta_slow", 1.0, what);
    if (y.beta_fast == 0) y.beta_fast = 32.0;  // NOTE: transformers: `get("beta_fast") or 32`
    if (y.beta_slow == 0) y.beta_slow = 1.0;
    y.mscale = get_or<double>(rp, "mscale", 0.0, what);
    y.mscale_all_dim = get_or<double>(rp, "mscale_all_dim", 0.0, what);
    y.truncate = get_or<bool>(rp, "truncate", true, what);
    if (!(y.factor > 0 && std::isfinite(y.factor)))
      throw Error(Status::Format, "config.json: field 'rope_parameters.factor' must be a positive number");
    if (rp.contains("attention_factor") && !rp["attention_factor"].is_null())
      y.attention_factor = get_value<double>(rp["attention_factor"], "attention_factor", what);
    else if (y.mscale != 0 && y.mscale_all_dim != 0)
      y.attention_factor = yarn_get_mscale(y.factor, y.mscale) / yarn_get_mscale(y.factor, y.mscale_all_dim);
    else
      y.attention_factor = yarn_get_mscale(y.factor, 1.0);
  } else if (rope_type != "default") {
    unsupported(fam, "field 'rope_parameters.rope_type' (or 'rope_scaling.type'): '" + rope_type +
                         "' is not supported (supported: default, yarn)");
  }
  // Softmax scale: 1/sqrt(d); MLA also multiplies by YaRN's mscale(all_dim)^2.
  c.attn_scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  if (deepseek && c.rope_scaling.type != "none" && c.rope_scaling.mscale_all_dim != 0) {
    const double m = yarn_get_mscale(c.rope_scaling.factor, c.rope_scaling.mscale_all_dim);
    c.attn_scale *= m * m;
  }
  if (oss) {
    c.expert_act = "swiglu_oai";
    c.expert_bias = true;
    c.swiglu_alpha = get_or<double>(hf, "swiglu_alpha", 1.702, what);
    c.swiglu_limit = get_or<double>(hf, "swiglu_limit", 7.0, what);
  }
  c.fill_defaults();
  c.validate();
  return c;
}

json ModelConfig::to_json() const {
  json j{
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
        {"group_select", routing.group_select},
        {"n_group", routing.n_group},
        {"topk_group", routing.topk_group},
        {"score_bias", routing.score_bias},
        {"router_bias", routing.router_bias},
        {"norm_topk_prob", routing.norm_topk_prob},
        {"routed_scaling_factor", routing.routed_scaling_factor}}},
      {"attention", attention},
      {"qkv_bias", qkv_bias},
      {"o_bias", o_bias},
      {"qk_norm", qk_norm},
      {"clip_qkv", clip_qkv},
      {"attn_sinks", attn_sinks},
      {"layer_windows", layer_windows},
      {"attn_scale", attn_scale},
      {"rope_dim", rope_dim},
      {"rope_interleaved", rope_interleaved},
      {"rope_scaling",
       {{"type", rope_scaling.type},
        {"factor", rope_scaling.factor},
        {"original_max_position_embeddings", rope_scaling.original_max_position_embeddings},
        {"beta_fast", rope_scaling.beta_fast},
        {"beta_slow", rope_scaling.beta_slow},
        {"mscale", rope_scaling.mscale},
        {"mscale_all_dim", rope_scaling.mscale_all_dim},
        {"truncate", rope_scaling.truncate},
        {"attention_factor", rope_scaling.attention_factor}}},
      {"q_lora_rank", q_lora_rank},
      {"kv_lora_rank", kv_lora_rank},
      {"qk_nope_head_dim", qk_nope_head_dim},
      {"qk_rope_head_dim", qk_rope_head_dim},
      {"v_head_dim", v_head_dim},
      {"moe_layers", moe_layers},
      {"dense_intermediate_size", dense_intermediate_size},
      {"shared_intermediate_size", shared_intermediate_size},
      {"shared_expert_gate", shared_expert_gate},
      {"expert_act", expert_act},
      {"swiglu_alpha", swiglu_alpha},
      {"swiglu_limit", swiglu_limit},
      {"expert_bias", expert_bias},
  };
  // NOTE: optional, and absent for unquantised files, so they stay byte for byte as before.
  if (expert_quant.type != "none")
    j["expert_quant"] = json{{"type", expert_quant.type}, {"group_size", expert_quant.group_size}};
  if (dense_quant.type != "none")
    j["dense_quant"] = json{{"type", dense_quant.type}, {"group_size", dense_quant.group_size}};
  if (tokenizer.present()) {
    json extra = json::array();
    for (const auto& [id, content] : tokenizer.extra_special) extra.push_back(json{{"id", id}, {"content", content}});
    j["tokenizer"] = json{{"kind", tokenizer.kind},
                          {"vocab_size", tokenizer.vocab_size},
                          {"add_bos", tokenizer.add_bos},
                          {"add_eos", tokenizer.add_eos},
                          {"legacy", tokenizer.legacy},
                          {"eos_token_ids", tokenizer.eos_token_ids},
                          {"extra_special", extra}};
    // NOTE: optional, so files without a chat template stay byte for byte as before.
    if (!tokenizer.chat_template.empty()) j["tokenizer"]["chat_template"] = tokenizer.chat_template;
    if (!tokenizer.special_tokens.empty()) {
      json st = json::object();
      for (const auto& [name, content] : tokenizer.special_tokens) st[name] = content;
      j["tokenizer"]["special_tokens"] = st;
    }
  }
  return j;
}

namespace {
std::vector<int64_t> get_int_list(const json& j, const char* key, const char* what, size_t max_len) {
  if (!j.contains(key) || !j[key].is_array())
    throw Error(Status::Format, std::string(what) + ": missing required array '" + key + "'");
  const json& a = j[key];
  if (a.size() > max_len)
    throw Error(Status::Format, std::string(what) + ": '" + key + "' has " + std::to_string(a.size()) + " entries, more than " +
                                    std::to_string(max_len));
  std::vector<int64_t> v;
  v.reserve(a.size());
  for (const auto& x : a) v.push_back(get_value<int64_t>(x, key, what));
  return v;
}
}  // namespace

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
  // NOTE: the fields below came with the families beyond Mixtral; files written
  // before them (all Mixtral) omit them and get Mixtral's values.
  c.routing.group_select = get_or<std::string>(r, "group_select", "none", what);
  c.routing.n_group = get_or<int64_t>(r, "n_group", 1, what);
  c.routing.topk_group = get_or<int64_t>(r, "topk_group", 1, what);
  c.routing.score_bias = get_or<bool>(r, "score_bias", false, what);
  c.routing.router_bias = get_or<bool>(r, "router_bias", false, what);
  c.routing.norm_topk_prob = get_required<bool>(r, "norm_topk_prob", what);
  c.routing.routed_scaling_factor = get_required<float>(r, "routed_scaling_factor", what);
  c.attention = get_or<std::string>(j, "attention", "gqa", what);
  c.qkv_bias = get_or<bool>(j, "qkv_bias", false, what);
  c.o_bias = get_or<bool>(j, "o_bias", false, what);
  c.qk_norm = get_or<std::string>(j, "qk_norm", "none", what);
  c.clip_qkv = get_or<double>(j, "clip_qkv", 0.0, what);
  c.attn_sinks = get_or<bool>(j, "attn_sinks", false, what);
  c.attn_scale = get_or<double>(j, "attn_scale", 0.0, what);
  c.rope_dim = get_or<int64_t>(j, "rope_dim", 0, what);
  c.rope_interleaved = get_or<bool>(j, "rope_interleaved", false, what);
  if (j.contains("rope_scaling")) {
    if (!j["rope_scaling"].is_object()) throw Error(Status::Format, "model config: 'rope_scaling' is not an object");
    const auto& y = j["rope_scaling"];
    c.rope_scaling.type = get_required<std::string>(y, "type", what);
    c.rope_scaling.factor = get_required<double>(y, "factor", what);
    c.rope_scaling.original_max_position_embeddings = get_required<int64_t>(y, "original_max_position_embeddings", what);
    c.rope_scaling.beta_fast = get_required<double>(y, "beta_fast", what);
    c.rope_scaling.beta_slow = get_required<double>(y, "beta_slow", what);
    c.rope_scaling.mscale = get_required<double>(y, "mscale", what);
    c.rope_scaling.mscale_all_dim = get_required<double>(y, "mscale_all_dim", what);
    c.rope_scaling.truncate = get_required<bool>(y, "truncate", what);
    c.rope_scaling.attention_factor = get_required<double>(y, "attention_factor", what);
  }
  c.q_lora_rank = get_or<int64_t>(j, "q_lora_rank", 0, what);
  c.kv_lora_rank = get_or<int64_t>(j, "kv_lora_rank", 0, what);
  c.qk_nope_head_dim = get_or<int64_t>(j, "qk_nope_head_dim", 0, what);
  c.qk_rope_head_dim = get_or<int64_t>(j, "qk_rope_head_dim", 0, what);
  c.v_head_dim = get_or<int64_t>(j, "v_head_dim", 0, what);
  c.dense_intermediate_size = get_or<int64_t>(j, "dense_intermediate_size", 0, what);
  c.shared_intermediate_size = get_or<int64_t>(j, "shared_intermediate_size", 0, what);
  c.shared_expert_gate = get_or<bool>(j, "shared_expert_gate", false, what);
  c.expert_act = get_or<std::string>(j, "expert_act", "silu", what);
  c.swiglu_alpha = get_or<double>(j, "swiglu_alpha", 1.702, what);
  c.swiglu_limit = get_or<double>(j, "swiglu_limit", 7.0, what);
  c.expert_bias = get_or<bool>(j, "expert_bias", false, what);
  for (auto [key, spec] : {std::pair{"expert_quant", &c.expert_quant}, std::pair{"dense_quant", &c.dense_quant}}) {
    if (!j.contains(key)) continue;
    if (!j[key].is_object()) throw Error(Status::Format, std::string("model config: '") + key + "' is not an object");
    const auto& q = j[key];
    spec->type = get_required<std::string>(q, "type", what);
    spec->group_size = get_required<int64_t>(q, "group_size", what);
  }
  if (j.contains("tokenizer")) {
    if (!j["tokenizer"].is_object()) throw Error(Status::Format, "model config: 'tokenizer' is not an object");
    const auto& t = j["tokenizer"];
    c.tokenizer.kind = get_required<std::string>(t, "kind", what);
    c.tokenizer.vocab_size = get_required<int64_t>(t, "vocab_size", what);
    c.tokenizer.add_bos = get_required<bool>(t, "add_bos", what);
    c.tokenizer.add_eos = get_required<bool>(t, "add_eos", what);
    c.tokenizer.legacy = get_or<bool>(t, "legacy", false, what);
    c.tokenizer.eos_token_ids = get_int_list(t, "eos_token_ids", what, 1024);
    if (t.contains("extra_special")) {
      const auto& x = t["extra_special"];
      if (!x.is_array()) throw Error(Status::Format, "model config: 'tokenizer.extra_special' is not an array");
      if (x.size() > 65536)
        throw Error(Status::Format, "model config: 'tokenizer.extra_special' has " + std::to_string(x.size()) +
                                        " entries, more than 65536");
      for (const auto& e : x) {
        if (!e.is_object()) throw Error(Status::Format, "model config: a 'tokenizer.extra_special' entry is not an object");
        c.tokenizer.extra_special.emplace_back(get_required<int64_t>(e, "id", what), get_required<std::string>(e, "content", what));
      }
    }
    c.tokenizer.chat_template = get_or<std::string>(t, "chat_template", "", what);
    if (t.contains("special_tokens")) {
      const auto& x = t["special_tokens"];
      if (!x.is_object()) throw Error(Status::Format, "model config: 'tokenizer.special_tokens' is not an object");
      if (x.size() > chat_special_token_names().size())
        throw Error(Status::Format, "model config: 'tokenizer.special_tokens' has " + std::to_string(x.size()) + " entries");
      for (const auto& [name, content] : x.items()) {
        if (!content.is_string())
          throw Error(Status::Format, "model config: 'tokenizer.special_tokens." + name + "' is not a string");
        c.tokenizer.special_tokens.emplace_back(name, content.get<std::string>());
      }
    }
  }
  // NOTE: bounded before validate() so a hostile file cannot make us allocate GBs.
  if (j.contains("layer_windows")) c.layer_windows = get_int_list(j, "layer_windows", what, 4096);
  if (j.contains("moe_layers")) c.moe_layers = get_int_list(j, "moe_layers", what, 4096);
  c.fill_defaults();
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
  auto one_of = [&](const std::string& v, std::initializer_list<const char*> ok, const char* name) {
    std::string list;
    for (const char* o : ok) {
      if (v == o) return;
      list += (list.empty() ? "" : ", ") + std::string(o);
    }
    check(false, std::string(name) + " '" + v + "' is not supported (supported: " + list + ")");
  };
  const auto& fams = families();
  check(std::find(fams.begin(), fams.end(), architecture) != fams.end(),
        "architecture '" + architecture + "' is not supported (supported: " + join(fams) + ")");
  in_range(vocab_size, 1, 1 << 24, "vocab_size");
  in_range(hidden_size, 1, kMaxDim, "hidden_size");
  in_range(intermediate_size, 1, kMaxDim, "intermediate_size");
  in_range(num_layers, 1, 4096, "num_layers");
  in_range(num_heads, 1, 4096, "num_heads");
  in_range(num_kv_heads, 1, num_heads, "num_kv_heads");
  check(num_heads % num_kv_heads == 0, "num_heads (" + std::to_string(num_heads) +
                                           ") is not a multiple of num_kv_heads (" + std::to_string(num_kv_heads) + ")");
  in_range(head_dim, 2, 4096, "head_dim");
  in_range(num_experts, 1, 65536, "num_experts");
  in_range(experts_per_token, 1, num_experts, "experts_per_token");
  in_range(max_position_embeddings, 1, 1 << 24, "max_position_embeddings");
  in_range(sliding_window, 0, 1 << 30, "sliding_window");
  check(rope_theta > 0 && rope_theta < 1e30, "rope_theta must be positive");
  check(rms_norm_eps > 0 && rms_norm_eps < 1, "rms_norm_eps must be in (0, 1)");
  check(hidden_act == "silu", "hidden_act '" + hidden_act + "' is not supported (supported: silu)");
  check(std::isfinite(routing.routed_scaling_factor) && routing.routed_scaling_factor > 0,
        "routing.routed_scaling_factor must be a positive finite number");
  one_of(routing.scoring, {"softmax", "sigmoid", "topk_softmax"}, "routing.scoring");
  one_of(routing.group_select, {"none", "max", "top2_sum"}, "routing.group_select");
  in_range(routing.n_group, 1, num_experts, "routing.n_group");
  check(num_experts % routing.n_group == 0, "num_experts is not a multiple of routing.n_group");
  in_range(routing.topk_group, 1, routing.n_group, "routing.topk_group");
  if (routing.group_select == "top2_sum") check(num_experts / routing.n_group >= 2, "top2_sum groups need >= 2 experts each");
  check(routing.group_select == "none" || experts_per_token <= routing.topk_group * (num_experts / routing.n_group),
        "experts_per_token exceeds the experts in the kept groups");
  check(eos_token_id < vocab_size && bos_token_id < vocab_size, "bos/eos token id outside the vocabulary");
  one_of(attention, {"gqa", "mla"}, "attention");
  one_of(qk_norm, {"none", "head", "full"}, "qk_norm");
  check(std::isfinite(clip_qkv) && clip_qkv >= 0, "clip_qkv must be >= 0");
  check(std::isfinite(attn_scale) && attn_scale >= 0, "attn_scale must be a positive finite number (0: 1/sqrt(head_dim))");
  check(layer_windows.empty() || layer_windows.size() == static_cast<size_t>(num_layers), "layer_windows must have num_layers entries");
  for (int64_t w : layer_windows) in_range(w, 0, 1 << 30, "layer_windows[i]");
  if (attention == "mla") {
    in_range(q_lora_rank, 0, kMaxDim, "q_lora_rank");
    in_range(kv_lora_rank, 1, kMaxDim, "kv_lora_rank");
    in_range(qk_nope_head_dim, 1, 4096, "qk_nope_head_dim");
    in_range(qk_rope_head_dim, 2, 4096, "qk_rope_head_dim");
    in_range(v_head_dim, 1, 4096, "v_head_dim");
    check(head_dim == qk_nope_head_dim + qk_rope_head_dim, "head_dim must equal qk_nope_head_dim + qk_rope_head_dim");
    check(rope_dim == qk_rope_head_dim, "rope_dim must equal qk_rope_head_dim");
    check(num_kv_heads == num_heads, "MLA needs num_kv_heads == num_heads");
    check(qk_norm == "none" && !qkv_bias && !o_bias && !attn_sinks, "MLA has no q/k norm, biases or sinks");
  }
  if (rope_dim != 0 || head_dim % 2 != 0) in_range(rope_dim ? rope_dim : head_dim, 2, head_dim, "rope_dim");
  check((rope_dim ? rope_dim : head_dim) % 2 == 0, "rope_dim (or head_dim) must be even for rotary embeddings");
  one_of(rope_scaling.type, {"none", "yarn"}, "rope_scaling.type");
  if (rope_scaling.type == "yarn") {
    check(std::isfinite(rope_scaling.factor) && rope_scaling.factor > 0 && rope_scaling.factor < 1e6,
          "rope_scaling.factor must be positive");
    in_range(rope_scaling.original_max_position_embeddings, 1, 1 << 24, "rope_scaling.original_max_position_embeddings");
    check(std::isfinite(rope_scaling.beta_fast) && std::isfinite(rope_scaling.beta_slow) && rope_scaling.beta_fast > 0 &&
              rope_scaling.beta_slow > 0,
          "rope_scaling.beta_fast and beta_slow must be positive");
  }
  check(std::isfinite(rope_scaling.attention_factor) && rope_scaling.attention_factor > 0 && rope_scaling.attention_factor < 1e3,
        "rope_scaling.attention_factor must be positive");
  check(moe_layers.size() <= static_cast<size_t>(num_layers), "moe_layers has more entries than layers");
  for (size_t i = 0; i < moe_layers.size(); ++i) {
    in_range(moe_layers[i], 0, num_layers - 1, "moe_layers[i]");
    check(i == 0 || moe_layers[i] > moe_layers[i - 1], "moe_layers must be strictly ascending");
  }
  if (!moe_layers.empty() && moe_layers.size() < static_cast<size_t>(num_layers)) in_range(dense_intermediate_size, 1, kMaxDim, "dense_intermediate_size");
  else in_range(dense_intermediate_size, 0, kMaxDim, "dense_intermediate_size");
  in_range(shared_intermediate_size, 0, kMaxDim, "shared_intermediate_size");
  check(!shared_expert_gate || shared_intermediate_size > 0, "shared_expert_gate needs a shared expert");
  one_of(expert_act, {"silu", "swiglu_oai"}, "expert_act");
  check(std::isfinite(swiglu_alpha) && std::isfinite(swiglu_limit) && swiglu_limit > 0, "swiglu_alpha/limit must be finite");
  one_of(expert_quant.type, {"none", "int8", "int4"}, "expert_quant.type");
  if (expert_quant.type != "none") {
    const int64_t g = expert_quant.group_size;
    check(g == 16 || g == 32 || g == 64 || g == 128,
          "expert_quant.group_size " + std::to_string(g) + " is not supported (supported: 16, 32, 64, 128)");
    check(hidden_size % g == 0, "expert_quant.group_size " + std::to_string(g) + " does not divide hidden_size " +
                                    std::to_string(hidden_size));
    check(intermediate_size % g == 0, "expert_quant.group_size " + std::to_string(g) +
                                          " does not divide intermediate_size " + std::to_string(intermediate_size));
  } else {
    check(expert_quant.group_size == 0, "expert_quant.group_size must be 0 without quantisation");
  }
  // Each quantised dense matrix's input width must be a multiple of the group:
  // checked per tensor by the converter and the reader (dense_tensor_specs).
  one_of(dense_quant.type, {"none", "int8", "int4"}, "dense_quant.type");
  if (dense_quant.type != "none") {
    const int64_t g = dense_quant.group_size;
    check(g == 16 || g == 32 || g == 64 || g == 128,
          "dense_quant.group_size " + std::to_string(g) + " is not supported (supported: 16, 32, 64, 128)");
  } else {
    check(dense_quant.group_size == 0, "dense_quant.group_size must be 0 without quantisation");
  }
  if (tokenizer.present()) {
    one_of(tokenizer.kind, {"hf_json", "sentencepiece"}, "tokenizer.kind");
    in_range(tokenizer.vocab_size, 1, vocab_size, "tokenizer.vocab_size");
    check(tokenizer.eos_token_ids.size() <= 1024, "tokenizer.eos_token_ids has more than 1024 entries");
    for (int64_t id : tokenizer.eos_token_ids) in_range(id, 0, vocab_size - 1, "tokenizer.eos_token_ids[i]");
    for (const auto& [id, content] : tokenizer.extra_special) {
      in_range(id, 0, vocab_size - 1, "tokenizer.extra_special[i].id");
      check(!content.empty() && content.size() <= 1024, "tokenizer.extra_special content must be 1 to 1024 bytes");
    }
    check(tokenizer.chat_template.size() <= kMaxChatTemplateBytes, "tokenizer.chat_template is larger than 1 MiB");
    const auto& names = chat_special_token_names();
    for (const auto& [name, content] : tokenizer.special_tokens) {
      check(std::find(names.begin(), names.end(), name) != names.end(),
            "tokenizer.special_tokens has an unknown name '" + name + "'");
      check(!content.empty() && content.size() <= 1024, "tokenizer.special_tokens content must be 1 to 1024 bytes");
    }
  } else {
    check(tokenizer.eos_token_ids.empty() && tokenizer.extra_special.empty() && tokenizer.vocab_size == 0 &&
              tokenizer.chat_template.empty() && tokenizer.special_tokens.empty(),
          "tokenizer fields without tokenizer.kind");
  }
}

const std::vector<std::string>& chat_special_token_names() {
  static const std::vector<std::string> k = {"bos_token", "eos_token", "unk_token", "sep_token",
                                             "pad_token", "cls_token", "mask_token"};
  return k;
}

std::vector<float> rope_inv_freq(const ModelConfig& c) {
  // NOTE: f32 arithmetic in the order torch uses, so the angles match bit for bit.
  const int64_t dim = c.rope_dim, half = dim / 2;
  std::vector<float> inv(static_cast<size_t>(half));
  std::vector<float> pos_freqs(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    float ex = static_cast<float>(2 * i) / static_cast<float>(dim);
    pos_freqs[static_cast<size_t>(i)] = std::pow(static_cast<float>(c.rope_theta), ex);
    inv[static_cast<size_t>(i)] = 1.0f / pos_freqs[static_cast<size_t>(i)];
  }
  if (c.rope_scaling.type != "yarn") return inv;
  const RopeScaling& y = c.rope_scaling;
  const double base = c.rope_theta, orig = static_cast<double>(y.original_max_position_embeddings);
  auto correction_dim = [&](double rot) {
    return (static_cast<double>(dim) * std::log(orig / (rot * 2 * M_PI))) / (2 * std::log(base));
  };
  double low = correction_dim(y.beta_fast), high = correction_dim(y.beta_slow);
  if (y.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;
  const float flow = static_cast<float>(low), range = static_cast<float>(high - low), ffac = static_cast<float>(y.factor);
  for (int64_t i = 0; i < half; ++i) {
    float ramp = std::clamp((static_cast<float>(i) - flow) / range, 0.0f, 1.0f);
    float extra_factor = 1.0f - ramp;
    float interp = 1.0f / (ffac * pos_freqs[static_cast<size_t>(i)]);
    float extrap = inv[static_cast<size_t>(i)];
    inv[static_cast<size_t>(i)] = interp * (1.0f - extra_factor) + extrap * extra_factor;
  }
  return inv;
}

FfnShape FfnShape::experts(const ModelConfig& c) {
  FfnShape s;
  s.hidden = c.hidden_size;
  s.inter = c.intermediate_size;
  s.oai = c.expert_act == "swiglu_oai";
  s.alpha = static_cast<float>(c.swiglu_alpha);
  s.limit = static_cast<float>(c.swiglu_limit);
  return s;
}

}  // namespace colibri
