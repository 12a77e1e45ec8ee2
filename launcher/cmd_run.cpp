// cmd_run.cpp: colibri run (and generate): generation as one process, or as an
// expert-parallel cluster under mpirun/srun (rank 0 coordinates, the other
// ranks serve experts).
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <limits>
#include <sstream>
#include <thread>

#include "comm/communicator.h"
#include "coordinator/engine.h"
#include "kernels/cpu/kernels.h"
#include "launcher/cluster_setup.h"
#include "launcher/commands.h"
#include "launcher/options.h"
#include "launcher/signals.h"
#include "model/colibri_file.h"
#include "model/error.h"
#include "model/file_io.h"
#include "model/npy.h"
#include "model/placement.h"
#include "model/routing_trace.h"
#include "model/text.h"
#include "worker/protocol.h"

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

void add_generation_options(cxxopts::Options& o, bool one_process) {
  o.add_options()("m,model", ".colibri model file", cxxopts::value<std::string>())(
      "prompt", "A text prompt, encoded with the model's embedded tokenizer; repeat for a batch",
      cxxopts::value<std::vector<std::string>>())(
      "prompt-file", "A file whose whole content is one text prompt; repeatable (after the --prompt ones)",
      cxxopts::value<std::vector<std::string>>())(
      "p,prompt-ids", "Comma-separated token ids; repeat for a batch", cxxopts::value<std::vector<std::string>>())(
      "stop", "Text prompts: end a sequence when its text contains this string (not printed); repeatable",
      cxxopts::value<std::vector<std::string>>())(
      "no-special", "Text prompts: encode without the special tokens the tokenizer adds (BOS...)")(
      "show-special", "Text output: print special tokens (EOS...) instead of skipping them")(
      "print-ids", "Text prompts: also print the 'sequence N: ids' lines after the text")(
      "n,max-new-tokens", "Tokens to generate per prompt, 0..2^24", cxxopts::value<int32_t>()->default_value("16"))(
      "temperature", "Sampling temperature, 0..100; 0 = greedy", cxxopts::value<float>()->default_value("0"))(
      "top-k", "Keep the k most likely tokens, 0..vocabulary; 0 = off", cxxopts::value<int32_t>()->default_value("0"))(
      "top-p", "Nucleus sampling threshold, in (0, 1]; 1 = off", cxxopts::value<float>()->default_value("1"))(
      "seed", "Sampling seed (sequence i uses seed + i)", cxxopts::value<uint64_t>()->default_value("0"))(
      "ignore-eos", "Do not stop at the end-of-sequence token")(
      "dump-logits", "Write every position's logits as float32 .npy [sequences, positions, vocab]",
      cxxopts::value<std::string>())(
      "record-routing", "Write the routing trace (step, layer, token, experts, weights) as JSONL",
      cxxopts::value<std::string>())(
      "t,threads", "Compute threads per rank, 0..1024; 0 = the cores divided among this node's ranks",
      cxxopts::value<int>()->default_value("0"))(
      "prefill-chunk", "Most tokens per prefill pass, 1..65536", cxxopts::value<int64_t>()->default_value("256"))(
      "max-context", "KV cache positions per sequence, 0..the model's; 0 = what the prompts need",
      cxxopts::value<int64_t>()->default_value("0"))(
      "kernels", "CPU kernels: auto, avx512, avx2 or generic (avx512/avx2: x86-64 only)",
      cxxopts::value<std::string>()->default_value("auto"))(
      "no-verify", "Skip the checksum check of dense tensors at load")(
      "check-numerics", "Debugging: check every activation after each stage of every layer and name the first "
      "layer and stage where a NaN or infinity appears (slower; the logits are always checked)");
  add_kv_options(o, "room for every prompt's whole context (never preempts)");
  add_cluster_options(o, one_process);
}

// "PREFIX TEXT\n" on stdout (the text may hold any byte).
void print_text(const std::string& prefix, const std::string& text) {
  std::string line = prefix + text + "\n";
  std::fwrite(line.data(), 1, line.size(), stdout);
  std::fflush(stdout);
}

int run_generation(int argc, char** argv, bool cluster_cmd) {
  cxxopts::Options o(cluster_cmd ? "colibri run" : "colibri generate",
                     cluster_cmd ? "Generate as an expert-parallel cluster. Under mpirun/srun (or colibri launch) rank 0\n"
                                   "is the coordinator and the other ranks serve experts; with one rank it is the\n"
                                   "single-process engine. Sequence i samples with seed + i."
                                 : "Generate tokens from one or more prompts in one process (in-process communicator,\n"
                                   "every expert on rank 0). Sequence i samples with seed + i. The options that only\n"
                                   "shape a cluster are refused (exit 11): use colibri run for those.");
  add_generation_options(o, !cluster_cmd);
  add_common_options(o);
  auto r = o.parse(argc, argv);
  if (handle_common(o, r)) return 0;
  // generate: the options only a cluster reads are refused, not silently ignored.
  if (!cluster_cmd) refuse_cluster_only_options(r);
  // Every numeric option, before any work (the model's own limits follow in Engine::validate).
  const int32_t max_new = option_in_range(r, "max-new-tokens", Range<int32_t>{0, static_cast<int32_t>(kMaxPositions)});
  const float temperature = option_in_range(r, "temperature", Range<float>{0, 100, false, "(0 = greedy)"});
  const int32_t top_k = option_in_range(r, "top-k", Range<int32_t>{0, static_cast<int32_t>(kMaxPositions), false, "(0 = off)"});
  const float top_p = option_in_range(r, "top-p", Range<float>{0, 1, true, "(1 = off)"});
  const int64_t prefill_chunk = option_in_range(r, "prefill-chunk", Range<int64_t>{1, kMaxChunk});
  const int64_t max_context = option_in_range(r, "max-context", Range<int64_t>{0, kMaxPositions, false, "(0 = what the prompts need)"});
  EngineOptions kv_opts;  // --kv-dtype, --kv-block, --kv-cache-mb, checked before any work; the rest default
  apply_kv_options(r, kv_opts);
  const int threads_opt = check_option("threads", r["threads"].as<int>(), Range<int>{0, kernels::kMaxThreads, false, "(0 = all cores)"});

  ClusterRuntime rt = open_cluster(r, !cluster_cmd);
  Communicator* comm = rt.comm.get();
  const int rank = rt.rank, world = rt.world;

  return run_guarded(rt, [&]() -> int {
    if (!r.count("model")) throw Error(Status::InvalidArgument, "--model FILE is required");
    RankModel rm = open_rank_model(r, threads_opt, rank, world);
    const int threads = rm.threads;
    auto file = std::move(rm.file);
    const ModelConfig& cfg = file->config();
    ExpertSetup es = std::move(rm.es);
    const std::string& fault = es.fault;
    if (rank != 0) {
      serve_worker(rt, file, es);
      return 0;
    }

    // ---- coordinator ----
    // Before any work: an output never replaces an input or a special file.
    check_output_options(r, {"dump-logits", "record-routing"},
                         option_paths(r, {"model", "placement", "stats", "routing-replay"}, {"prompt-file"}));
    // Text prompts (--prompt, then --prompt-file) go through the embedded
    // tokenizer, and the output is text; --prompt-ids keeps the id lines.
    std::vector<std::string> texts;
    if (r.count("prompt")) texts = r["prompt"].as<std::vector<std::string>>();
    if (r.count("prompt-file"))
      for (const auto& fn : r["prompt-file"].as<std::vector<std::string>>()) texts.push_back(read_input(fn, "--prompt-file"));
    const bool text_mode = r.count("prompt") > 0 || r.count("prompt-file") > 0;
    if (text_mode && r.count("prompt-ids"))
      throw Error(Status::InvalidArgument, "give either text prompts (--prompt, --prompt-file) or --prompt-ids, not both");
    if (!text_mode && !r.count("prompt-ids"))
      throw Error(Status::InvalidArgument, "at least one --prompt, --prompt-file or --prompt-ids is required");
    std::vector<std::string> stops;
    if (r.count("stop")) stops = r["stop"].as<std::vector<std::string>>();
    for (const auto& st : stops)
      if (st.empty()) throw Error(Status::InvalidArgument, "--stop needs a non-empty string");
    if (!stops.empty() && !text_mode)
      throw Error(Status::InvalidArgument, "--stop works on text: give the prompts with --prompt or --prompt-file");
    std::unique_ptr<Tokenizer> tok;
    if (text_mode) tok = open_tokenizer(*file);
    const std::vector<int32_t> eos_ids = eos_token_ids(cfg);
    std::vector<std::vector<int32_t>> prompt_ids;
    if (text_mode) {
      const bool add_special = r.count("no-special") == 0;
      for (size_t i = 0; i < texts.size(); ++i) {
        prompt_ids.push_back(tok->encode(texts[i], add_special));
        if (prompt_ids.back().empty())
          throw Error(Status::InvalidArgument, "prompt " + std::to_string(i) + " encodes to no tokens");
      }
    } else {
      for (const auto& s : r["prompt-ids"].as<std::vector<std::string>>()) prompt_ids.push_back(parse_ids(s));
    }
    std::vector<Request> reqs;
    const uint64_t seed = r["seed"].as<uint64_t>();
    for (auto& ids : prompt_ids) {
      Request q;
      q.prompt = std::move(ids);
      q.max_new_tokens = max_new;
      q.ignore_eos = r.count("ignore-eos") > 0;
      q.stop_ids = eos_ids;
      q.sampling.temperature = temperature;
      q.sampling.top_k = top_k;
      q.sampling.top_p = top_p;
      q.sampling.seed = seed + reqs.size();
      reqs.push_back(std::move(q));
    }
    std::unique_ptr<RoutingTraceWriter> trace;
    if (r.count("record-routing"))
      trace = std::make_unique<RoutingTraceWriter>(r["record-routing"].as<std::string>(), static_cast<int>(cfg.num_moe_layers()),
                                                   static_cast<int>(cfg.num_experts), static_cast<int>(cfg.experts_per_token));
    EngineOptions eo = kv_opts;
    eo.max_batch = static_cast<int64_t>(reqs.size());
    eo.prefill_chunk = prefill_chunk;
    eo.max_context = max_context;
    if (eo.max_context == 0) {
      // NOTE: size the KV cache for this request, not the model's full context.
      int64_t need = 0;
      for (const auto& q : reqs) need = std::max<int64_t>(need, static_cast<int64_t>(q.prompt.size()) + std::max(max_new, 0));
      eo.max_context = std::min<int64_t>(std::max<int64_t>(need, 1), cfg.max_position_embeddings);
    }
    eo.placement = es.placement;
    eo.store = es.store;
    eo.device = es.dense_device;
    eo.replay = es.replay;
    eo.trace = trace.get();
    eo.check_numerics = r.count("check-numerics") > 0;
    Engine engine(file, eo, *comm);
    engine.start_workers();  // now, so that even an early stop finds the workers set up
    engine.validate(reqs);  // before any work, with the model's own limits
    spdlog::info("model {}: {} layers, {} experts top-{}; {} rank(s) over {}, {} threads/rank, {} kernels; KV cache "
                 "{:.1f} MiB of {}",
                 file->path(), cfg.num_layers, cfg.num_experts, cfg.experts_per_token, world, comm->backend(), threads,
                 kernels::active().name, engine.kv_cache_bytes() / 1048576.0, dtype_name(eo.kv_dtype));

    GenerateOptions go;
    go.record_logits = r.count("dump-logits") > 0;
    go.interrupt = stop_flag();
    if (fault == "kill:start") std::raise(SIGKILL);  // testing aid: the coordinator lost at start-up
    if (!fault.empty() && fault.rfind("kill:", 0) == 0) {
      // Testing aid: the coordinator dies after its N-th token.
      const long at = std::stol(fault.substr(5));
      go.on_token = [at, n = 0L](int, int, int32_t) mutable {
        if (n++ == at) std::raise(SIGKILL);
        return true;
      };
    }
    // Text output: one sequence streams to stdout as it is generated; with
    // several, each is printed ("[i] text") when it ends. The report goes to stderr.
    std::vector<std::unique_ptr<StopTextStream>> streams;
    std::vector<uint8_t> printed(reqs.size(), 0);
    const bool stream_one = text_mode && reqs.size() == 1;
    if (text_mode) {
      for (size_t i = 0; i < reqs.size(); ++i)
        streams.push_back(std::make_unique<StopTextStream>(*tok, stops, r.count("show-special") == 0));
      go.stop = [&](int seq, int32_t t, const std::string& ending) {
        StopTextStream& ts = *streams[static_cast<size_t>(seq)];
        const std::string piece = ts.push(t);
        const bool ends = ts.stopped() || !ending.empty();
        if (stream_one) {
          std::string rest = piece + (ends ? ts.finish() : std::string());
          if (!rest.empty()) {
            std::fwrite(rest.data(), 1, rest.size(), stdout);
            std::fflush(stdout);
          }
        } else if (ends) {
          ts.finish();
          print_text("[" + std::to_string(seq) + "] ", ts.text());
          std::fflush(stdout);
          printed[static_cast<size_t>(seq)] = 1;
        }
        return ts.stopped();
      };
    }
    GenerateStats st;
    std::vector<SequenceOutput> out;
    // A run that fails after it started (a lost or stuck rank, non-finite
    // logits, the model file changed) still prints what it generated, marked
    // partial, and the reason; then the error ends the run (and the job).
    std::unique_ptr<Error> failure;
    try {
      out = engine.generate(reqs, go, &st);
    } catch (const GenerationError& e) {
      out = e.partial();
      st = e.stats();
      failure = std::make_unique<Error>(e.status(), e.what());
    }
    if (trace && !failure) trace->close();

    const int sig = st.interrupted;
    const bool partial = sig != 0 || failure != nullptr;
    FILE* rep = text_mode ? stderr : stdout;
    if (text_mode) {
      for (size_t i = 0; i < out.size(); ++i) {
        StopTextStream& ts = *streams[i];
        if (stream_one) {
          const std::string rest = ts.finish();
          std::fwrite(rest.data(), 1, rest.size(), stdout);
          std::printf("\n");
        } else if (!printed[i]) {
          ts.finish();
          print_text("[" + std::to_string(i) + "]" + (partial ? " (partial) " : " "), ts.text());
        }
        spdlog::info("sequence {}: {} prompt tokens, {} new tokens, finish_reason {}", i, reqs[i].prompt.size(),
                     out[i].tokens.size(), out[i].finish_reason);
      }
    }
    if (!text_mode || r.count("print-ids"))
      for (size_t i = 0; i < out.size(); ++i) {
        std::string ids;
        for (size_t j = 0; j < out[i].tokens.size(); ++j) ids += (j ? "," : "") + std::to_string(out[i].tokens[j]);
        std::printf("sequence %zu%s: %s\n", i, sig || out[i].finish_reason == "error" ? " (partial)" : "", ids.c_str());
      }
    if (sig) std::fprintf(rep, "interrupted by %s: the sequences above are partial\n", signal_name(sig));
    // --dump-logits: every position's logits so far (NaN-padded), also when the run
    // was interrupted or failed (the failed pass's logits are not among them).
    auto write_logits = [&] {
      const int64_t V = cfg.vocab_size;
      int64_t P = 0;
      for (const auto& q : out) P = std::max<int64_t>(P, static_cast<int64_t>(q.logits.size()) / V);
      std::vector<float> all(static_cast<size_t>(out.size() * P * V), std::numeric_limits<float>::quiet_NaN());
      for (size_t i = 0; i < out.size(); ++i)
        std::copy(out[i].logits.begin(), out[i].logits.end(), all.begin() + static_cast<ptrdiff_t>(i * P * V));
      write_npy_f32(r["dump-logits"].as<std::string>(), {static_cast<int64_t>(out.size()), P, V}, all.data());
      spdlog::info("wrote {}logits [{}, {}, {}] to {}", partial ? "partial " : "", out.size(), P, V,
                   r["dump-logits"].as<std::string>());
    };
    if (failure) {
      std::fprintf(rep, "stopped by an error (%s, exit %d): the sequences above are partial\n",
                   status_name(failure->status()), exit_code(failure->status()));
      std::fflush(stdout);
      std::fflush(rep);
      if (go.record_logits) {
        try {
          write_logits();
        } catch (const Error& e) {
          spdlog::error("the partial logits were not written: {}", e.what());
        }
      }
      throw Error(*failure);
    }
    // NOTE: stdout to a file is fully buffered; flush now, so a SIGKILL while
    // stopping the workers (mpirun's, 1 s after its SIGTERM) cannot lose the tokens.
    std::fflush(stdout);
    std::fprintf(rep, "prefill: %lld tokens in %.3f s (%.1f tokens/s)\n", (long long)st.prefill_tokens, st.prefill_seconds,
                st.prefill_seconds > 0 ? st.prefill_tokens / st.prefill_seconds : 0.0);
    std::fprintf(rep, "decode: %lld tokens in %.3f s (%.1f tokens/s)\n", (long long)st.decode_tokens, st.decode_seconds,
                st.decode_seconds > 0 ? st.decode_tokens / st.decode_seconds : 0.0);

    // Every rank's expert cache and traffic.
    const std::vector<cluster::RankReport> reports = rank_reports(engine, *comm);
    std::fprintf(rep, "%-5s %-8s %7s %8s %8s %9s %9s %10s %11s %11s %9s\n", "rank", "policy", "experts", "slots", "hits",
                "misses", "hit rate", "loaded MiB", "evictions", "rows served", "RSS MiB");
    for (const auto& rr : reports) {
      uint64_t acc = rr.hits + rr.misses;
      std::fprintf(rep, "%-5d %-8s %7d %8llu %8llu %9llu %8.1f%% %10.1f %11llu %11llu %9.1f\n", rr.rank,
                  rr.experts_owned ? rr.policy : "-", rr.experts_owned, (unsigned long long)rr.cache_slots,
                  (unsigned long long)rr.hits, (unsigned long long)rr.misses, acc ? 100.0 * rr.hits / acc : 0.0,
                  rr.bytes_loaded / 1048576.0, (unsigned long long)rr.evictions, (unsigned long long)rr.rows_served,
                  rr.peak_rss_kb / 1024.0);
    }
    if (world > 1) {
      // What crossed the wire from the coordinator: each (token, expert) row once
      // per remote owner, plus the per-layer counts; never the whole batch.
      const auto& ds = engine.dispatch_stats();
      const uint64_t row_bytes = static_cast<uint64_t>(cfg.hidden_size) * sizeof(float);
      const uint64_t tokens = static_cast<uint64_t>(st.prefill_tokens + st.decode_tokens);
      std::fprintf(rep, "exchange: %llu forward passes, %llu tokens, %llu (token, expert) rows to other ranks = %llu row bytes, "
                  "%llu count bytes, %llu bytes sent in all (%.1f KiB per token)\n",
                  (unsigned long long)(ds.layers / std::max<int64_t>(1, cfg.num_moe_layers())), (unsigned long long)tokens,
                  (unsigned long long)ds.rows_remote, (unsigned long long)(ds.rows_remote * row_bytes),
                  (unsigned long long)(comm->stats().bytes_sent - ds.rows_remote * row_bytes),
                  (unsigned long long)comm->stats().bytes_sent, comm->stats().bytes_sent / 1024.0 / std::max<uint64_t>(1, tokens));
    }
    engine.stop_workers();
    // Everyone is done computing: synchronise before the (possibly slow) writes.
    if (world > 1) comm->barrier();

    if (go.record_logits) write_logits();
    rt.finish();
    std::fflush(stdout);
    return sig ? 128 + sig : 0;
  });
}

}  // namespace

int cmd_run(int argc, char** argv) { return run_generation(argc, argv, true); }
int cmd_generate(int argc, char** argv) { return run_generation(argc, argv, false); }

}  // namespace colibri::cli
