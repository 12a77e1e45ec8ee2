// cmd_inspect.cpp: colibri inspect FILE [--verify] [--json]
#include <spdlog/spdlog.h>

#include <cstdio>
#include <nlohmann/json.hpp>

#include "launcher/commands.h"
#include "model/colibri_file.h"
#include "model/error.h"
#include "model/printable.h"

namespace colibri::cli {

namespace {
// The experts' storage: a dtype, or "int8 g32" etc. for quantised experts.
std::string expert_storage(const ColibriFile& f) {
  const ModelConfig& c = f.config();
  if (c.expert_quant.type != "none") return c.expert_quant.type + " g" + std::to_string(c.expert_quant.group_size);
  return dtype_name(f.expert_dtype());
}
// A dense tensor's storage: its dtype, or "int8 g32" etc. when quantised.
std::string tensor_storage(const TensorView& t) {
  if (t.quant != QuantType::None) return std::string(quant_type_name(t.quant)) + " g" + std::to_string(t.quant_group);
  return dtype_name(t.dtype);
}
std::string fmt_g(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", v);
  return b;
}
}  // namespace

namespace {
std::string hex64(uint64_t v) {
  char b[20];
  std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(v));
  return b;
}
// Every string in `j` (keys too) printable(): a file's strings may hold any byte,
// and nlohmann::json refuses to dump invalid UTF-8.
nlohmann::json printable_json(const nlohmann::json& j) {
  if (j.is_string()) return printable(j.get_ref<const std::string&>());
  if (j.is_array()) {
    nlohmann::json a = nlohmann::json::array();
    for (const auto& x : j) a.push_back(printable_json(x));
    return a;
  }
  if (j.is_object()) {
    nlohmann::json o = nlohmann::json::object();
    for (auto it = j.begin(); it != j.end(); ++it) o[printable(it.key())] = printable_json(it.value());
    return o;
  }
  return j;
}
std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}
}  // namespace

int cmd_inspect(int argc, char** argv) {
  cxxopts::Options o("colibri inspect", "Show a .colibri file: config, tensors, expert index, sizes, checksums.");
  o.add_options()("file", ".colibri file", cxxopts::value<std::string>())(
      "verify", "Check the checksum of every tensor and expert block")("json", "Print JSON instead of text")(
      "experts", "List every expert block (text mode)");
  add_common_options(o);
  o.parse_positional({"file"});
  o.positional_help("FILE");
  auto r = o.parse(argc, argv);
  if (handle_common(o, r)) return 0;
  if (!r.count("file")) throw Error(Status::InvalidArgument, "inspect needs FILE (see colibri inspect --help)");
  const bool verify = r.count("verify") > 0, as_json = r.count("json") > 0;
  ColibriFile::Options fo;
  fo.verify_dense = false;  // --verify reports every mismatch below instead of stopping at the first
  auto f = ColibriFile::open(r["file"].as<std::string>(), fo);
  const auto& h = f->header();

  uint64_t dense_bytes = 0, expert_bytes = 0;
  int bad = 0;
  nlohmann::json jt = nlohmann::json::array(), je = nlohmann::json::array();
  std::vector<std::string> failures;
  for (const auto& t : f->tensors()) {
    dense_bytes += t.size;
    bool ok = true;
    if (verify) {
      try {
        f->verify_tensor(t);
      } catch (const Error& e) {
        ok = false;
        ++bad;
        failures.push_back(terminal_safe(e.what()));
      }
    }
    nlohmann::json x = {{"name", printable(t.name)}, {"dtype", tensor_storage(t)}, {"shape", t.shape},
                        {"offset", t.offset}, {"size", t.size}, {"checksum", hex64(t.checksum)}};
    if (verify) x["ok"] = ok;
    jt.push_back(x);
  }
  for (const auto& e : f->experts()) {
    expert_bytes += e.size;
    bool ok = true;
    if (verify) {
      try {
        f->verify_expert(e);
      } catch (const Error& err) {
        ok = false;
        ++bad;
        failures.push_back(terminal_safe(err.what()));
      }
    }
    nlohmann::json x = {{"layer", e.layer}, {"expert", e.expert}, {"dtype", expert_storage(*f)},
                        {"offset", e.offset}, {"size", e.size}, {"checksum", hex64(e.checksum)}};
    if (verify) x["ok"] = ok;
    je.push_back(x);
  }
  // The embedded tokenizer: its kind and ids from the config, its block here.
  nlohmann::json jtok = nullptr;
  if (const TensorView* tb = f->tokenizer_block()) {
    const TokenizerSpec& ts = f->config().tokenizer;
    bool ok = true;
    if (verify) {
      try {
        f->verify_tensor(*tb);
      } catch (const Error& e) {
        ok = false;
        ++bad;
        failures.push_back(terminal_safe(e.what()));
      }
    }
    jtok = {{"kind", printable(ts.kind)}, {"vocab_size", ts.vocab_size}, {"add_bos", ts.add_bos}, {"add_eos", ts.add_eos},
            {"eos_token_ids", ts.eos_token_ids}, {"extra_special", ts.extra_special.size()},
            {"offset", tb->offset}, {"size", tb->size}, {"checksum", hex64(tb->checksum)}};
    if (verify) jtok["ok"] = ok;
  }

  if (as_json) {
    nlohmann::json out = {
        {"file", printable(f->path())},
        {"format_version", h.version},
        {"file_size", f->file_size()},
        {"config", printable_json(f->config().to_json())},
        {"dense_bytes", dense_bytes},
        {"expert_bytes", expert_bytes},
        {"tensors", jt},
        {"experts", je},
        {"tokenizer", jtok},
    };
    if (verify) out["verified"] = {{"ok", bad == 0}, {"failures", failures}};
    // (printable() above leaves no invalid UTF-8; replace is the last resort, never an exception)
    std::printf("%s\n", out.dump(2, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  } else {
    const auto& c = f->config();
    // NOTE: every string from the file goes through printable(): no raw control bytes on the terminal.
    std::printf("file        %s\n", printable(f->path()).c_str());
    std::printf("format      colibri v%u, %.2f MiB (dense %.2f MiB, experts %.2f MiB)\n", h.version,
                f->file_size() / 1048576.0, dense_bytes / 1048576.0, expert_bytes / 1048576.0);
    std::printf("model       %s: %lld layers, hidden %lld, %lld heads (%lld kv, head_dim %lld), vocab %lld\n",
                printable(c.architecture).c_str(), (long long)c.num_layers, (long long)c.hidden_size, (long long)c.num_heads,
                (long long)c.num_kv_heads, (long long)c.head_dim, (long long)c.vocab_size);
    std::string routing = printable(c.routing.scoring);
    if (c.routing.group_select != "none")
      routing += ", groups " + std::to_string(c.routing.topk_group) + " of " + std::to_string(c.routing.n_group) + " by " +
                 printable(c.routing.group_select);
    if (c.routing.score_bias) routing += ", selection bias";
    if (c.routing.router_bias) routing += ", router bias";
    if (c.routing.norm_topk_prob) routing += ", renormalise top-k";
    if (c.routing.routed_scaling_factor != 1.0f) routing += ", scale " + fmt_g(c.routing.routed_scaling_factor);
    std::printf("moe         %lld experts, top-%lld, intermediate %lld, %s experts, routing %s, expert dtype %s\n",
                (long long)c.num_experts, (long long)c.experts_per_token, (long long)c.intermediate_size,
                c.expert_act == "silu" ? (c.expert_bias ? "SwiGLU+bias" : "SwiGLU") : "clamped-SwiGLU+bias (gpt-oss)",
                routing.c_str(), printable(expert_storage(*f)).c_str());
    if (c.dense_quant.type != "none")
      std::printf("dense       attention, dense/shared FFN and LM head matrices %s g%lld (embedding and routers as stored)\n",
                  printable(c.dense_quant.type).c_str(), (long long)c.dense_quant.group_size);
    std::printf("layers      %lld MoE of %lld", (long long)c.num_moe_layers(), (long long)c.num_layers);
    if (c.num_moe_layers() < c.num_layers) std::printf(" (dense MLP %lld elsewhere)", (long long)c.dense_intermediate_size);
    if (c.shared_intermediate_size > 0)
      std::printf(", shared expert %lld%s", (long long)c.shared_intermediate_size, c.shared_expert_gate ? " (sigmoid gate)" : "");
    std::printf("\n");
    std::string att = c.attention == "mla" ? "MLA (kv_lora_rank " + std::to_string(c.kv_lora_rank) + ", q_lora_rank " +
                                                 std::to_string(c.q_lora_rank) + ", nope/rope/v " +
                                                 std::to_string(c.qk_nope_head_dim) + "/" + std::to_string(c.qk_rope_head_dim) +
                                                 "/" + std::to_string(c.v_head_dim) + ")"
                                           : "GQA";
    if (c.qkv_bias) att += ", qkv bias";
    if (c.o_bias) att += ", o bias";
    if (c.qk_norm != "none") att += ", qk-norm " + printable(c.qk_norm);
    if (c.clip_qkv > 0) att += ", clip " + fmt_g(c.clip_qkv);
    if (c.attn_sinks) att += ", sinks";
    int sliding = 0;
    for (int64_t l = 0; l < c.num_layers; ++l) sliding += c.window(l) > 0;
    std::printf("attention   %s, rope_theta %g over %lld dims%s%s, context %lld, sliding window %lld on %d of %lld layers, "
                "rms_norm_eps %g, tied %s\n",
                att.c_str(), c.rope_theta, (long long)c.rope_dim, c.rope_interleaved ? " (interleaved)" : "",
                c.rope_scaling.type == "yarn" ? (" YaRN x" + fmt_g(c.rope_scaling.factor)).c_str() : "",
                (long long)c.max_position_embeddings, (long long)c.sliding_window, sliding, (long long)c.num_layers,
                c.rms_norm_eps, c.tie_word_embeddings ? "yes" : "no");
    if (const TensorView* tb = f->tokenizer_block()) {
      const TokenizerSpec& ts = c.tokenizer;
      std::string eos;
      for (auto id : ts.eos_token_ids) eos += (eos.empty() ? "" : ",") + std::to_string(id);
      std::printf("tokenizer   %s, vocab %lld, %llu bytes, add_bos %s, add_eos %s, eos ids [%s]%s\n", printable(ts.kind).c_str(),
                  (long long)ts.vocab_size, (unsigned long long)tb->size, ts.add_bos ? "yes" : "no",
                  ts.add_eos ? "yes" : "no", eos.c_str(),
                  ts.extra_special.empty() ? "" : (", " + std::to_string(ts.extra_special.size()) + " extra special").c_str());
      if (!ts.chat_template.empty())
        std::printf("chat        template of %zu bytes (docs/chat_templates.md)\n", ts.chat_template.size());
    } else {
      std::printf("tokenizer   none (token ids only)\n");
    }
    std::printf("\n%-32s %-8s %-16s %12s %12s %s\n", "tensor", "dtype", "shape", "offset", "bytes", "checksum");
    for (const auto& t : f->tensors())
      std::printf("%-32s %-8s %-16s %12llu %12llu %s\n", printable(t.name).c_str(), tensor_storage(t).c_str(), shape_str(t.shape).c_str(),
                  (unsigned long long)t.offset, (unsigned long long)t.size, hex64(t.checksum).c_str());
    std::printf("\nexpert index: %zu blocks of %llu bytes\n", f->experts().size(),
                (unsigned long long)f->experts().front().size);
    if (r.count("experts"))
      for (const auto& e : f->experts())
        std::printf("  layer %3d expert %4d offset %12llu checksum %s\n", e.layer, e.expert,
                    (unsigned long long)e.offset, hex64(e.checksum).c_str());
    if (verify) {
      for (const auto& m : failures) std::printf("FAIL %s\n", m.c_str());
      std::printf("verify: %s (%zu tensors, %zu expert blocks%s, %d mismatches)\n", bad ? "FAILED" : "ok",
                  f->tensors().size(), f->experts().size(), f->has_tokenizer() ? ", tokenizer" : "", bad);
    }
  }
  return bad ? exit_code(Status::Checksum) : 0;
}

}  // namespace colibri::cli
