// converter.cpp: maps a Hugging Face Mixtral checkpoint's tensors onto the
// .colibri layout, converting dtypes one tensor at a time.
#include "model/converter.h"

#include <filesystem>
#include <fstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/colibri_file.h"
#include "model/config.h"
#include "model/error.h"
#include "model/safetensors.h"

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

// Where each canonical dense tensor comes from in a Mixtral checkpoint.
std::string hf_dense_name(const Checkpoint& ck, const std::string& canon) {
  if (canon == tname::token_embd()) return "model.embed_tokens.weight";
  if (canon == tname::output_norm()) return "model.norm.weight";
  if (canon == tname::output()) return "lm_head.weight";
  // blk.{l}.{what}
  size_t dot1 = canon.find('.'), dot2 = canon.find('.', dot1 + 1);
  std::string l = canon.substr(dot1 + 1, dot2 - dot1 - 1), what = canon.substr(dot2 + 1);
  std::string p = "model.layers." + l + ".";
  if (what == "attn_norm") return p + "input_layernorm.weight";
  if (what == "ffn_norm") return p + "post_attention_layernorm.weight";
  if (what == "attn_q") return p + "self_attn.q_proj.weight";
  if (what == "attn_k") return p + "self_attn.k_proj.weight";
  if (what == "attn_v") return p + "self_attn.v_proj.weight";
  if (what == "attn_output") return p + "self_attn.o_proj.weight";
  if (what == "ffn_gate_inp") {
    // transformers < 5 names the sparse block block_sparse_moe, 5.x names it mlp.
    std::string classic = p + "block_sparse_moe.gate.weight";
    return ck.find(classic) ? classic : p + "mlp.gate.weight";
  }
  throw Error(Status::Internal, "no source for tensor " + canon);
}

// Copies `n` elements of `src` (any supported dtype) into `dst` as `to`.
void convert_into(const SafeTensor& src, size_t first, size_t n, uint8_t* dst, DType to) {
  convert_elements(src.data + first * dtype_size(*src.dtype), *src.dtype, dst, to, n);
}

}  // namespace

ConvertResult convert_checkpoint(const std::string& hf_dir, const std::string& out_path, const ConvertOptions& opts) {
  fs::path cfg_path = fs::path(hf_dir) / "config.json";
  if (!fs::exists(cfg_path)) throw Error(Status::Io, "'" + hf_dir + "' has no config.json");
  nlohmann::json hf;
  try {
    std::ifstream in(cfg_path);
    hf = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw Error(Status::Format, cfg_path.string() + ": not valid JSON (" + e.what() + ")");
  }
  ModelConfig cfg = ModelConfig::from_hf(hf);
  Checkpoint ck(hf_dir);

  const SafeTensor& embd = expect(ck, "model.embed_tokens.weight", {cfg.vocab_size, cfg.hidden_size});
  const DType dtype = opts.dtype.value_or(*embd.dtype);
  const int64_t H = cfg.hidden_size, I = cfg.intermediate_size, E = cfg.num_experts;
  std::vector<ColibriWriter::DenseTensor> dense;
  std::vector<std::string> sources;
  for (const auto& spec : dense_tensor_specs(cfg)) {
    dense.push_back({spec.name, spec.is_norm ? DType::F32 : dtype, spec.shape});
    sources.push_back(hf_dense_name(ck, spec.name));
    expect(ck, sources.back(), spec.shape);  // fail before writing anything
  }

  // Experts: per-expert w1 (gate), w3 (up), w2 (down), or fused 3-D tensors.
  auto classic = [&](int l, int e, const char* w) {
    return "model.layers." + std::to_string(l) + ".block_sparse_moe.experts." + std::to_string(e) + "." + w + ".weight";
  };
  auto fused = [&](int l, const char* w) { return "model.layers." + std::to_string(l) + ".mlp.experts." + w; };
  const bool is_fused = !ck.find(classic(0, 0, "w1")) && ck.find(fused(0, "gate_up_proj"));

  auto check_interrupt = [&] {
    if (opts.interrupt && opts.interrupt->load() != 0)
      throw Error(Status::Cancelled, "conversion interrupted (signal " + std::to_string(opts.interrupt->load()) + "); '" +
                                         out_path + "' was not written");
  };
  ColibriWriter w(out_path, cfg, dense, dtype);
  // Progress counts the bytes of tensor and expert data (not metadata or padding).
  uint64_t total = static_cast<uint64_t>(cfg.num_layers * E) * w.layout().size;
  for (const auto& d : dense) {
    uint64_t n = dtype_size(d.dtype);
    for (auto x : d.shape) n *= static_cast<uint64_t>(x);
    total += n;
  }
  uint64_t done = 0;
  ConvertResult res;
  std::vector<uint8_t> buf;
  for (size_t i = 0; i < dense.size(); ++i) {
    check_interrupt();
    const SafeTensor& src = ck.get(sources[i]);
    const size_t n = static_cast<size_t>(src.numel());
    buf.resize(n * dtype_size(dense[i].dtype));
    convert_into(src, 0, n, buf.data(), dense[i].dtype);
    w.write_dense(i, buf.data(), buf.size());
    release_mapped_pages(src.data, src.nbytes);  // NOTE: keeps peak memory at about one tensor
    done += buf.size();
    ++res.tensors;
    if (opts.progress) opts.progress(done, total, dense[i].name);
  }

  const ExpertLayout& lay = w.layout();
  const size_t mat = static_cast<size_t>(I * H);
  for (int l = 0; l < cfg.num_layers; ++l) {
    const SafeTensor *gu = nullptr, *dn = nullptr;
    if (is_fused) {
      // NOTE: transformers 5 stores gate_up_proj as [E, 2*I, H] with the gate
      // rows first, and down_proj as [E, H, I].
      gu = &expect(ck, fused(l, "gate_up_proj"), {E, 2 * I, H});
      dn = &expect(ck, fused(l, "down_proj"), {E, H, I});
    }
    for (int e = 0; e < E; ++e) {
      check_interrupt();
      // Where this expert's gate, up and down matrices start in the checkpoint.
      struct Src { const SafeTensor* t; size_t first; };
      Src src[3];
      if (is_fused) {
        const size_t base = static_cast<size_t>(e) * 2 * mat;
        src[0] = {gu, base};
        src[1] = {gu, base + mat};
        src[2] = {dn, static_cast<size_t>(e) * mat};
      } else {
        src[0] = {&expect(ck, classic(l, e, "w1"), {I, H}), 0};
        src[1] = {&expect(ck, classic(l, e, "w3"), {I, H}), 0};
        src[2] = {&expect(ck, classic(l, e, "w2"), {H, I}), 0};
      }
      const uint64_t dst[3] = {lay.gate_offset, lay.up_offset, lay.down_offset};
      buf.assign(lay.size, 0);
      for (int m = 0; m < 3; ++m) convert_into(*src[m].t, src[m].first, mat, buf.data() + dst[m], dtype);
      w.write_expert(l, e, buf.data(), buf.size());
      if (!is_fused)
        for (const Src& x : src) release_mapped_pages(x.t->data, x.t->nbytes);
      done += buf.size();
      ++res.experts;
      if (opts.progress) opts.progress(done, total, "layer " + std::to_string(l) + " expert " + std::to_string(e));
    }
    if (is_fused) {
      release_mapped_pages(gu->data, gu->nbytes);
      release_mapped_pages(dn->data, dn->nbytes);
    }
  }
  w.finish();
  res.bytes = w.total_bytes();
  res.dtype = dtype;
  return res;
}

}  // namespace colibri
