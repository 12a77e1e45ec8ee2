// synth.cpp: seeded random Mixtral checkpoints in Hugging Face layout.
#include "model/synth.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "model/error.h"
#include "model/safetensors.h"

namespace colibri {

namespace fs = std::filesystem;
using nlohmann::json;

const std::vector<std::string>& synth_presets() {
  static const std::vector<std::string> p = {"tiny", "small", "medium"};
  return p;
}

namespace {

struct Preset {
  int64_t vocab, hidden, inter, layers, heads, kv_heads, experts, top_k, ctx;
  DType dtype;
};

Preset preset_for(const std::string& name) {
  if (name == "tiny") return {512, 128, 256, 2, 4, 2, 4, 2, 512, DType::F32};
  if (name == "small") return {4096, 512, 1024, 4, 8, 2, 8, 2, 2048, DType::F32};
  // medium: about 1.6 GB in bf16, 88% of it experts, for decode benchmarks.
  if (name == "medium") return {32000, 1024, 3584, 8, 16, 4, 8, 2, 4096, DType::BF16};
  throw Error(Status::InvalidArgument, "unknown preset '" + name + "' (tiny, small, medium)");
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

struct Tensor {
  std::string name;
  std::vector<int64_t> shape;
  enum Kind { Matrix, Norm, Embedding } kind;
};

}  // namespace

uint64_t synthesize_model(const std::string& out_dir, const SynthOptions& opts) {
  if (opts.arch != "mixtral") throw Error(Status::Unsupported, "synth: unknown arch '" + opts.arch + "' (supported: mixtral)");
  const Preset p = preset_for(opts.preset);
  const DType dtype = opts.dtype.value_or(p.dtype);
  const int64_t hd = p.hidden / p.heads;

  std::vector<Tensor> ts;
  ts.push_back({"model.embed_tokens.weight", {p.vocab, p.hidden}, Tensor::Embedding});
  for (int64_t l = 0; l < p.layers; ++l) {
    std::string L = "model.layers." + std::to_string(l) + ".";
    ts.push_back({L + "input_layernorm.weight", {p.hidden}, Tensor::Norm});
    ts.push_back({L + "self_attn.q_proj.weight", {p.heads * hd, p.hidden}, Tensor::Matrix});
    ts.push_back({L + "self_attn.k_proj.weight", {p.kv_heads * hd, p.hidden}, Tensor::Matrix});
    ts.push_back({L + "self_attn.v_proj.weight", {p.kv_heads * hd, p.hidden}, Tensor::Matrix});
    ts.push_back({L + "self_attn.o_proj.weight", {p.hidden, p.heads * hd}, Tensor::Matrix});
    ts.push_back({L + "post_attention_layernorm.weight", {p.hidden}, Tensor::Norm});
    ts.push_back({L + "block_sparse_moe.gate.weight", {p.experts, p.hidden}, Tensor::Matrix});
    for (int64_t e = 0; e < p.experts; ++e) {
      std::string X = L + "block_sparse_moe.experts." + std::to_string(e) + ".";
      ts.push_back({X + "w1.weight", {p.inter, p.hidden}, Tensor::Matrix});
      ts.push_back({X + "w2.weight", {p.hidden, p.inter}, Tensor::Matrix});
      ts.push_back({X + "w3.weight", {p.inter, p.hidden}, Tensor::Matrix});
    }
  }
  ts.push_back({"model.norm.weight", {p.hidden}, Tensor::Norm});
  ts.push_back({"lm_head.weight", {p.vocab, p.hidden}, Tensor::Matrix});

  // Split into shards of at most shard_bytes (a tensor never straddles two).
  auto nbytes = [&](const Tensor& t) {
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

  fs::create_directories(out_dir);
  json cfg = {
      {"architectures", {"MixtralForCausalLM"}},
      {"model_type", "mixtral"},
      {"vocab_size", p.vocab},
      {"hidden_size", p.hidden},
      {"intermediate_size", p.inter},
      {"num_hidden_layers", p.layers},
      {"num_attention_heads", p.heads},
      {"num_key_value_heads", p.kv_heads},
      {"head_dim", hd},
      {"num_local_experts", p.experts},
      {"num_experts_per_tok", p.top_k},
      {"max_position_embeddings", p.ctx},
      {"rope_theta", 1000000.0},
      {"rms_norm_eps", 1e-5},
      {"hidden_act", "silu"},
      {"sliding_window", nullptr},
      {"tie_word_embeddings", false},
      {"bos_token_id", 1},
      {"eos_token_id", 2},
      {"torch_dtype", dtype == DType::F32 ? "float32" : dtype == DType::BF16 ? "bfloat16" : "float16"},
      {"colibri_synth", {{"preset", opts.preset}, {"seed", opts.seed}}},
  };
  std::ofstream(fs::path(out_dir) / "config.json") << cfg.dump(2) << "\n";

  json weight_map = json::object();
  uint64_t done = 0;
  std::vector<float> f32;
  std::vector<uint8_t> out;
  for (size_t s = 0; s < shards.size(); ++s) {
    char fname[64];
    if (shards.size() == 1)
      std::snprintf(fname, sizeof fname, "model.safetensors");
    else
      std::snprintf(fname, sizeof fname, "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
    std::vector<SafetensorsWriter::Spec> specs;
    for (size_t i : shards[s]) specs.push_back({ts[i].name, dtype, ts[i].shape});
    SafetensorsWriter w((fs::path(out_dir) / fname).string(), specs, {{"format", "pt"}});
    for (size_t i : shards[s]) {
      const Tensor& t = ts[i];
      size_t n = 1;
      for (auto d : t.shape) n *= static_cast<size_t>(d);
      f32.resize(n);
      uint64_t st = hash_name(t.name, opts.seed);
      // NOTE: uniform in [-a, a] with a = sqrt(3 / fan_in) gives unit-variance
      // outputs for unit-variance inputs, so activations stay finite through
      // every layer; norms sit near 1; embeddings have unit variance.
      float a = t.kind == Tensor::Matrix ? std::sqrt(3.0f / static_cast<float>(t.shape.back())) : std::sqrt(3.0f);
      for (size_t k = 0; k < n; ++k) {
        float u = static_cast<float>((splitmix64(st) >> 40) * (1.0 / 16777216.0)) * 2.f - 1.f;
        f32[k] = t.kind == Tensor::Norm ? 1.0f + 0.1f * u : a * u;
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
    std::ofstream(fs::path(out_dir) / "model.safetensors.index.json") << index.dump(2) << "\n";
  } else {
    fs::remove(fs::path(out_dir) / "model.safetensors.index.json");
  }
  return total;
}

}  // namespace colibri
