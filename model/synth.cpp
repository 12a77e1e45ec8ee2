// synth.cpp: seeded random checkpoints in Hugging Face layout for every family
// the converter supports. The config.json is the one the family's transformers
// config class would write; the tensors are those the converter reads for it
// (hf_checkpoint_plan), so a synthetic model converts and runs like a real one.
#include "model/synth.h"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "model/config.h"
#include "model/converter.h"
#include "model/error.h"
#include "model/safetensors.h"
#include "model/file_io.h"

namespace colibri {

namespace fs = std::filesystem;
using nlohmann::json;

const std::vector<std::string>& synth_presets() {
  static const std::vector<std::string> p = {"tiny", "small", "medium"};
  return p;
}

const std::vector<std::string>& synth_architectures() {
  static const std::vector<std::string> a = {"mixtral",     "qwen2_moe",   "qwen3_moe", "olmoe",
                                             "deepseek_v2", "deepseek_v3", "glm4_moe",  "gpt_oss"};
  return a;
}

namespace {

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + v[i];
  return s;
}

// The sizes of one family at one preset. Which fields matter depends on the
// family (see hf_config); the rest stay 0.
struct Dims {
  int64_t vocab = 0, hidden = 0, layers = 0, heads = 0, kv_heads = 0, head_dim = 0;
  int64_t experts = 0, top_k = 0, inter = 0;  // routed experts and their intermediate size
  int64_t ctx = 0;                            // max_position_embeddings (YaRN: the original context)
  int64_t dense_inter = 0;                    // the dense layers' MLP
  int64_t shared = 0;                         // qwen2_moe: shared expert size; deepseek/glm: n_shared_experts
  int64_t n_group = 1, topk_group = 1;        // grouped routing
  int64_t q_lora = 0, kv_lora = 0, nope = 0, rope = 0, v = 0;  // MLA
  int64_t window = 0;                         // gpt-oss sliding window
};

// Sizes: tiny a few MB (f32), small about 0.25 GB (f32), medium 1.5 to 1.8 GB
// (bf16) with routed experts >= 85% of the bytes (for decode benchmarks).
// Mixtral's are those of the first version of synth and must not change.
Dims dims_for(const std::string& arch, int preset) {
  Dims d;
  auto common = [&](int64_t vocab, int64_t hidden, int64_t layers, int64_t heads, int64_t kv, int64_t hd) {
    d.vocab = vocab, d.hidden = hidden, d.layers = layers, d.heads = heads, d.kv_heads = kv, d.head_dim = hd;
  };
  auto moe = [&](int64_t e, int64_t k, int64_t inter) { d.experts = e, d.top_k = k, d.inter = inter; };
  auto mla = [&](int64_t q_lora, int64_t kv_lora, int64_t nope, int64_t rope, int64_t v) {
    d.q_lora = q_lora, d.kv_lora = kv_lora, d.nope = nope, d.rope = rope, d.v = v;
  };
  const int64_t ctx[3] = {512, 2048, 4096};
  d.ctx = ctx[preset];
  if (arch == "mixtral") {
    if (preset == 0) common(512, 128, 2, 4, 2, 32), moe(4, 2, 256);
    if (preset == 1) common(4096, 512, 4, 8, 2, 64), moe(8, 2, 1024);
    if (preset == 2) common(32000, 1024, 8, 16, 4, 64), moe(8, 2, 3584);
  } else if (arch == "qwen2_moe") {
    // Layer 1 is a dense MLP (mlp_only_layers); a gated shared expert.
    if (preset == 0) common(512, 128, 3, 4, 2, 32), moe(8, 2, 64), d.dense_inter = 256, d.shared = 128;
    if (preset == 1) common(4096, 512, 5, 8, 4, 64), moe(16, 4, 512), d.dense_inter = 1536, d.shared = 1024;
    if (preset == 2) common(32000, 1024, 8, 16, 4, 64), moe(32, 4, 1024), d.dense_inter = 2048, d.shared = 1024;
  } else if (arch == "qwen3_moe") {
    // heads * head_dim != hidden, as in the released models.
    if (preset == 0) common(512, 128, 2, 4, 2, 64), moe(16, 4, 64);
    if (preset == 1) common(4096, 512, 4, 8, 2, 128), moe(32, 4, 256);
    if (preset == 2) common(32000, 1024, 8, 16, 4, 128), moe(64, 8, 512);
  } else if (arch == "olmoe") {
    if (preset == 0) common(512, 128, 2, 4, 4, 32), moe(16, 4, 64);
    if (preset == 1) common(4096, 512, 4, 8, 8, 64), moe(32, 4, 256);
    if (preset == 2) common(32000, 1024, 8, 16, 16, 64), moe(64, 8, 512);
  } else if (arch == "deepseek_v2") {
    // Layer 0 dense, 2 shared experts, group-limited greedy routing (2 of 4
    // groups), MLA without a q low-rank projection (as DeepSeek-V2-Lite).
    d.shared = 2, d.n_group = 4, d.topk_group = 2;
    if (preset == 0) common(512, 128, 3, 4, 4, 0), moe(16, 4, 64), d.dense_inter = 256, mla(0, 64, 32, 16, 32);
    if (preset == 1) common(4096, 512, 5, 8, 8, 0), moe(32, 4, 256), d.dense_inter = 1536, mla(0, 256, 64, 32, 64);
    if (preset == 2) common(32000, 1024, 9, 16, 16, 0), moe(64, 6, 512), d.dense_inter = 2048, mla(0, 256, 64, 32, 64);
  } else if (arch == "deepseek_v3") {
    // Layer 0 dense, 1 shared expert, sigmoid routing over groups, MLA with q_lora.
    d.shared = 1, d.n_group = 4, d.topk_group = 2;
    if (preset == 0) common(512, 128, 3, 4, 4, 0), moe(16, 4, 64), d.dense_inter = 256, mla(64, 64, 32, 16, 32);
    if (preset == 1) common(4096, 512, 5, 8, 8, 0), moe(32, 4, 256), d.dense_inter = 1536, mla(256, 256, 64, 32, 64);
    if (preset == 2) {
      common(32000, 1024, 9, 16, 16, 0), moe(64, 8, 512), d.dense_inter = 2816, mla(512, 512, 64, 32, 64);
      d.n_group = 8, d.topk_group = 4;
    }
  } else if (arch == "glm4_moe") {
    // Layer 0 dense, 1 shared expert, sigmoid routing, partial rotary, q/k norms, qkv biases.
    d.shared = 1;
    if (preset == 0) common(512, 128, 3, 4, 2, 32), moe(16, 4, 64), d.dense_inter = 256;
    if (preset == 1) common(4096, 512, 5, 8, 2, 64), moe(32, 4, 256), d.dense_inter = 1536;
    if (preset == 2) common(32000, 1024, 9, 16, 4, 64), moe(64, 8, 512), d.dense_inter = 2816;
  } else if (arch == "gpt_oss") {
    // Alternating sliding/full attention with a window a short prompt exceeds.
    if (preset == 0) common(512, 128, 2, 4, 2, 32), moe(8, 2, 128), d.window = 8;
    if (preset == 1) common(4096, 512, 4, 8, 2, 64), moe(16, 4, 512), d.window = 64;
    if (preset == 2) common(32000, 1024, 8, 16, 4, 64), moe(32, 4, 1024), d.window = 128;
  }
  return d;
}

const char* dtype_json_name(DType dt) {
  return dt == DType::F32 ? "float32" : dt == DType::BF16 ? "bfloat16" : "float16";
}

// The Hugging Face config.json of the family, with the keys its transformers
// configuration class uses (in the form save_pretrained writes, except Mixtral,
// which keeps the form of the first version of synth).
json hf_config(const std::string& arch, const Dims& d, const SynthOptions& opts, DType dtype) {
  const json meta = {{"preset", opts.preset}, {"seed", opts.seed}};
  if (arch == "mixtral") {
    return {
        {"architectures", {"MixtralForCausalLM"}},
        {"model_type", "mixtral"},
        {"vocab_size", d.vocab},
        {"hidden_size", d.hidden},
        {"intermediate_size", d.inter},
        {"num_hidden_layers", d.layers},
        {"num_attention_heads", d.heads},
        {"num_key_value_heads", d.kv_heads},
        {"head_dim", d.head_dim},
        {"num_local_experts", d.experts},
        {"num_experts_per_tok", d.top_k},
        {"max_position_embeddings", d.ctx},
        {"rope_theta", 1000000.0},
        {"rms_norm_eps", 1e-5},
        {"hidden_act", "silu"},
        {"sliding_window", nullptr},
        {"tie_word_embeddings", false},
        {"bos_token_id", 1},
        {"eos_token_id", 2},
        {"torch_dtype", dtype_json_name(dtype)},
        {"colibri_synth", meta},
    };
  }
  static const std::map<std::string, std::string> hf_names = {
      {"qwen2_moe", "Qwen2MoeForCausalLM"},      {"qwen3_moe", "Qwen3MoeForCausalLM"},
      {"olmoe", "OlmoeForCausalLM"},             {"deepseek_v2", "DeepseekV2ForCausalLM"},
      {"deepseek_v3", "DeepseekV3ForCausalLM"},  {"glm4_moe", "Glm4MoeForCausalLM"},
      {"gpt_oss", "GptOssForCausalLM"},
  };
  json c = {
      {"architectures", {hf_names.at(arch)}},
      {"model_type", arch},
      {"vocab_size", d.vocab},
      {"hidden_size", d.hidden},
      {"num_hidden_layers", d.layers},
      {"num_attention_heads", d.heads},
      {"num_key_value_heads", d.kv_heads},
      {"max_position_embeddings", d.ctx},
      {"num_experts_per_tok", d.top_k},
      {"hidden_act", "silu"},
      {"rms_norm_eps", 1e-6},
      {"tie_word_embeddings", false},
      {"bos_token_id", 1},
      {"eos_token_id", 2},
      {"pad_token_id", nullptr},
      {"torch_dtype", dtype_json_name(dtype)},
      {"colibri_synth", meta},
  };
  auto rope_default = [&](double theta) { return json{{"rope_type", "default"}, {"rope_theta", theta}}; };
  // YaRN over the preset's context: the model claims factor x that.
  auto rope_yarn = [&](double theta, double factor) {
    c["max_position_embeddings"] = static_cast<int64_t>(factor) * d.ctx;
    return json{{"rope_type", "yarn"},
                {"rope_theta", theta},
                {"factor", factor},
                {"original_max_position_embeddings", d.ctx},
                {"beta_fast", 32.0},
                {"beta_slow", 1.0}};
  };
  if (arch == "qwen2_moe") {
    c["intermediate_size"] = d.dense_inter;  // the dense layers' (mlp_only_layers) MLP
    c["moe_intermediate_size"] = d.inter;
    c["num_experts"] = d.experts;
    c["shared_expert_intermediate_size"] = d.shared;
    c["decoder_sparse_step"] = 1;
    c["mlp_only_layers"] = {1};
    c["norm_topk_prob"] = false;
    c["qkv_bias"] = true;
    c["use_sliding_window"] = false;
    c["sliding_window"] = 0;
    c["max_window_layers"] = d.layers;
    c["rope_parameters"] = rope_default(1000000.0);
  } else if (arch == "qwen3_moe") {
    c["head_dim"] = d.head_dim;
    c["intermediate_size"] = 3 * d.hidden;  // unused: no mlp_only_layers
    c["moe_intermediate_size"] = d.inter;
    c["num_experts"] = d.experts;
    c["decoder_sparse_step"] = 1;
    c["mlp_only_layers"] = json::array();
    c["norm_topk_prob"] = true;
    c["attention_bias"] = false;
    c["use_sliding_window"] = false;
    c["sliding_window"] = nullptr;
    c["max_window_layers"] = d.layers;
    c["rope_parameters"] = rope_default(1000000.0);
  } else if (arch == "olmoe") {
    c["intermediate_size"] = d.inter;
    c["num_experts"] = d.experts;
    c["norm_topk_prob"] = false;
    c["attention_bias"] = false;
    c["clip_qkv"] = 2.0;  // small enough to clip some of the random q, k, v
    c["rms_norm_eps"] = 1e-5;
    c["rope_parameters"] = rope_default(10000.0);
  } else if (arch == "deepseek_v2" || arch == "deepseek_v3") {
    const bool v3 = arch == "deepseek_v3";
    c["intermediate_size"] = d.dense_inter;
    c["moe_intermediate_size"] = d.inter;
    c["n_routed_experts"] = d.experts;
    c["n_shared_experts"] = d.shared;
    c["first_k_dense_replace"] = 1;
    c["moe_layer_freq"] = 1;
    c["n_group"] = d.n_group;
    c["topk_group"] = d.topk_group;
    c["q_lora_rank"] = d.q_lora > 0 ? json(d.q_lora) : json(nullptr);
    c["kv_lora_rank"] = d.kv_lora;
    c["qk_nope_head_dim"] = d.nope;
    c["qk_rope_head_dim"] = d.rope;
    c["v_head_dim"] = d.v;
    c["attention_bias"] = false;
    json rope = rope_yarn(10000.0, 40.0);
    rope["mscale"] = v3 ? 1.0 : 0.707;
    rope["mscale_all_dim"] = v3 ? 1.0 : 0.707;
    c["rope_parameters"] = rope;
    if (v3) {
      c["topk_method"] = "noaux_tc";
      c["scoring_func"] = "sigmoid";
      c["norm_topk_prob"] = true;
      c["routed_scaling_factor"] = 2.5;
      c["rope_interleave"] = true;
    } else {
      c["topk_method"] = "group_limited_greedy";
      c["scoring_func"] = "softmax";
      c["norm_topk_prob"] = false;
      c["routed_scaling_factor"] = 2.0;
      c["mlp_bias"] = false;
    }
  } else if (arch == "glm4_moe") {
    c["head_dim"] = d.head_dim;
    c["intermediate_size"] = d.dense_inter;
    c["moe_intermediate_size"] = d.inter;
    c["n_routed_experts"] = d.experts;
    c["n_shared_experts"] = d.shared;
    c["first_k_dense_replace"] = 1;
    c["n_group"] = 1;
    c["topk_group"] = 1;
    c["norm_topk_prob"] = true;
    c["routed_scaling_factor"] = 2.5;
    c["use_qk_norm"] = true;
    c["attention_bias"] = true;
    c["rms_norm_eps"] = 1e-5;
    json rope = rope_default(1000000.0);
    rope["partial_rotary_factor"] = 0.5;
    c["rope_parameters"] = rope;
  } else if (arch == "gpt_oss") {
    c["head_dim"] = d.head_dim;
    c["intermediate_size"] = d.inter;
    c["num_local_experts"] = d.experts;
    c["sliding_window"] = d.window;
    json types = json::array();
    for (int64_t l = 0; l < d.layers; ++l) types.push_back(l % 2 == 0 ? "sliding_attention" : "full_attention");
    c["layer_types"] = types;
    c["attention_bias"] = true;
    c["swiglu_alpha"] = 1.702;
    c["swiglu_limit"] = 7.0;
    c["rms_norm_eps"] = 1e-5;
    json rope = rope_yarn(150000.0, 32.0);
    rope["truncate"] = false;
    c["rope_parameters"] = rope;
  }
  return c;
}

uint64_t splitmix64(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t hash_name(const std::string& s, uint64_t seed) {
  uint64_t h = 1469598103934665603ull ^ seed;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Sort key of a tensor in the files: the embedding first, then layer by layer
// (the layer's dense tensors, then its experts, as hf_checkpoint_plan lists
// them), then the final norm and the output head.
int64_t layer_key(const std::string& name) {
  static const std::string prefix = "model.layers.";
  if (name.rfind(prefix, 0) != 0) return name == "model.embed_tokens.weight" ? -1 : INT64_MAX;
  return std::stoll(name.substr(prefix.size(), name.find('.', prefix.size()) - prefix.size()));
}

// Uniform in [-1, 1) from the tensor's stream.
float uniform(uint64_t& st) { return static_cast<float>((splitmix64(st) >> 40) * (1.0 / 16777216.0)) * 2.f - 1.f; }

}  // namespace

uint64_t synthesize_model(const std::string& out_dir, const SynthOptions& opts) {
  const auto& archs = synth_architectures();
  if (std::find(archs.begin(), archs.end(), opts.arch) == archs.end())
    throw Error(Status::InvalidArgument, "synth: unknown --arch '" + opts.arch + "' (supported: " + join(archs) + ")");
  const auto& presets = synth_presets();
  auto pit = std::find(presets.begin(), presets.end(), opts.preset);
  if (pit == presets.end())
    throw Error(Status::InvalidArgument, "unknown preset '" + opts.preset + "' (" + join(presets) + ")");
  const int preset = static_cast<int>(pit - presets.begin());
  const DType dtype = opts.dtype.value_or(preset == 2 ? DType::BF16 : DType::F32);
  Dims dims = dims_for(opts.arch, preset);
  if (opts.vocab_size < 0 || opts.vocab_size > (int64_t{1} << 22))
    throw Error(Status::InvalidArgument, "vocab size " + std::to_string(opts.vocab_size) + " is out of range (1 .. 4194304)");
  if (opts.vocab_size > 0) dims.vocab = opts.vocab_size;
  const json cfg = hf_config(opts.arch, dims, opts, dtype);
  const ModelConfig mc = ModelConfig::from_hf(cfg);  // what the converter will read

  std::vector<HfTensor> ts = hf_checkpoint_plan(mc);
  std::stable_sort(ts.begin(), ts.end(),
                   [](const HfTensor& a, const HfTensor& b) { return layer_key(a.name) < layer_key(b.name); });

  // Split into shards of at most shard_bytes (a tensor never straddles two).
  auto nbytes = [&](const HfTensor& t) {
    uint64_t n = dtype_size(dtype);
    for (auto d : t.shape) n *= static_cast<uint64_t>(d);
    return n;
  };
  std::vector<std::vector<size_t>> shards(1);
  uint64_t cur = 0, total = 0;
  for (size_t i = 0; i < ts.size(); ++i) {
    uint64_t n = nbytes(ts[i]);
    if (cur > 0 && cur + n > opts.shard_bytes) {
      shards.emplace_back();
      cur = 0;
    }
    shards.back().push_back(i);
    cur += n;
    total += n;
  }

  auto shard_name = [&](size_t s) {
    char fname[64];
    if (shards.size() == 1)
      std::snprintf(fname, sizeof fname, "model.safetensors");
    else
      std::snprintf(fname, sizeof fname, "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
    return std::string(fname);
  };
  {
    // NOTE: before anything is written: no output may replace a device, FIFO or directory.
    std::vector<std::string> outs = {(fs::path(out_dir) / "config.json").string()};
    for (size_t s = 0; s < shards.size(); ++s) outs.push_back((fs::path(out_dir) / shard_name(s)).string());
    if (shards.size() > 1) outs.push_back((fs::path(out_dir) / "model.safetensors.index.json").string());
    struct stat st {};
    if (::stat(out_dir.c_str(), &st) == 0 && !S_ISDIR(st.st_mode))
      throw Error(Status::InvalidArgument, "synth: --out '" + out_dir + "' exists and is " + file_kind(st.st_mode) +
                                               ", not a directory");
    for (const auto& o : outs) check_output(o, {}, "synth: output");
  }
  fs::create_directories(out_dir);
  write_output((fs::path(out_dir) / "config.json").string(), cfg.dump(2) + "\n");

  json weight_map = json::object();
  uint64_t done = 0;
  std::vector<float> f32;
  std::vector<uint8_t> out;
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string fname = shard_name(s);
    std::vector<SafetensorsWriter::Spec> specs;
    for (size_t i : shards[s]) specs.push_back({ts[i].name, dtype, ts[i].shape});
    SafetensorsWriter w((fs::path(out_dir) / fname).string(), specs, {{"format", "pt"}});
    for (size_t i : shards[s]) {
      const HfTensor& t = ts[i];
      size_t n = 1;
      for (auto d : t.shape) n *= static_cast<size_t>(d);
      f32.resize(n);
      uint64_t st = hash_name(t.name, opts.seed);
      // NOTE: uniform in [-a, a] with a = sqrt(3 / fan_in) gives unit-variance
      // outputs for unit-variance inputs, so activations stay finite through
      // every layer; norms sit near 1; embeddings have unit variance; biases
      // are small. The fan-in is the last dimension of a Linear weight
      // [out, in], the middle one of gpt-oss's fused experts [E, in, out].
      // Qwen2-MoE's shared_expert_gate [1, H] is a Linear too.
      HfTensor::Kind kind = t.kind;
      if (ends_with(t.name, "shared_expert_gate.weight")) kind = HfTensor::Matrix;
      const int64_t fan_in = t.shape.size() == 3 ? t.shape[1] : t.shape.back();
      if (kind == HfTensor::Matrix || kind == HfTensor::Embedding) {
        const float a = kind == HfTensor::Matrix ? std::sqrt(3.0f / static_cast<float>(fan_in)) : std::sqrt(3.0f);
        for (size_t k = 0; k < n; ++k) f32[k] = a * uniform(st);
      } else if (kind == HfTensor::Norm) {
        for (size_t k = 0; k < n; ++k) f32[k] = 1.0f + 0.1f * uniform(st);
      } else {
        // Attention sinks are logits that matter next to q.k; the score
        // correction bias only nudges the expert selection.
        const float a = ends_with(t.name, ".sinks")                    ? 0.5f
                        : ends_with(t.name, "e_score_correction_bias") ? 0.01f
                                                                       : 0.02f;
        for (size_t k = 0; k < n; ++k) f32[k] = a * uniform(st);
      }
      out.resize(n * dtype_size(dtype));
      convert_elements(f32.data(), DType::F32, out.data(), dtype, n);
      w.write_next(out.data(), out.size());
      weight_map[t.name] = fname;
      done += out.size();
      if (opts.progress) opts.progress(done, total, t.name);
    }
    w.finish();
  }
  if (shards.size() > 1) {
    json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    write_output((fs::path(out_dir) / "model.safetensors.index.json").string(), index.dump(2) + "\n");
  } else {
    fs::remove(fs::path(out_dir) / "model.safetensors.index.json");
  }
  return total;
}

}  // namespace colibri
