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
#include "coordinator/cluster.h"
#include "coordinator/engine.h"
#include "coordinator/placement.h"
#include "coordinator/routing_trace.h"
#include "kernels/cpu/kernels.h"
#include "launcher/commands.h"
#include "launcher/signals.h"
#include "model/colibri_file.h"
#include "model/error.h"
#include "model/npy.h"
#include "model/text.h"

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

void add_generation_options(cxxopts::Options& o) {
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
      "n,max-new-tokens", "Tokens to generate per prompt", cxxopts::value<int32_t>()->default_value("16"))(
      "temperature", "Sampling temperature; 0 = greedy", cxxopts::value<float>()->default_value("0"))(
      "top-k", "Keep the k most likely tokens; 0 = off", cxxopts::value<int32_t>()->default_value("0"))(
      "top-p", "Nucleus sampling threshold; 1 = off", cxxopts::value<float>()->default_value("1"))(
      "seed", "Sampling seed (sequence i uses seed + i)", cxxopts::value<uint64_t>()->default_value("0"))(
      "ignore-eos", "Do not stop at the end-of-sequence token")(
      "dump-logits", "Write every position's logits as float32 .npy [sequences, positions, vocab]",
      cxxopts::value<std::string>())(
      "record-routing", "Write the routing trace (step, layer, token, experts, weights) as JSONL",
      cxxopts::value<std::string>())(
      "t,threads", "Compute threads per rank; 0 = the cores divided among this node's ranks",
      cxxopts::value<int>()->default_value("0"))(
      "prefill-chunk", "Most tokens per prefill pass", cxxopts::value<int64_t>()->default_value("256"))(
      "max-context", "KV cache positions per sequence; 0 = what the prompts need",
      cxxopts::value<int64_t>()->default_value("0"))(
      "kernels", "CPU kernels: auto, avx2 or generic", cxxopts::value<std::string>()->default_value("auto"))(
      "no-verify", "Skip the checksum check of dense tensors at load");
  o.add_options("experts")("placement", "Placement JSON (which ranks own which experts)", cxxopts::value<std::string>())(
      "policy", "Without --placement: contiguous, round_robin, balanced or replicated",
      cxxopts::value<std::string>()->default_value("contiguous"))(
      "stats", "Expert-load STATS.json for the balanced/replicated policies and the pinned cache",
      cxxopts::value<std::string>())(
      "redundant", "Replicated policy: extra replicas per layer", cxxopts::value<int>()->default_value("0"))(
      "coordinator-experts", "Rank 0 hosts experts too (always so with one rank)")(
      "expert-cache-bytes", "Fast-tier budget per rank in bytes (K/M/G suffix); 0 = no fast tier",
      cxxopts::value<std::string>()->default_value("0"))(
      "expert-cache-experts", "Fast-tier budget per rank in experts", cxxopts::value<int64_t>()->default_value("0"))(
      "cache-policy", "lru, lfu, hybrid, pinned, ...", cxxopts::value<std::string>()->default_value("lru"))(
      "cache-decay", "Hybrid policy: decay per tick", cxxopts::value<double>()->default_value("0.9"));
  o.add_options("cluster")("comm", "Communicator: auto (mpi under mpirun/srun, else local), local, mpi, nccl",
                           cxxopts::value<std::string>()->default_value("auto"))(
      "gpu", "NCCL backend: GPU of this rank; -1 = the local rank", cxxopts::value<int>()->default_value("-1"))(
      "comm-timeout", "Seconds a rank waits for a peer before failing", cxxopts::value<double>()->default_value("120"))(
      "inject-fault", "Testing aid: RANK:kill:N kills a worker at its N-th forward pass, rank 0 at its N-th token; RANK:kill:start at start-up", cxxopts::value<std::string>());
}

// "PREFIX TEXT\n" on stdout (the text may hold any byte).
void print_text(const std::string& prefix, const std::string& text) {
  std::string line = prefix + text + "\n";
  std::fwrite(line.data(), 1, line.size(), stdout);
  std::fflush(stdout);
}

uint64_t parse_bytes(const std::string& s) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || !std::isfinite(v) || v < 0 || v > 1e18) throw Error(Status::InvalidArgument, "'" + s + "' is not a byte count");
  std::string unit = s.substr(used);
  double mult = 1;
  if (unit == "K" || unit == "KiB") mult = 1024.0;
  else if (unit == "M" || unit == "MiB") mult = 1048576.0;
  else if (unit == "G" || unit == "GiB") mult = 1073741824.0;
  else if (!unit.empty()) throw Error(Status::InvalidArgument, "unknown unit '" + unit + "' in '" + s + "' (K, M, G)");
  return static_cast<uint64_t>(v * mult);
}

// Top `slots` keys by load among all experts (pinned cache policy).
std::vector<uint64_t> hottest_keys(const ExpertStats& st, size_t limit) {
  std::vector<std::pair<uint64_t, uint64_t>> v;  // (load, key)
  for (int l = 0; l < st.num_layers; ++l)
    for (int e = 0; e < st.num_experts; ++e)
      v.push_back({st.load[static_cast<size_t>(l)][static_cast<size_t>(e)], static_cast<uint64_t>(l) * st.num_experts + e});
  std::stable_sort(v.begin(), v.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<uint64_t> k;
  for (size_t i = 0; i < v.size() && i < limit; ++i) k.push_back(v[i].second);
  return k;
}

int run_generation(int argc, char** argv, bool cluster_cmd) {
  cxxopts::Options o(cluster_cmd ? "colibri run" : "colibri generate",
                     cluster_cmd ? "Generate as an expert-parallel cluster. Under mpirun/srun (or colibri launch) rank 0\n"
                                   "is the coordinator and the other ranks serve experts; with one rank it is the\n"
                                   "single-process engine. Sequence i samples with seed + i."
                                 : "Generate tokens from one or more prompts of token ids in one process (CPU backend,\n"
                                   "in-process communicator). Sequence i samples with seed + i.");
  add_generation_options(o);
  add_common_options(o);
  auto r = o.parse(argc, argv);
  if (handle_common(o, r)) return 0;

  // The communicator first: every rank must reach the same collectives.
  std::string comm_kind = r["comm"].as<std::string>();
  if (!cluster_cmd) comm_kind = "local";
  if (comm_kind == "auto") comm_kind = mpi_runtime::launched_by_mpi() ? "mpi" : "local";
  std::unique_ptr<Communicator> comm;
  if (comm_kind == "local") {
    comm = make_local_communicator();
  } else if (comm_kind == "mpi" || comm_kind == "nccl") {
    mpi_runtime::init();
    if (comm_kind == "mpi") {
      comm = make_mpi_communicator();
    } else {
      int gpu = r["gpu"].as<int>();
      if (gpu < 0) {
        const char* lr = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
        gpu = lr ? std::atoi(lr) : 0;
      }
      comm = make_nccl_communicator(gpu);
      if (!comm) throw Error(Status::Unsupported, "this build has no NCCL (CUDA and NCCL were not found at configure time)");
    }
    if (!comm) throw Error(Status::Unsupported, "this build has no MPI (configure with Open MPI installed)");
  } else {
    throw Error(Status::InvalidArgument, "--comm '" + comm_kind + "' (auto, local, mpi, nccl)");
  }
  comm->set_timeout(r["comm-timeout"].as<double>());
  // SIGINT/SIGTERM: the coordinator stops between forward passes, tells the
  // workers to stop, and prints what it has as partial; workers keep serving
  // until then (at most 10 s more).
  install_stop_handlers();
  comm->set_interrupt(stop_flag(), 10.0);
  const int rank = comm->rank(), world = comm->size();
  if (world > 1) spdlog::set_pattern("[%H:%M:%S.%e] [rank " + std::to_string(rank) + "] [%^%l%$] %v");

  try {
    if (!r.count("model")) throw Error(Status::InvalidArgument, "--model FILE is required");
    const std::string kn = r["kernels"].as<std::string>();
    if (kn != "auto" && !kernels::select(kn.c_str()))
      throw Error(Status::InvalidArgument, "--kernels '" + kn + "' is not available on this CPU (auto, avx2, generic)");
    int threads = r["threads"].as<int>();
    if (threads < 0) throw Error(Status::InvalidArgument, "--threads must be >= 0");
    if (threads == 0 && world > 1) {
      // NOTE: ranks on one node share its cores; by default each gets its share.
      int cores = static_cast<int>(std::thread::hardware_concurrency());
      threads = std::max(1, cores / std::max(1, mpi_runtime::local_size()));
    }
    threads = kernels::set_threads(threads);

    ColibriFile::Options fo;
    fo.verify_dense = rank == 0 && r.count("no-verify") == 0;
    auto file = ColibriFile::open(r["model"].as<std::string>(), fo);
    const ModelConfig& cfg = file->config();

    std::unique_ptr<ExpertStats> stats;
    if (r.count("stats")) stats = std::make_unique<ExpertStats>(load_expert_stats(r["stats"].as<std::string>()));
    std::shared_ptr<const Placement> placement;
    const bool coord_hosts = world == 1 || r.count("coordinator-experts") > 0;
    if (r.count("placement")) {
      placement = std::make_shared<const Placement>(
          Placement::load(r["placement"].as<std::string>(), world, static_cast<int>(cfg.num_moe_layers()), static_cast<int>(cfg.num_experts)));
    } else {
      placement = std::make_shared<const Placement>(make_placement(r["policy"].as<std::string>(), static_cast<int>(cfg.num_moe_layers()),
                                                                   static_cast<int>(cfg.num_experts), world, coord_hosts,
                                                                   stats.get(), r["redundant"].as<int>()));
    }
    cluster::check_placement(*placement, cfg, world);

    ExpertStoreOptions so;
    so.budget_bytes = parse_bytes(r["expert-cache-bytes"].as<std::string>());
    so.budget_experts = r["expert-cache-experts"].as<int64_t>();
    if (so.budget_experts < 0) throw Error(Status::InvalidArgument, "--expert-cache-experts must be >= 0");
    so.policy = r["cache-policy"].as<std::string>();
    so.decay = r["cache-decay"].as<double>();
    if (so.policy == "pinned") {
      if (!stats) throw Error(Status::InvalidArgument, "--cache-policy pinned needs --stats STATS.json");
      if (stats->num_layers != cfg.num_moe_layers() || stats->num_experts != cfg.num_experts)
        throw Error(Status::InvalidArgument, "--stats describes " + std::to_string(stats->num_layers) + " layers x " +
                                                 std::to_string(stats->num_experts) + " experts, the model has " +
                                                 std::to_string(cfg.num_moe_layers()) + " x " + std::to_string(cfg.num_experts));
      so.pinned = hottest_keys(*stats, file->experts().size());
    }
    std::string fault;
    if (r.count("inject-fault")) {
      std::string f = r["inject-fault"].as<std::string>();
      size_t colon = f.find(':');
      if (colon == std::string::npos) throw Error(Status::InvalidArgument, "--inject-fault RANK:kill:N");
      if (std::stoi(f.substr(0, colon)) == rank) fault = f.substr(colon + 1);
    }

    if (rank != 0) {
      cluster::WorkerOptions wo;
      wo.store = so;
      wo.fault = fault;
      cluster::serve(file, placement, *comm, wo);
      comm->barrier();
      comm.reset();
      mpi_runtime::finalize();
      return 0;
    }

    // ---- coordinator ----
    // Text prompts (--prompt, then --prompt-file) go through the embedded
    // tokenizer, and the output is text; --prompt-ids keeps the id lines.
    std::vector<std::string> texts;
    if (r.count("prompt")) texts = r["prompt"].as<std::vector<std::string>>();
    if (r.count("prompt-file"))
      for (const auto& fn : r["prompt-file"].as<std::vector<std::string>>()) {
        std::ifstream in(fn, std::ios::binary);
        if (!in) throw Error(Status::Io, "cannot read --prompt-file '" + fn + "'");
        texts.emplace_back((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      }
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
    const int32_t max_new = r["max-new-tokens"].as<int32_t>();
    const uint64_t seed = r["seed"].as<uint64_t>();
    for (auto& ids : prompt_ids) {
      Request q;
      q.prompt = std::move(ids);
      q.max_new_tokens = max_new;
      q.ignore_eos = r.count("ignore-eos") > 0;
      q.stop_ids = eos_ids;
      q.sampling.temperature = r["temperature"].as<float>();
      q.sampling.top_k = r["top-k"].as<int32_t>();
      q.sampling.top_p = r["top-p"].as<float>();
      q.sampling.seed = seed + reqs.size();
      reqs.push_back(std::move(q));
    }
    std::unique_ptr<RoutingTraceWriter> trace;
    if (r.count("record-routing"))
      trace = std::make_unique<RoutingTraceWriter>(r["record-routing"].as<std::string>(), static_cast<int>(cfg.num_moe_layers()),
                                                   static_cast<int>(cfg.num_experts), static_cast<int>(cfg.experts_per_token));
    EngineOptions eo;
    eo.max_batch = static_cast<int64_t>(reqs.size());
    eo.prefill_chunk = r["prefill-chunk"].as<int64_t>();
    eo.max_context = r["max-context"].as<int64_t>();
    if (eo.max_context == 0) {
      // NOTE: size the KV cache for this request, not the model's full context.
      int64_t need = 0;
      for (const auto& q : reqs) need = std::max<int64_t>(need, static_cast<int64_t>(q.prompt.size()) + std::max(max_new, 0));
      eo.max_context = std::min<int64_t>(std::max<int64_t>(need, 1), cfg.max_position_embeddings);
    }
    eo.placement = placement;
    eo.store = so;
    eo.trace = trace.get();
    Engine engine(file, eo, *comm);
    engine.start_workers();  // now, so that even an early stop finds the workers set up
    engine.validate(reqs);  // before any work, with the model's own limits
    spdlog::info("model {}: {} layers, {} experts top-{}; {} rank(s) over {}, {} threads/rank, {} kernels", file->path(),
                 cfg.num_layers, cfg.num_experts, cfg.experts_per_token, world, comm->backend(), threads,
                 kernels::active().name);

    GenerateOptions go;
    go.record_logits = r.count("dump-logits") > 0;
    go.interrupt = stop_flag();
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
    auto out = engine.generate(reqs, go, &st);
    if (trace) trace->close();

    const int sig = st.interrupted;
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
          print_text("[" + std::to_string(i) + "]" + (sig ? " (partial) " : " "), ts.text());
        }
        spdlog::info("sequence {}: {} prompt tokens, {} new tokens, finish_reason {}", i, reqs[i].prompt.size(),
                     out[i].tokens.size(), out[i].finish_reason);
      }
    }
    if (!text_mode || r.count("print-ids"))
      for (size_t i = 0; i < out.size(); ++i) {
        std::string ids;
        for (size_t j = 0; j < out[i].tokens.size(); ++j) ids += (j ? "," : "") + std::to_string(out[i].tokens[j]);
        std::printf("sequence %zu%s: %s\n", i, sig ? " (partial)" : "", ids.c_str());
      }
    if (sig) std::fprintf(rep, "interrupted by %s: the sequences above are partial\n", signal_name(sig));
    // NOTE: stdout to a file is fully buffered; flush now, so a SIGKILL while
    // stopping the workers (mpirun's, 1 s after its SIGTERM) cannot lose the tokens.
    std::fflush(stdout);
    std::fprintf(rep, "prefill: %lld tokens in %.3f s (%.1f tokens/s)\n", (long long)st.prefill_tokens, st.prefill_seconds,
                st.prefill_seconds > 0 ? st.prefill_tokens / st.prefill_seconds : 0.0);
    std::fprintf(rep, "decode: %lld tokens in %.3f s (%.1f tokens/s)\n", (long long)st.decode_tokens, st.decode_seconds,
                st.decode_seconds > 0 ? st.decode_tokens / st.decode_seconds : 0.0);

    // Every rank's expert cache and traffic.
    cluster::RankReport mine;
    mine.rank = 0;
    if (Worker* w = engine.local_worker()) {
      CacheStats cs = w->store().stats();
      mine.hits = cs.hits, mine.misses = cs.misses, mine.bytes_loaded = cs.bytes_loaded, mine.evictions = cs.evictions;
      mine.cache_slots = w->store().slots();
      std::snprintf(mine.policy, sizeof mine.policy, "%s", w->store().policy());
      for (int l = 0; l < cfg.num_moe_layers(); ++l)
        for (int e = 0; e < cfg.num_experts; ++e) mine.experts_owned += placement->owns(0, l, e);
    }
    mine.rows_served = engine.dispatch_stats().rows_served;
    mine.bytes_sent = comm->stats().bytes_sent;
    mine.bytes_received = comm->stats().bytes_received;
    mine.peak_rss_kb = cluster::peak_rss_kb();
    std::vector<cluster::RankReport> reports{mine};
    if (world > 1) {
      cluster::send_op(*comm, cluster::Op::Report);
      reports = cluster::gather_reports(*comm, mine);
    }
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

    if (go.record_logits) {
      const int64_t V = cfg.vocab_size;
      int64_t P = 0;
      for (const auto& q : out) P = std::max<int64_t>(P, static_cast<int64_t>(q.logits.size()) / V);
      std::vector<float> all(static_cast<size_t>(out.size() * P * V), std::numeric_limits<float>::quiet_NaN());
      for (size_t i = 0; i < out.size(); ++i)
        std::copy(out[i].logits.begin(), out[i].logits.end(), all.begin() + static_cast<ptrdiff_t>(i * P * V));
      write_npy_f32(r["dump-logits"].as<std::string>(), {static_cast<int64_t>(out.size()), P, V}, all.data());
      spdlog::info("wrote {}logits [{}, {}, {}] to {}", sig ? "partial " : "", out.size(), P, V,
                   r["dump-logits"].as<std::string>());
    }
    comm.reset();
    if (comm_kind != "local") mpi_runtime::finalize();
    std::fflush(stdout);
    return sig ? 128 + sig : 0;
  } catch (const Error& e) {
    if (world > 1) {
      // NOTE: one rank's error must end the whole job, not leave peers waiting.
      spdlog::error("{}", e.what());
      std::fflush(stdout);
      std::fflush(stderr);
      mpi_runtime::abort(exit_code(e.status()));
    }
    throw;
  } catch (const std::bad_alloc&) {
    if (world > 1) {
      spdlog::error("rank {}: out of memory", rank);
      mpi_runtime::abort(exit_code(Status::OutOfMemory));
    }
    throw;
  } catch (const std::exception& e) {
    if (world > 1) {
      spdlog::error("rank {}: {}", rank, e.what());
      mpi_runtime::abort(exit_code(Status::Internal));
    }
    throw;
  }
}

}  // namespace

int cmd_run(int argc, char** argv) { return run_generation(argc, argv, true); }
int cmd_generate(int argc, char** argv) { return run_generation(argc, argv, false); }

}  // namespace colibri::cli
