// cmd_generate.cpp: colibri generate --model FILE --prompt-ids 1,2,3 [...]
#include <spdlog/spdlog.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <sstream>

#include "comm/communicator.h"
#include "coordinator/engine.h"
#include "kernels/cpu/kernels.h"
#include "launcher/commands.h"
#include "model/colibri_file.h"
#include "model/error.h"
#include "model/npy.h"

namespace colibri::cli {

namespace {

std::vector<int32_t> parse_ids(const std::string& s) {
  std::vector<int32_t> ids;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t a = item.find_first_not_of(" \t"), b = item.find_last_not_of(" \t");
    if (a == std::string::npos) throw Error(Status::InvalidArgument, "empty token id in --prompt-ids '" + s + "'");
    item = item.substr(a, b - a + 1);
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != item.size() || v < std::numeric_limits<int32_t>::min() || v > std::numeric_limits<int32_t>::max())
      throw Error(Status::InvalidArgument, "'" + item + "' in --prompt-ids is not a token id");
    ids.push_back(static_cast<int32_t>(v));
  }
  if (ids.empty()) throw Error(Status::InvalidArgument, "--prompt-ids '" + s + "' holds no token ids");
  return ids;
}

}  // namespace

int cmd_generate(int argc, char** argv) {
  cxxopts::Options o("colibri generate",
                     "Generate tokens from one or more prompts of token ids in one process (CPU backend,\n"
                     "in-process communicator). Sequence i samples with seed + i.");
  o.add_options()("m,model", ".colibri model file", cxxopts::value<std::string>())(
      "p,prompt-ids", "Comma-separated token ids; repeat for a batch", cxxopts::value<std::vector<std::string>>())(
      "n,max-new-tokens", "Tokens to generate per prompt", cxxopts::value<int32_t>()->default_value("16"))(
      "temperature", "Sampling temperature; 0 = greedy", cxxopts::value<float>()->default_value("0"))(
      "top-k", "Keep the k most likely tokens; 0 = off", cxxopts::value<int32_t>()->default_value("0"))(
      "top-p", "Nucleus sampling threshold; 1 = off", cxxopts::value<float>()->default_value("1"))(
      "seed", "Sampling seed", cxxopts::value<uint64_t>()->default_value("0"))(
      "ignore-eos", "Do not stop at the end-of-sequence token")(
      "dump-logits", "Write every position's logits as float32 .npy [sequences, positions, vocab]",
      cxxopts::value<std::string>())(
      "t,threads", "Compute threads; 0 = all cores", cxxopts::value<int>()->default_value("0"))(
      "prefill-chunk", "Most tokens per prefill pass", cxxopts::value<int64_t>()->default_value("256"))(
      "max-context", "KV cache positions per sequence; 0 = what the prompts need", cxxopts::value<int64_t>()->default_value("0"))(
      "kernels", "CPU kernels: auto, avx2 or generic", cxxopts::value<std::string>()->default_value("auto"))(
      "no-verify", "Skip the checksum check of dense tensors at load");
  add_common_options(o);
  auto r = o.parse(argc, argv);
  if (handle_common(o, r)) return 0;
  if (!r.count("model")) throw Error(Status::InvalidArgument, "generate needs --model FILE");
  if (!r.count("prompt-ids")) throw Error(Status::InvalidArgument, "generate needs at least one --prompt-ids");

  const std::string kn = r["kernels"].as<std::string>();
  if (kn != "auto" && !kernels::select(kn.c_str()))
    throw Error(Status::InvalidArgument, "--kernels '" + kn + "' is not available on this CPU (auto, avx2, generic)");
  if (r["threads"].as<int>() < 0) throw Error(Status::InvalidArgument, "--threads must be >= 0");
  const int threads = kernels::set_threads(r["threads"].as<int>());

  std::vector<Request> reqs;
  const int32_t max_new = r["max-new-tokens"].as<int32_t>();
  const uint64_t seed = r["seed"].as<uint64_t>();
  for (const auto& s : r["prompt-ids"].as<std::vector<std::string>>()) {
    Request q;
    q.prompt = parse_ids(s);
    q.max_new_tokens = max_new;
    q.ignore_eos = r.count("ignore-eos") > 0;
    q.sampling.temperature = r["temperature"].as<float>();
    q.sampling.top_k = r["top-k"].as<int32_t>();
    q.sampling.top_p = r["top-p"].as<float>();
    q.sampling.seed = seed + reqs.size();
    reqs.push_back(std::move(q));
  }

  ColibriFile::Options fo;
  fo.verify_dense = r.count("no-verify") == 0;
  auto file = ColibriFile::open(r["model"].as<std::string>(), fo);
  EngineOptions eo;
  eo.max_batch = static_cast<int64_t>(reqs.size());
  eo.prefill_chunk = r["prefill-chunk"].as<int64_t>();
  eo.max_context = r["max-context"].as<int64_t>();
  if (eo.max_context == 0) {
    // NOTE: size the KV cache for this request, not the model's full context.
    int64_t need = 0;
    for (const auto& q : reqs) need = std::max<int64_t>(need, static_cast<int64_t>(q.prompt.size()) + std::max(max_new, 0));
    eo.max_context = std::min<int64_t>(std::max<int64_t>(need, 1), file->config().max_position_embeddings);
  }
  auto comm = make_local_communicator();
  Engine engine(file, eo, *comm);
  engine.validate(reqs);  // before any work, with the model's own limits
  spdlog::info("model {}: {} layers, {} experts top-{}, {} threads, {} kernels", file->path(), file->config().num_layers,
               file->config().num_experts, file->config().experts_per_token, threads, kernels::active().name);

  GenerateOptions go;
  go.record_logits = r.count("dump-logits") > 0;
  GenerateStats st;
  auto out = engine.generate(reqs, go, &st);

  for (size_t i = 0; i < out.size(); ++i) {
    std::string ids;
    for (size_t j = 0; j < out[i].tokens.size(); ++j) ids += (j ? "," : "") + std::to_string(out[i].tokens[j]);
    std::printf("sequence %zu: %s\n", i, ids.c_str());
  }
  std::printf("prefill: %lld tokens in %.3f s (%.1f tokens/s)\n", (long long)st.prefill_tokens, st.prefill_seconds,
              st.prefill_seconds > 0 ? st.prefill_tokens / st.prefill_seconds : 0.0);
  std::printf("decode: %lld tokens in %.3f s (%.1f tokens/s)\n", (long long)st.decode_tokens, st.decode_seconds,
              st.decode_seconds > 0 ? st.decode_tokens / st.decode_seconds : 0.0);
  const auto& es = engine.local_worker()->store().stats();
  spdlog::info("experts materialised: {} ({:.1f} MiB), cache hits {}", es.misses, es.bytes_loaded / 1048576.0, es.hits);

  if (go.record_logits) {
    const int64_t V = file->config().vocab_size;
    int64_t P = 0;
    for (const auto& q : out) P = std::max<int64_t>(P, static_cast<int64_t>(q.logits.size()) / V);
    std::vector<float> all(static_cast<size_t>(out.size() * P * V), std::numeric_limits<float>::quiet_NaN());
    for (size_t i = 0; i < out.size(); ++i)
      std::copy(out[i].logits.begin(), out[i].logits.end(), all.begin() + static_cast<ptrdiff_t>(i * P * V));
    write_npy_f32(r["dump-logits"].as<std::string>(), {static_cast<int64_t>(out.size()), P, V}, all.data());
    spdlog::info("wrote logits [{}, {}, {}] to {}", out.size(), P, V, r["dump-logits"].as<std::string>());
  }
  return 0;
}

}  // namespace colibri::cli
