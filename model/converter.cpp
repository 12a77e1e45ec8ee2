// converter.cpp: maps a Hugging Face MoE checkpoint's tensors (every supported
// family) onto the .colibri layout, converting dtypes one tensor at a time.
#include "model/converter.h"

#include <cmath>
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <vector>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "model/chat_template.h"
#include "model/colibri_file.h"
#include "model/config.h"
#include "model/error.h"
#include "model/safetensors.h"
#include "model/tokenizer.h"
#include "model/text.h"
#include "model/file_io.h"

namespace colibri {

namespace fs = std::filesystem;

namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

const SafeTensor& expect(const Checkpoint& ck, const std::string& name, const std::vector<int64_t>& shape) {
  const SafeTensor& t = ck.get(name);
  if (!t.dtype)
    throw Error(Status::Unsupported, "tensor '" + name + "' has dtype " + t.dtype_name + "; supported: F32, F16, BF16");
  if (t.shape != shape)
    throw Error(Status::Format, "tensor '" + name + "' has shape " + shape_str(t.shape) + ", expected " + shape_str(shape));
  return t;
}

const SafeTensor& expect_u8(const Checkpoint& ck, const std::string& name, const std::vector<int64_t>& shape) {
  const SafeTensor& t = ck.get(name);
  if (t.dtype_name != "U8")
    throw Error(Status::Format, "MXFP4 tensor '" + name + "' has dtype " + t.dtype_name + ", expected U8");
  if (t.shape != shape)
    throw Error(Status::Format, "tensor '" + name + "' has shape " + shape_str(t.shape) + ", expected " + shape_str(shape));
  return t;
}

// n elements of t from element `first`, as f32.
void read_f32(const SafeTensor& t, size_t first, size_t n, float* out) {
  convert_elements(t.data + first * dtype_size(*t.dtype), *t.dtype, out, DType::F32, n);
}

// How one canonical dense tensor is made from the checkpoint.
struct DenseSource {
  enum Kind { Direct, KvbK, KvbV } kind = Direct;
  std::string name;  // HF tensor
};

DenseSource dense_source_no_ck(const ModelConfig& c, const std::string& canon);

// Where each canonical dense tensor comes from.
DenseSource dense_source(const Checkpoint& ck, const ModelConfig& c, const std::string& canon) {
  if (c.architecture == "mixtral" && canon.size() > 13 && canon.compare(canon.size() - 13, 13, ".ffn_gate_inp") == 0) {
    // transformers < 5 names Mixtral's sparse block block_sparse_moe, 5.x names it mlp.
    const std::string l = canon.substr(4, canon.find('.', 4) - 4);
    std::string classic = "model.layers." + l + ".block_sparse_moe.gate.weight";
    return {DenseSource::Direct, ck.find(classic) ? classic : "model.layers." + l + ".mlp.gate.weight"};
  }
  return dense_source_no_ck(c, canon);
}

DenseSource dense_source_no_ck(const ModelConfig& c, const std::string& canon) {
  if (canon == tname::token_embd()) return {DenseSource::Direct, "model.embed_tokens.weight"};
  if (canon == tname::output_norm()) return {DenseSource::Direct, "model.norm.weight"};
  if (canon == tname::output()) return {DenseSource::Direct, "lm_head.weight"};
  // blk.{l}.{what}
  size_t dot1 = canon.find('.'), dot2 = canon.find('.', dot1 + 1);
  std::string l = canon.substr(dot1 + 1, dot2 - dot1 - 1), what = canon.substr(dot2 + 1);
  const std::string p = "model.layers." + l + ".", a = p + "self_attn.";
  auto d = [](std::string n) { return DenseSource{DenseSource::Direct, std::move(n)}; };
  if (what == "attn_norm") return d(p + "input_layernorm.weight");
  if (what == "ffn_norm") return d(p + "post_attention_layernorm.weight");
  if (what == "attn_q") return d(a + "q_proj.weight");
  if (what == "attn_k") return d(a + "k_proj.weight");
  if (what == "attn_v") return d(a + "v_proj.weight");
  if (what == "attn_output") return d(a + "o_proj.weight");
  if (what == "attn_q_bias") return d(a + "q_proj.bias");
  if (what == "attn_k_bias") return d(a + "k_proj.bias");
  if (what == "attn_v_bias") return d(a + "v_proj.bias");
  if (what == "attn_output_bias") return d(a + "o_proj.bias");
  if (what == "attn_q_norm") return d(a + "q_norm.weight");
  if (what == "attn_k_norm") return d(a + "k_norm.weight");
  if (what == "attn_sinks") return d(a + "sinks");
  if (what == "attn_q_a") return d(a + "q_a_proj.weight");
  if (what == "attn_q_a_norm") return d(a + "q_a_layernorm.weight");
  if (what == "attn_q_b") return d(a + "q_b_proj.weight");
  if (what == "attn_kv_a") return d(a + "kv_a_proj_with_mqa.weight");
  if (what == "attn_kv_a_norm") return d(a + "kv_a_layernorm.weight");
  if (what == "attn_k_b") return {DenseSource::KvbK, a + "kv_b_proj.weight"};
  if (what == "attn_v_b") return {DenseSource::KvbV, a + "kv_b_proj.weight"};
  if (what == "ffn_gate") return d(p + "mlp.gate_proj.weight");
  if (what == "ffn_up") return d(p + "mlp.up_proj.weight");
  if (what == "ffn_down") return d(p + "mlp.down_proj.weight");
  if (what == "ffn_gate_inp") return d(p + (c.architecture == "gpt_oss" ? "mlp.router.weight" : "mlp.gate.weight"));
  if (what == "ffn_gate_inp_bias") return d(p + "mlp.router.bias");
  if (what == "exp_probs_b") return d(p + "mlp.gate.e_score_correction_bias");
  const std::string sh = p + (c.architecture == "qwen2_moe" ? "mlp.shared_expert." : "mlp.shared_experts.");
  if (what == "ffn_gate_shexp") return d(sh + "gate_proj.weight");
  if (what == "ffn_up_shexp") return d(sh + "up_proj.weight");
  if (what == "ffn_down_shexp") return d(sh + "down_proj.weight");
  if (what == "ffn_gate_inp_shexp") return d(p + "mlp.shared_expert_gate.weight");
  throw Error(Status::Internal, "no source for tensor " + canon);
}

// The checkpoint shape a canonical tensor's source must have.
std::vector<int64_t> source_shape(const ModelConfig& c, const TensorSpec& spec, const DenseSource& src) {
  if (src.kind != DenseSource::Direct)
    return {c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank};
  if (spec.name.size() > 18 && spec.name.compare(spec.name.size() - 18, 18, "ffn_gate_inp_shexp") == 0)
    return {1, c.hidden_size};  // a Linear(hidden, 1)
  return spec.shape;
}

// The MXFP4 code points (e2m1), indexed by a nibble.
constexpr float kFp4[16] = {+0.0f, +0.5f, +1.0f, +1.5f, +2.0f, +3.0f, +4.0f, +6.0f,
                            -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// Row `row` of an MXFP4 matrix stored as blocks [rows, cols/32, 16] and e8m0
// scales [rows, cols/32] (the rows of one expert start at `base_row`): byte b
// of a block holds element 2b in its low nibble and 2b+1 in its high nibble.
void mxfp4_row(const SafeTensor& blocks, const SafeTensor& scales, int64_t row, int64_t cols, float* out) {
  const int64_t G = cols / 32;
  const uint8_t* bl = blocks.data + static_cast<size_t>(row * G * 16);
  const uint8_t* sc = scales.data + static_cast<size_t>(row * G);
  for (int64_t g = 0; g < G; ++g) {
    const int e = static_cast<int>(sc[g]) - 127;
    for (int b = 0; b < 16; ++b) {
      const uint8_t v = bl[g * 16 + b];
      out[g * 32 + 2 * b] = std::ldexp(kFp4[v & 0x0F], e);
      out[g * 32 + 2 * b + 1] = std::ldexp(kFp4[v >> 4], e);
    }
  }
}

}  // namespace

std::vector<HfTensor> hf_checkpoint_plan(const ModelConfig& cfg) {
  std::vector<HfTensor> out;
  for (const auto& spec : dense_tensor_specs(cfg)) {
    // NOTE: dense_source only consults the checkpoint for Mixtral's router name.
    DenseSource src;
    if (spec.name.find("ffn_gate_inp") != std::string::npos && cfg.architecture == "mixtral") {
      const std::string l = spec.name.substr(4, spec.name.find('.', 4) - 4);
      src = {DenseSource::Direct, "model.layers." + l + ".block_sparse_moe.gate.weight"};
    } else {
      src = dense_source_no_ck(cfg, spec.name);
    }
    if (src.kind == DenseSource::KvbV) continue;  // the same tensor as KvbK
    HfTensor t{src.name, source_shape(cfg, spec, src), HfTensor::Matrix};
    if (spec.name == tname::token_embd()) t.kind = HfTensor::Embedding;
    else if (t.shape.size() == 2) t.kind = HfTensor::Matrix;  // Qwen2-MoE's shared_expert_gate, a Linear(H, 1)
    else if (spec.is_norm) t.kind = spec.name.find("norm") != std::string::npos ? HfTensor::Norm : HfTensor::Bias;
    out.push_back(std::move(t));
  }
  const int64_t H = cfg.hidden_size, I = cfg.intermediate_size, E = cfg.num_experts;
  for (int64_t l : cfg.moe_layers) {
    const std::string L = "model.layers." + std::to_string(l) + ".";
    if (cfg.architecture == "gpt_oss") {
      out.push_back({L + "mlp.experts.gate_up_proj", {E, H, 2 * I}, HfTensor::Matrix});
      out.push_back({L + "mlp.experts.gate_up_proj_bias", {E, 2 * I}, HfTensor::Bias});
      out.push_back({L + "mlp.experts.down_proj", {E, I, H}, HfTensor::Matrix});
      out.push_back({L + "mlp.experts.down_proj_bias", {E, H}, HfTensor::Bias});
      continue;
    }
    const bool mx = cfg.architecture == "mixtral";
    for (int64_t e = 0; e < E; ++e) {
      const std::string X = L + (mx ? "block_sparse_moe.experts." : "mlp.experts.") + std::to_string(e) + ".";
      out.push_back({X + (mx ? "w1" : "gate_proj") + ".weight", {I, H}, HfTensor::Matrix});
      out.push_back({X + (mx ? "w2" : "down_proj") + ".weight", {H, I}, HfTensor::Matrix});
      out.push_back({X + (mx ? "w3" : "up_proj") + ".weight", {I, H}, HfTensor::Matrix});
    }
  }
  return out;
}

namespace {

// ---- the checkpoint's tokenizer -------------------------------------------

std::string read_whole(const fs::path& p) { return read_input(p.string(), "checkpoint file"); }

// An optional JSON file of the checkpoint: null when absent.
nlohmann::json read_json_opt(const fs::path& p) {
  if (!fs::exists(p)) return nullptr;
  try {
    return nlohmann::json::parse(read_whole(p));
  } catch (const nlohmann::json::exception& e) {
    throw Error(Status::Format, p.string() + ": not valid JSON (" + e.what() + ")");
  }
}

// The ids of an "eos_token_id" field: an int or a list of ints.
void ids_of(const nlohmann::json& j, const char* key, std::vector<int64_t>& out) {
  if (!j.is_object() || !j.contains(key)) return;
  const auto& v = j[key];
  if (v.is_number_integer()) out.push_back(v.get<int64_t>());
  if (v.is_array())
    for (const auto& x : v)
      if (x.is_number_integer()) out.push_back(x.get<int64_t>());
}

// The chat template transformers would load: chat_template.jinja beside
// tokenizer_config.json wins over the config's "chat_template" (a string, or a
// list of {name, template} whose "default" is used). "" when there is none or it
// cannot be stored (a warning says why). One outside docs/chat_templates.md's
// subset is kept: chat requests then fail naming the construct.
std::string read_chat_template(const fs::path& dir, const nlohmann::json& tc) {
  std::string tmpl;
  std::string from;
  const fs::path file = dir / "chat_template.jinja";
  if (fs::exists(file)) {
    tmpl = read_whole(file);
    from = file.string();
  } else if (tc.is_object() && tc.contains("chat_template")) {
    from = (dir / "tokenizer_config.json").string();
    const auto& ct = tc["chat_template"];
    if (ct.is_string()) {
      tmpl = ct.get<std::string>();
    } else if (ct.is_array()) {
      bool found = false;
      for (const auto& e : ct)
        if (e.is_object() && e.contains("name") && e["name"] == "default" && e.contains("template") &&
            e["template"].is_string()) {
          tmpl = e["template"].get<std::string>();
          found = true;
          break;
        }
      if (!found) {
        spdlog::warn("{}: chat_template is a list without a template named 'default'; converting without a chat template",
                     from);
        return {};
      }
    } else if (!ct.is_null()) {
      throw Error(Status::Format, from + ": 'chat_template' is neither a string nor a list of {name, template}");
    }
  }
  if (tmpl.empty()) return {};
  if (tmpl.size() > kMaxChatTemplateBytes) {
    spdlog::warn("{}: the chat template is larger than 1 MiB; converting without it", from);
    return {};
  }
  try {
    (void)nlohmann::json(tmpl).dump();  // NOTE: the config is stored as JSON text, which must be UTF-8
  } catch (const nlohmann::json::exception&) {
    spdlog::warn("{}: the chat template is not valid UTF-8; converting without it", from);
    return {};
  }
  try {
    ChatTemplate parsed(tmpl);
  } catch (const Error& e) {
    spdlog::warn("{}: {}; the template is kept, but chat requests will be refused", from, e.what());
  }
  return tmpl;
}

// transformers' special_tokens_map: tokenizer_config.json's named special tokens
// (a string or an AddedToken {"content": ...}), special_tokens_map.json's winning.
std::vector<std::pair<std::string, std::string>> read_special_tokens(const fs::path& dir, const nlohmann::json& tc) {
  const nlohmann::json stm = read_json_opt(dir / "special_tokens_map.json");
  std::vector<std::pair<std::string, std::string>> out;
  for (const std::string& name : chat_special_token_names()) {
    std::string content;
    for (const nlohmann::json* src : {&tc, &stm}) {
      if (!src->is_object() || !src->contains(name)) continue;
      const auto& v = (*src)[name];
      if (v.is_string()) content = v.get<std::string>();
      else if (v.is_object() && v.contains("content") && v["content"].is_string()) content = v["content"].get<std::string>();
    }
    if (!content.empty() && content.size() <= 1024) out.emplace_back(name, content);
  }
  return out;
}

struct EmbeddedTokenizer {
  TokenizerSpec spec;
  std::string bytes;
};

// tokenizer.json (hf_json), else tokenizer.model (sentencepiece), with what
// tokenizer_config.json and generation_config.json add; nullopt when the
// checkpoint has neither file, or its tokenizer uses a component this build
// does not implement (a warning says so).
std::optional<EmbeddedTokenizer> read_tokenizer(const fs::path& dir, const nlohmann::json& hf, const ModelConfig& cfg) {
  EmbeddedTokenizer t;
  fs::path file;
  TokenizerKind kind;
  if (fs::exists(dir / "tokenizer.json")) {
    file = dir / "tokenizer.json";
    kind = TokenizerKind::HfJson;
  } else if (fs::exists(dir / "tokenizer.model")) {
    file = dir / "tokenizer.model";
    kind = TokenizerKind::SentencePiece;
  } else {
    spdlog::info("{} has no tokenizer.json or tokenizer.model: converting without a tokenizer", dir.string());
    return std::nullopt;
  }
  t.bytes = read_whole(file);
  if (t.bytes.empty()) throw Error(Status::Format, file.string() + " is empty");
  if (t.bytes.size() > kMaxTokenizerBytes) throw Error(Status::Format, file.string() + " is larger than 1 GiB");
  t.spec.kind = tokenizer_kind_name(kind);
  const nlohmann::json tc = read_json_opt(dir / "tokenizer_config.json");
  const nlohmann::json gc = read_json_opt(dir / "generation_config.json");
  if (tc.is_object()) {
    if (tc.contains("add_bos_token") && tc["add_bos_token"].is_boolean()) t.spec.add_bos = tc["add_bos_token"].get<bool>();
    if (tc.contains("add_eos_token") && tc["add_eos_token"].is_boolean()) t.spec.add_eos = tc["add_eos_token"].get<bool>();
    if (tc.contains("legacy") && tc["legacy"].is_boolean()) t.spec.legacy = tc["legacy"].get<bool>();
  }
  t.spec.chat_template = read_chat_template(dir, tc);
  t.spec.special_tokens = read_special_tokens(dir, tc);
  std::unique_ptr<Tokenizer> tok;
  auto load = [&] {
    try {
      tok = Tokenizer::load(kind, t.bytes, tokenizer_options(t.spec));
    } catch (const Error& e) {
      throw Error(e.status(), file.string() + ": " + e.what());
    }
  };
  try {
    load();
    // Special tokens tokenizer_config.json declares that the file lacks.
    if (tc.is_object() && tc.contains("added_tokens_decoder") && tc["added_tokens_decoder"].is_object()) {
      for (const auto& [key, v] : tc["added_tokens_decoder"].items()) {
        if (!v.is_object() || !v.contains("content") || !v["content"].is_string()) continue;
        if (v.contains("special") && v["special"].is_boolean() && !v["special"].get<bool>()) continue;
        int64_t id = -1;
        try {
          id = std::stoll(key);
        } catch (const std::exception&) {
          continue;
        }
        const std::string content = v["content"].get<std::string>();
        auto have = tok->token_id(content);
        if (have && *have == id) continue;
        if (id < 0 || id >= cfg.vocab_size)
          throw Error(Status::Format, (dir / "tokenizer_config.json").string() + ": special token '" + content +
                                          "' has id " + std::to_string(id) + ", outside the model's vocabulary of " +
                                          std::to_string(cfg.vocab_size));
        t.spec.extra_special.emplace_back(id, content);
      }
      if (!t.spec.extra_special.empty()) load();
    }
  } catch (const Error& e) {
    if (e.status() != Status::Unsupported) throw;
    spdlog::warn("{}; converting without a tokenizer", e.what());
    return std::nullopt;
  }
  t.spec.vocab_size = tok->vocab_size();
  if (t.spec.vocab_size > cfg.vocab_size)
    throw Error(Status::Format, file.string() + ": the tokenizer has " + std::to_string(t.spec.vocab_size) +
                                    " ids (max id " + std::to_string(t.spec.vocab_size - 1) +
                                    ") but the model's vocab_size is " + std::to_string(cfg.vocab_size) +
                                    "; its ids would be outside the embedding table (convert with --no-tokenizer to "
                                    "leave it out)");
  // End of sequence: config.json's and generation_config.json's eos_token_id
  // (each an int or a list) and tokenizer_config.json's eos_token.
  std::vector<int64_t> eos;
  ids_of(hf, "eos_token_id", eos);
  ids_of(gc, "eos_token_id", eos);
  if (tc.is_object() && tc.contains("eos_token")) {
    const auto& e = tc["eos_token"];
    std::string content;
    if (e.is_string()) content = e.get<std::string>();
    else if (e.is_object() && e.contains("content") && e["content"].is_string()) content = e["content"].get<std::string>();
    if (!content.empty())
      if (auto id = tok->token_id(content)) eos.push_back(*id);
  }
  for (int64_t id : eos) {
    if (id < 0 || id >= cfg.vocab_size) {
      spdlog::warn("end-of-sequence id {} is outside the vocabulary of {}; ignored", id, cfg.vocab_size);
      continue;
    }
    if (std::find(t.spec.eos_token_ids.begin(), t.spec.eos_token_ids.end(), id) == t.spec.eos_token_ids.end())
      t.spec.eos_token_ids.push_back(id);
  }
  return t;
}

}  // namespace

ConvertResult convert_checkpoint(const std::string& hf_dir, const std::string& out_path, const ConvertOptions& opts) {
  fs::path cfg_path = fs::path(hf_dir) / "config.json";
  if (!fs::exists(cfg_path)) throw Error(Status::Io, "'" + hf_dir + "' has no config.json");
  nlohmann::json hf;
  const std::string cfg_text = read_input(cfg_path.string(), "config.json");
  try {
    hf = nlohmann::json::parse(cfg_text);
  } catch (const nlohmann::json::exception& e) {
    throw Error(Status::Format, cfg_path.string() + ": not valid JSON (" + e.what() + ")");
  }
  ModelConfig cfg = ModelConfig::from_hf(hf);
  // NOTE: checked before anything is read or written; the messages name the option.
  const int64_t qgroup = opts.group_size;
  if ((opts.expert_quant != QuantType::None || opts.dense_quant != QuantType::None) && !quant_group_supported(qgroup))
    throw Error(Status::InvalidArgument, "--group-size " + std::to_string(qgroup) + " is not supported (supported: 16, 32, 64, 128)");
  if (opts.expert_quant != QuantType::None) {
    if (cfg.hidden_size % qgroup != 0)
      throw Error(Status::InvalidArgument, "--group-size " + std::to_string(qgroup) + " does not divide hidden_size " +
                                               std::to_string(cfg.hidden_size));
    if (cfg.intermediate_size % qgroup != 0)
      throw Error(Status::InvalidArgument, "--group-size " + std::to_string(qgroup) + " does not divide intermediate_size " +
                                               std::to_string(cfg.intermediate_size));
    cfg.expert_quant.type = quant_type_name(opts.expert_quant);
    cfg.expert_quant.group_size = qgroup;
  }
  if (opts.dense_quant != QuantType::None) {
    cfg.dense_quant.type = quant_type_name(opts.dense_quant);
    cfg.dense_quant.group_size = qgroup;
  }
  Checkpoint ck(hf_dir);
  {
    // NOTE: before anything is read or written: OUT must not be one of the
    // files the conversion reads, nor a device or FIFO that the rename would replace.
    std::vector<std::string> inputs = ck.files();
    for (const char* f : {"config.json", "generation_config.json", "tokenizer.json", "tokenizer.model",
                          "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"})
      inputs.push_back((fs::path(hf_dir) / f).string());
    check_output(out_path, inputs, "convert: output");
  }
  // Non-finite weights are refused (unless allowed) naming the tensor and element.
  auto finite = [&](const void* data, DType t, size_t n, const std::string& what) {
    if (opts.allow_non_finite) return;
    const int64_t i = find_non_finite(data, t, n);
    if (i < 0) return;
    float v = 0;
    convert_elements(static_cast<const uint8_t*>(data) + static_cast<size_t>(i) * dtype_size(t), t, &v, DType::F32, 1);
    throw Error(Status::Numerical, what + ": element " + std::to_string(i) + " is " + std::to_string(v) +
                                       (t != DType::F32 ? " in " + std::string(dtype_name(t)) + " storage" : std::string()) +
                                       "; a model with non-finite weights gives NaN logits (--allow-non-finite converts it anyway)");
  };

  const SafeTensor& embd = expect(ck, "model.embed_tokens.weight", {cfg.vocab_size, cfg.hidden_size});
  const DType dtype = opts.dtype.value_or(*embd.dtype);
  const int64_t H = cfg.hidden_size, I = cfg.intermediate_size, E = cfg.num_experts;
  std::vector<ColibriWriter::DenseTensor> dense;
  std::vector<DenseSource> sources;
  const auto specs = dense_tensor_specs(cfg);
  for (const auto& spec : specs) {
    dense.push_back({spec.name, spec.is_norm ? DType::F32 : dtype, spec.shape});
    if (dense_storage(cfg, spec) != QuantType::None) {
      dense.back().quant = opts.dense_quant;
      dense.back().group = qgroup;
    }
    sources.push_back(dense_source(ck, cfg, spec.name));
    expect(ck, sources.back().name, source_shape(cfg, spec, sources.back()));  // fail before writing anything
  }
  if (opts.dense_quant != QuantType::None &&
      std::none_of(dense.begin(), dense.end(), [](const auto& d) { return d.quant != QuantType::None; }))
    throw Error(Status::InvalidArgument, "--quantize-dense with --group-size " + std::to_string(qgroup) +
                                             " would quantise no matrix: the group divides none of their input widths");

  // Experts come in one of four layouts:
  //  classic: per expert w1 (gate), w3 (up), w2 (down) (Mixtral), or
  //           mlp.experts.<e>.{gate,up,down}_proj.weight (the other families);
  //  fused:   mlp.experts.gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I];
  //  gpt-oss: mlp.experts.gate_up_proj [E, H, 2I] (gate in even columns, up in odd),
  //           gate_up_proj_bias [E, 2I], down_proj [E, I, H], down_proj_bias [E, H];
  //  MXFP4:   gpt-oss's released form, *_blocks / *_scales (see docs/models.md).
  const bool oss = cfg.architecture == "gpt_oss";
  auto L = [](int l) { return "model.layers." + std::to_string(l) + "."; };
  auto classic = [&](int l, int e, const char* w) {
    if (cfg.architecture == "mixtral")
      return L(l) + "block_sparse_moe.experts." + std::to_string(e) + "." + w + ".weight";
    return L(l) + "mlp.experts." + std::to_string(e) + "." + w + ".weight";
  };
  const char* wg = cfg.architecture == "mixtral" ? "w1" : "gate_proj";
  const char* wu = cfg.architecture == "mixtral" ? "w3" : "up_proj";
  const char* wd = cfg.architecture == "mixtral" ? "w2" : "down_proj";
  auto fused = [&](int l, const char* w) { return L(l) + "mlp.experts." + w; };
  enum class Layout { Classic, Fused, Oss, Mxfp4 } layout = Layout::Classic;
  const int first_moe = static_cast<int>(cfg.moe_layers.front());
  if (oss)
    layout = ck.find(fused(first_moe, "gate_up_proj_blocks")) ? Layout::Mxfp4 : Layout::Oss;
  else if (!ck.find(classic(first_moe, 0, wg)) && ck.find(fused(first_moe, "gate_up_proj")))
    layout = Layout::Fused;
  if (layout == Layout::Mxfp4 && (H % 32 != 0 || I % 32 != 0))
    throw Error(Status::Format, "MXFP4 experts need hidden_size and intermediate_size to be multiples of 32");

  auto check_interrupt = [&] {
    if (opts.interrupt && opts.interrupt->load() != 0)
      throw Error(Status::Cancelled, "conversion interrupted (signal " + std::to_string(opts.interrupt->load()) + "); '" +
                                         out_path + "' was not written");
  };
  std::optional<EmbeddedTokenizer> tokenizer;
  if (opts.tokenizer) tokenizer = read_tokenizer(fs::path(hf_dir), hf, cfg);
  std::vector<ColibriWriter::DenseTensor> records = dense;
  if (tokenizer) {
    cfg.tokenizer = tokenizer->spec;
    ColibriWriter::DenseTensor tr;
    tr.name = kTokenizerRecord;
    tr.dtype = DType::F32;
    tr.shape = {static_cast<int64_t>(tokenizer->bytes.size())};
    tr.raw = true;
    records.push_back(tr);
  }
  ColibriWriter w(out_path, cfg, records, dtype);
  // Progress counts the bytes of tensor and expert data (not metadata or padding).
  uint64_t total = static_cast<uint64_t>(cfg.num_moe_layers() * E) * w.layout().size;
  for (const auto& d : records) total += d.bytes();
  uint64_t done = 0;
  ConvertResult res;
  std::vector<uint8_t> buf;
  std::vector<float> f32;
  for (size_t i = 0; i < dense.size(); ++i) {
    check_interrupt();
    const SafeTensor& src = ck.get(sources[i].name);
    size_t n = 1;
    for (auto x : dense[i].shape) n *= static_cast<size_t>(x);
    buf.resize(dense[i].bytes());
    if (dense[i].quant != QuantType::None) {
      // Row by row from f32: codes [rows][row bytes], then the f16 scales.
      const QuantType qt = dense[i].quant;
      const int64_t rows = dense[i].shape[0], cols = dense[i].shape[1], qg = dense[i].group;
      const QuantMatrixLayout ql = quant_matrix_layout(qt, rows, cols, qg);
      f32.resize(n);
      convert_elements(src.data, *src.dtype, f32.data(), DType::F32, n);
      std::fill(buf.begin(), buf.end(), uint8_t{0});
      auto* scales = reinterpret_cast<uint16_t*>(buf.data() + ql.scales_offset);
      for (int64_t r = 0; r < rows; ++r)
        if (!quantize_row(qt, qg, f32.data() + r * cols, cols, buf.data() + r * quant_row_bytes(qt, cols),
                          scales + r * (cols / qg)))
          throw Error(Status::Format, dense[i].name + " row " + std::to_string(r) +
                                          " has a non-finite weight or a group scale beyond the f16 range; it cannot be quantised");
      ++res.dense_quantised;
    } else if (sources[i].kind == DenseSource::Direct) {
      convert_elements(src.data, *src.dtype, buf.data(), dense[i].dtype, n);
      finite(buf.data(), dense[i].dtype, n, "tensor " + dense[i].name);
    } else {
      // kv_b_proj [nh * (nope + v), R]: head h's rows [0, nope) are W_uk[h],
      // rows [nope, nope + v) are W_uv[h]. attn_k_b stores W_uk[h]^T ([R, nope]),
      // attn_v_b stores W_uv[h] ([v, R]).
      const int64_t nh = cfg.num_heads, nope = cfg.qk_nope_head_dim, vd = cfg.v_head_dim, R = cfg.kv_lora_rank;
      std::vector<float> all(static_cast<size_t>(src.numel()));
      read_f32(src, 0, all.size(), all.data());
      f32.resize(n);
      for (int64_t h = 0; h < nh; ++h) {
        const float* head = all.data() + h * (nope + vd) * R;
        if (sources[i].kind == DenseSource::KvbK) {
          for (int64_t r = 0; r < R; ++r)
            for (int64_t j = 0; j < nope; ++j) f32[static_cast<size_t>((h * R + r) * nope + j)] = head[j * R + r];
        } else {
          std::copy(head + nope * R, head + (nope + vd) * R, f32.begin() + h * vd * R);
        }
      }
      convert_elements(f32.data(), DType::F32, buf.data(), dense[i].dtype, n);
      finite(buf.data(), dense[i].dtype, n, "tensor " + dense[i].name + " (from " + sources[i].name + ")");
    }
    w.write_dense(i, buf.data(), buf.size());
    ck.check_unchanged();
    release_mapped_pages(src.data, src.nbytes);  // NOTE: keeps peak memory at about one tensor
    done += buf.size();
    ++res.tensors;
    if (opts.progress) opts.progress(done, total, dense[i].name);
  }

  if (tokenizer) {
    w.write_dense(dense.size(), tokenizer->bytes.data(), tokenizer->bytes.size());
    done += tokenizer->bytes.size();
    res.tokenizer_kind = tokenizer->spec.kind;
    res.tokenizer_vocab = tokenizer->spec.vocab_size;
    res.tokenizer_bytes = tokenizer->bytes.size();
    if (opts.progress) opts.progress(done, total, kTokenizerRecord);
  }

  const ExpertLayout& lay = w.layout();
  const size_t mat = static_cast<size_t>(I * H);
  std::vector<float> g(mat), u(mat), dn(mat), gb(static_cast<size_t>(I)), ub(static_cast<size_t>(I)), db(static_cast<size_t>(H));
  std::vector<float> row(static_cast<size_t>(std::max(2 * I, H)));
  for (int m = 0; m < cfg.num_moe_layers(); ++m) {
    const int l = static_cast<int>(cfg.moe_layers[static_cast<size_t>(m)]);
    const SafeTensor *gu = nullptr, *dw = nullptr, *gub = nullptr, *dwb = nullptr, *gus = nullptr, *dws = nullptr;
    switch (layout) {
      case Layout::Fused:
        gu = &expect(ck, fused(l, "gate_up_proj"), {E, 2 * I, H});
        dw = &expect(ck, fused(l, "down_proj"), {E, H, I});
        break;
      case Layout::Oss:
        gu = &expect(ck, fused(l, "gate_up_proj"), {E, H, 2 * I});
        dw = &expect(ck, fused(l, "down_proj"), {E, I, H});
        break;
      case Layout::Mxfp4:
        gu = &expect_u8(ck, fused(l, "gate_up_proj_blocks"), {E, 2 * I, H / 32, 16});
        gus = &expect_u8(ck, fused(l, "gate_up_proj_scales"), {E, 2 * I, H / 32});
        dw = &expect_u8(ck, fused(l, "down_proj_blocks"), {E, H, I / 32, 16});
        dws = &expect_u8(ck, fused(l, "down_proj_scales"), {E, H, I / 32});
        break;
      case Layout::Classic:
        break;
    }
    if (oss) {
      gub = &expect(ck, fused(l, "gate_up_proj_bias"), {E, 2 * I});
      dwb = &expect(ck, fused(l, "down_proj_bias"), {E, H});
    }
    for (int e = 0; e < E; ++e) {
      check_interrupt();
      std::vector<const SafeTensor*> used;
      switch (layout) {
        case Layout::Classic: {
          const SafeTensor& a = expect(ck, classic(l, e, wg), {I, H});
          const SafeTensor& b = expect(ck, classic(l, e, wu), {I, H});
          const SafeTensor& c = expect(ck, classic(l, e, wd), {H, I});
          read_f32(a, 0, mat, g.data());
          read_f32(b, 0, mat, u.data());
          read_f32(c, 0, mat, dn.data());
          used = {&a, &b, &c};
          break;
        }
        case Layout::Fused: {
          const size_t base = static_cast<size_t>(e) * 2 * mat;
          read_f32(*gu, base, mat, g.data());
          read_f32(*gu, base + mat, mat, u.data());
          read_f32(*dw, static_cast<size_t>(e) * mat, mat, dn.data());
          break;
        }
        case Layout::Oss: {
          // [H, 2I] -> gate [I, H] (even columns), up [I, H] (odd columns); down [I, H] -> [H, I].
          for (int64_t h = 0; h < H; ++h) {
            read_f32(*gu, static_cast<size_t>((e * H + h) * 2 * I), static_cast<size_t>(2 * I), row.data());
            for (int64_t i = 0; i < I; ++i) {
              g[static_cast<size_t>(i * H + h)] = row[static_cast<size_t>(2 * i)];
              u[static_cast<size_t>(i * H + h)] = row[static_cast<size_t>(2 * i + 1)];
            }
          }
          for (int64_t i = 0; i < I; ++i) {
            read_f32(*dw, static_cast<size_t>((e * I + i) * H), static_cast<size_t>(H), row.data());
            for (int64_t h = 0; h < H; ++h) dn[static_cast<size_t>(h * I + i)] = row[static_cast<size_t>(h)];
          }
          break;
        }
        case Layout::Mxfp4: {
          // Dequantised rows [2I, H] of which even rows are the gate's, odd the up's;
          // down rows [H, I] as stored.
          for (int64_t j = 0; j < 2 * I; ++j)
            mxfp4_row(*gu, *gus, e * 2 * I + j, H, (j % 2 == 0 ? g.data() : u.data()) + (j / 2) * H);
          for (int64_t h = 0; h < H; ++h) mxfp4_row(*dw, *dws, e * H + h, I, dn.data() + h * I);
          break;
        }
      }
      buf.assign(lay.size, 0);
      if (lay.quant == QuantType::None) {
        convert_elements(g.data(), DType::F32, buf.data() + lay.gate_offset, dtype, mat);
        convert_elements(u.data(), DType::F32, buf.data() + lay.up_offset, dtype, mat);
        convert_elements(dn.data(), DType::F32, buf.data() + lay.down_offset, dtype, mat);
        const std::string who = "layer " + std::to_string(l) + " expert " + std::to_string(e);
        finite(buf.data() + lay.gate_offset, dtype, mat, who + " gate");
        finite(buf.data() + lay.up_offset, dtype, mat, who + " up");
        finite(buf.data() + lay.down_offset, dtype, mat, who + " down");
      } else {
        // Row by row: codes [rows][row bytes], then f16 scales [rows][cols / group].
        auto quantize = [&](const float* src, int64_t rows, int64_t cols, uint64_t codes_off, uint64_t scales_off,
                            const char* which) {
          const uint64_t rb = quant_row_bytes(lay.quant, cols);
          const int64_t ng = cols / lay.quant_group;
          for (int64_t r = 0; r < rows; ++r) {
            uint16_t* sc = reinterpret_cast<uint16_t*>(buf.data() + scales_off) + r * ng;
            if (!quantize_row(lay.quant, lay.quant_group, src + r * cols, cols, buf.data() + codes_off + r * rb, sc))
              throw Error(Status::Format, "layer " + std::to_string(l) + " expert " + std::to_string(e) + ": " + which +
                                              " row " + std::to_string(r) +
                                              " has a non-finite weight or a group scale beyond the f16 range; "
                                              "it cannot be quantised");
          }
        };
        quantize(g.data(), I, H, lay.gate_offset, lay.gate_scale_offset, "gate");
        quantize(u.data(), I, H, lay.up_offset, lay.up_scale_offset, "up");
        quantize(dn.data(), H, I, lay.down_offset, lay.down_scale_offset, "down");
      }
      if (lay.has_bias) {
        read_f32(*gub, static_cast<size_t>(e * 2 * I), static_cast<size_t>(2 * I), row.data());
        for (int64_t i = 0; i < I; ++i) gb[static_cast<size_t>(i)] = row[static_cast<size_t>(2 * i)], ub[static_cast<size_t>(i)] = row[static_cast<size_t>(2 * i + 1)];
        read_f32(*dwb, static_cast<size_t>(e * H), static_cast<size_t>(H), db.data());
        std::memcpy(buf.data() + lay.gate_bias_offset, gb.data(), gb.size() * sizeof(float));
        std::memcpy(buf.data() + lay.up_bias_offset, ub.data(), ub.size() * sizeof(float));
        std::memcpy(buf.data() + lay.down_bias_offset, db.data(), db.size() * sizeof(float));
        const std::string who = "layer " + std::to_string(l) + " expert " + std::to_string(e);
        finite(gb.data(), DType::F32, gb.size(), who + " gate bias");
        finite(ub.data(), DType::F32, ub.size(), who + " up bias");
        finite(db.data(), DType::F32, db.size(), who + " down bias");
      }
      w.write_expert(m, e, buf.data(), buf.size());
      for (const SafeTensor* x : used) release_mapped_pages(x->data, x->nbytes);
      done += buf.size();
      ++res.experts;
      if (opts.progress) opts.progress(done, total, "layer " + std::to_string(l) + " expert " + std::to_string(e));
    }
    for (const SafeTensor* x : {gu, dw, gub, dwb, gus, dws})
      if (x) release_mapped_pages(x->data, x->nbytes);
    ck.check_unchanged();
  }
  // NOTE: a shard truncated while it was read gave zeros (mapped_file.h): never commit those.
  ck.check_unchanged();
  w.finish();
  res.bytes = w.total_bytes();
  res.dtype = dtype;
  res.expert_quant = lay.quant;
  res.dense_quant = opts.dense_quant;
  res.group_size = (lay.quant != QuantType::None || opts.dense_quant != QuantType::None) ? qgroup : 0;
  return res;
}

}  // namespace colibri
