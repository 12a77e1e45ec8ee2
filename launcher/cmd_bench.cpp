// cmd_bench.cpp: colibri bench: generation speed of a model in one process
// (prefill and decode tokens/s, weight bytes read per decode token and the
// bandwidth that implies), a STREAM-style memory bandwidth measurement, and the
// f32 FMA peak of the CPU. See docs/benchmarks.md.
#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif
#include <omp.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <limits>
#include <sstream>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>
#include <vector>

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
#include "model/printable.h"
#include "model/routing_trace.h"
#include "model/text.h"

namespace colibri::cli {

namespace {

using nlohmann::json;

[[noreturn]] void bad_arg(const std::string& msg) { throw Error(Status::InvalidArgument, msg); }

// Summary of one measured quantity over the repetitions.
struct Summary {
  double median = 0, min = 0, max = 0;
};
Summary summarize(std::vector<double> v) {
  Summary s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  s.min = v.front();
  s.max = v.back();
  s.median = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  return s;
}
json to_json(const Summary& s) { return {{"median", s.median}, {"min", s.min}, {"max", s.max}}; }

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) {
      size_t c = line.find(':');
      if (c != std::string::npos) {
        size_t a = line.find_first_not_of(" \t", c + 1);
        return a == std::string::npos ? "" : line.substr(a);
      }
    }
  return "unknown";
}

// The last-level (L3) cache size from sysfs (glibc's sysconf reports the host's
// in some VMs), else sysconf, else 0.
double l3_cache_bytes() {
  for (int i = 0; i < 16; ++i) {
    const std::string d = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/";
    std::ifstream lv(d + "level"), sz(d + "size");
    int level = 0;
    std::string size;
    if (!(lv >> level) || !(sz >> size)) continue;
    if (level != 3 || size.empty()) continue;
    double v = std::atof(size.c_str());
    const char u = size.back();
    if (u == 'K') v *= 1024.0;
    else if (u == 'M') v *= 1048576.0;
    else if (u == 'G') v *= 1073741824.0;
    if (v > 0) return v;
  }
  const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
  return l3 > 0 ? static_cast<double>(l3) : 0.0;
}

std::string human_bytes(double b) {
  char buf[64];
  if (b >= 1073741824.0) std::snprintf(buf, sizeof buf, "%.3f GiB", b / 1073741824.0);
  else if (b >= 1048576.0) std::snprintf(buf, sizeof buf, "%.2f MiB", b / 1048576.0);
  else if (b >= 1024.0) std::snprintf(buf, sizeof buf, "%.2f KiB", b / 1024.0);
  else std::snprintf(buf, sizeof buf, "%.0f B", b);
  return buf;
}

// What else ran on the machine while we measured: the CPU time all processes
// used (/proc/stat, steal included) minus our own (getrusage), as a share of
// the wall time x the CPUs. Benchmarks on a shared machine say so.
class NoiseProbe {
 public:
  void start() {
    load1_ = load_average();
    busy0_ = busy_seconds();
    self0_ = cluster::cpu_seconds();
    wall0_ = std::chrono::steady_clock::now();
  }
  void stop() {
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0_).count();
    const double busy = busy_seconds() - busy0_, self = cluster::cpu_seconds() - self0_;
    others_ = std::max(0.0, busy - self);
    const double cpus = std::max(1u, std::thread::hardware_concurrency());
    share_ = wall > 0 ? others_ / (wall * cpus) : 0;
    wall_ = wall;
  }
  // CPU time of processes that are part of the measurement (worker ranks).
  void exclude(double cpu_s) {
    others_ = std::max(0.0, others_ - cpu_s);
    const double cpus = std::max(1u, std::thread::hardware_concurrency());
    share_ = wall_ > 0 ? others_ / (wall_ * cpus) : 0;
  }
  // NOTE: /proc/stat counts in clock ticks (10 ms): below 0.05 CPU s it is rounding.
  bool noisy() const { return share_ > 0.02 && others_ > 0.05; }
  json to_json() const {
    return {{"load_average_1min_before", load1_}, {"other_cpu_seconds", others_}, {"other_cpu_share", share_},
            {"measured_seconds", wall_}, {"noisy", noisy()}};
  }
  void print() const {
    std::printf("other processes: %.2f CPU s during the %.1f s measured (%.1f%% of the CPUs; load average %.2f before)\n",
                others_, wall_, 100.0 * share_, load1_);
    if (noisy())
      std::printf("WARNING: other processes used the CPUs while this ran: the numbers are likely noisy; re-run when quiet\n");
  }

 private:
  static double load_average() {
    std::ifstream in("/proc/loadavg");
    double v = -1;
    in >> v;
    return v;
  }
  static double busy_seconds() {
    std::ifstream in("/proc/stat");
    std::string cpu;
    uint64_t user = 0, nice = 0, sys = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0;
    if (!(in >> cpu >> user >> nice >> sys >> idle >> iowait >> irq >> softirq >> steal) || cpu != "cpu") return 0;
    return static_cast<double>(user + nice + sys + irq + softirq + steal) / static_cast<double>(sysconf(_SC_CLK_TCK));
  }
  double load1_ = 0, busy0_ = 0, self0_ = 0, others_ = 0, share_ = 0, wall_ = 0;
  std::chrono::steady_clock::time_point wall0_;
};

// ===========================================================================
// Model benchmark

struct ModelBytes {
  // Per decode forward pass (step) of B sequences:
  uint64_t dense = 0;          // every dense tensor except the embedding table and the LM head
  uint64_t embedding_row = 0;  // one row of the embedding table (read once per token)
  uint64_t lm_head = 0;        // the whole LM head (the embedding table when tied)
  double routed = 0;           // routed expert blocks touched per step (mean over decode steps)
  double distinct_per_layer = 0;  // distinct experts per MoE layer per step (mean)
  std::string routed_source;      // how `routed` was obtained
  double kv = 0;  // KV cache bytes attended per step (mean), not part of the weights
  int64_t batch = 1;
  double weights_per_step() const { return static_cast<double>(dense + lm_head + embedding_row * batch) + routed; }
  double weights_per_token() const { return weights_per_step() / static_cast<double>(batch); }
};

// Dense parts from the file: sizes as stored (dtype included).
void dense_bytes(const ColibriFile& f, ModelBytes& b) {
  const ModelConfig& c = f.config();
  const std::string embd = tname::token_embd(), out = tname::output();
  for (const auto& t : f.tensors()) {
    if (t.name == embd) {
      b.embedding_row = t.size / static_cast<uint64_t>(std::max<int64_t>(1, c.vocab_size));
      if (c.tie_word_embeddings) b.lm_head = t.size;
    } else if (t.name == out) {
      b.lm_head = t.size;
    } else {
      b.dense += t.size;
    }
  }
}

// KV cache bytes read by attention per decode step (mean over the steps): each
// of B rows at position p attends to min(window, p + 1) positions per layer.
double kv_bytes_per_step(const ModelConfig& c, int64_t B, int64_t P, int64_t N, DType kv_dtype) {
  const double width = c.attention == "mla" ? static_cast<double>(c.kv_lora_rank + c.qk_rope_head_dim)
                                            : 2.0 * static_cast<double>(c.num_kv_heads * c.head_dim);
  double total = 0;
  for (int64_t j = 0; j + 1 < N; ++j) {
    const int64_t pos = P + j;
    for (int64_t l = 0; l < c.num_layers; ++l) {
      const int64_t w = c.window(l);
      const int64_t att = w > 0 ? std::min(w, pos + 1) : pos + 1;
      total += static_cast<double>(att) * width * (kv_dtype == DType::F32 ? 4.0 : 2.0);
    }
  }
  return N > 1 ? total * static_cast<double>(B) / static_cast<double>(N - 1) : 0.0;
}

std::vector<Request> make_requests(const ModelConfig& c, int64_t B, int64_t P, int64_t N, uint64_t seed) {
  // splitmix64: the same prompts on every platform for a seed.
  uint64_t x = seed;
  auto next = [&x] {
    uint64_t z = (x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  };
  std::vector<Request> reqs(static_cast<size_t>(B));
  for (auto& q : reqs) {
    q.prompt.resize(static_cast<size_t>(P));
    for (auto& t : q.prompt) t = static_cast<int32_t>(next() % static_cast<uint64_t>(c.vocab_size));
    q.max_new_tokens = static_cast<int32_t>(N);
    q.ignore_eos = true;
    q.sampling.temperature = 0;  // greedy
    q.sampling.seed = seed;
  }
  return reqs;
}

EngineOptions engine_options(int64_t B, int64_t P, int64_t N, int64_t chunk) {
  EngineOptions eo;
  eo.max_batch = B;
  eo.max_context = P + N;
  eo.prefill_chunk = chunk;
  return eo;
}

struct RepResult {
  GenerateStats st;
  double prefill_tps = 0, decode_tps = 0, ms_per_step = 0, weight_gbps = 0, total_gbps = 0;
  // Matrix products (kernels::gemm) during prefill: flops, seconds, GFLOP/s.
  double prefill_gemm_flops = 0, prefill_gemm_seconds = 0, prefill_gemm_gflops = 0;
};

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Nearest-rank percentile of v (sorted ascending); NaN when empty.
double percentile(const std::vector<double>& v, double p) {
  if (v.empty()) return kNaN;
  const size_t i = static_cast<size_t>(std::max(0.0, std::ceil(p / 100.0 * static_cast<double>(v.size())) - 1.0));
  return v[std::min(i, v.size() - 1)];
}

// The expert-parallel figures of the timed repetitions (any world size).
struct ClusterFigures {
  std::vector<double> step_ms;  // every decode step of every timed rep, sorted
  double p50 = 0, p90 = 0, p99 = 0, mean = 0;
  uint64_t decode_steps = 0, decode_tokens = 0;
  double exchange_bytes_per_token = 0, min_bytes_per_token = 0;
  std::vector<double> balancedness;  // [MoE layer] decode, mean over steps
  double balancedness_mean = 0;
  std::vector<cluster::RankReport> ranks;           // timed window
  std::vector<std::vector<double>> stage_ms;        // [rank][stage, then other] per decode step
  std::vector<double> hit_rate;                     // [rank] NaN without experts or accesses
  double hit_rate_all = 0;
  double rss_max_mib = 0;
};

json num(double v) { return std::isfinite(v) ? json(v) : json(nullptr); }

std::string csv_num(double v) {
  if (!std::isfinite(v)) return "nan";
  char b[64];
  std::snprintf(b, sizeof b, "%.6g", v);
  return b;
}

std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n\r") == std::string::npos) return s;
  std::string q = "\"";
  for (char c : s) q += c == '"' ? std::string("\"\"") : std::string(1, c);
  return q + "\"";
}

std::string join(const std::vector<double>& v, int mul = 1) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ";" : "") + csv_num(v[i] * mul);
  return s;
}

// The CSV's columns: the configuration, the results, then each stage's ms per
// decode step for the coordinator (coord_*) and the workers' mean (workers_*).
std::string csv_header() {
  static const char* const fixed[] = {
      "timestamp", "version", "command", "label", "model", "layers", "moe_layers", "experts", "top_k", "hidden",
      "world", "comm", "policy", "placement", "coordinator_experts", "batch", "prompt_len", "new_tokens", "warmup",
      "reps", "seed", "threads", "kernels", "cache_policy", "cache_budget_experts", "cache_budget_bytes",
      "routing_replay", "stage_sync", "prefill_tok_s", "decode_tok_s", "step_ms_p50", "step_ms_p90", "step_ms_p99",
      "step_ms_mean", "decode_steps", "exchange_bytes_per_token", "exchange_min_bytes_per_token", "balancedness_mean",
      "balancedness_per_layer", "hit_rate", "hit_rate_per_rank", "peak_rss_mib_max", "peak_rss_mib_per_rank"};
  std::string h;
  for (const char* c : fixed) h += (h.empty() ? "" : ",") + std::string(c);
  for (const char* who : {"coord_", "workers_"})
    for (int s = 0; s <= kNumStages; ++s)
      h += "," + std::string(who) + (s < kNumStages ? stage_name(static_cast<Stage>(s)) : "other") + "_ms";
  return h;
}

// Refuses (InvalidArgument, naming the first differing column) a CSV whose
// header is not `header`; a missing or empty file is fine.
void check_csv_header(const std::string& path, const std::string& header) {
  {
    std::ifstream in(path);
    std::string first;
    // NOTE: a header ending in CR (a CSV rewritten with CRLF lines) is the same header.
    if (in && std::getline(in, first) && !first.empty() && first.back() == '\r') first.pop_back();
    if (!first.empty() && first != header) {
      // Name the first column that differs.
      std::stringstream a(first), b(header);
      std::string x, y;
      int i = 0;
      while (true) {
        const bool ha = static_cast<bool>(std::getline(a, x, ',')), hb = static_cast<bool>(std::getline(b, y, ','));
        if (!ha || !hb || x != y) {
          bad_arg("--csv " + path + " has other columns (column " + std::to_string(i + 1) + ": '" + (ha ? x : "") +
                  "', this build writes '" + (hb ? y : "") + "'); write to a new file");
        }
        ++i;
      }
    }
  }
}

// Appends `row` to the CSV at `path`, writing `header` first when the file is
// new or empty; refuses a file whose header differs. One write(2) per row.
void append_csv(const std::string& path, const std::string& header, const std::string& row) {
  check_csv_header(path, header);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_NONBLOCK | O_CLOEXEC, 0644);
  if (fd < 0) throw Error(Status::Io, "cannot open --csv " + path + ": " + std::strerror(errno));
  const bool empty = ::lseek(fd, 0, SEEK_END) == 0;
  const std::string text = (empty ? header + "\n" : std::string()) + row + "\n";
  const ssize_t n = ::write(fd, text.data(), text.size());
  const int err = errno;
  ::close(fd);
  if (n != static_cast<ssize_t>(text.size())) throw Error(Status::Io, "cannot write --csv " + path + ": " + std::strerror(err));
}

int bench_model_rank(const cxxopts::ParseResult& r, ClusterRuntime& rt, const std::string& command) {
  if (!r.count("model")) bad_arg("--model FILE is required (or --memory-bandwidth or --peak-flops)");
  const int64_t B = option_or(r, "batch", 1, Range<int64_t>{1, kMaxChunk});
  const int64_t P = option_or(r, "prompt-len", 128, Range<int64_t>{1, kMaxPositions});
  const int64_t N = option_or(r, "new-tokens", 32, Range<int64_t>{2, kMaxPositions, false,
                                                               "(the first token comes from the prefill, decode needs one more)"});
  const int64_t reps = option_or(r, "reps", 3, Range<int64_t>{1, 1000});
  const int64_t warmup = option_or(r, "warmup", 1, Range<int64_t>{0, 1000});
  const int64_t chunk = option_or(r, "prefill-chunk", 256, Range<int64_t>{1, kMaxChunk});
  const DType kv_dtype = r.count("kv-dtype") ? parse_kv_dtype(r["kv-dtype"].as<std::string>()) : DType::F32;
  const uint64_t seed = r.count("seed") ? r["seed"].as<uint64_t>() : 0;
  const bool as_json = r.count("json") > 0;
  const std::string kn = r.count("kernels") ? r["kernels"].as<std::string>() : "auto";
  if (kn != "auto" && !kernels::select(kn.c_str()))
    bad_arg("--kernels '" + kn + "' is not available on this CPU (auto, avx512, avx2, generic)");
  const int64_t topt = option_or(r, "threads", 0, Range<int64_t>{0, kernels::kMaxThreads, false, "(0 = all cores)"});
  const int rank = rt.rank, world = rt.world;
  const int threads = set_rank_threads(static_cast<int>(topt), world);

  ColibriFile::Options fo;
  fo.verify_dense = rank == 0 && r.count("no-verify") == 0;
  const std::string model_path = r["model"].as<std::string>();
  check_input(model_path, "--model");  // a FIFO or directory is refused at once
  std::shared_ptr<const ColibriFile> file = ColibriFile::open(model_path, fo);
  const ModelConfig& c = file->config();
  if (P + N > c.max_position_embeddings)
    bad_arg("--prompt-len " + std::to_string(P) + " + --new-tokens " + std::to_string(N) + " = " + std::to_string(P + N) +
            " positions exceed the model's context of " + std::to_string(c.max_position_embeddings));
  if (B * (P + N) > (int64_t{1} << 31)) bad_arg("--batch x (--prompt-len + --new-tokens) is too large");
  {
    // A rough lower bound of what the engine allocates and touches (KV cache,
    // logits and activations), so that a huge batch is refused rather than
    // killed by the OOM killer.
    const double width = c.attention == "mla" ? static_cast<double>(c.kv_lora_rank + c.qk_rope_head_dim)
                                              : 2.0 * static_cast<double>(c.num_kv_heads * c.head_dim);
    const double kv = static_cast<double>(c.num_layers) * static_cast<double>(B) * static_cast<double>(P + N) * width *
                      (kv_dtype == DType::F32 ? 4.0 : 2.0);
    const double rows = static_cast<double>(std::max(chunk, B));
    const double act = rows * (static_cast<double>(c.vocab_size) + 8.0 * static_cast<double>(c.hidden_size)) * 4;
    const double phys = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGESIZE));
    if (phys > 0 && kv + act > 0.8 * phys)
      bad_arg("--batch " + std::to_string(B) + " with " + std::to_string(P + N) + " positions needs at least " +
              human_bytes(kv + act) + " for the KV cache and activations, more than 80% of the " + human_bytes(phys) +
              " of memory");
  }
  ExpertSetup es = expert_setup(r, *file, rank, world);
  if (rank != 0) {
    serve_worker(rt, file, es);
    return 0;
  }
  if (!es.fault.empty())
    bad_arg("--inject-fault " + r["inject-fault"].as<std::string>() +
            ": bench kills worker ranks only (rank 0's faults are for colibri run)");
  // Before any work: a CSV this build cannot append to is refused now, not after the run.
  const std::string csv_path = r.count("csv") ? r["csv"].as<std::string>() : "";
  if (!csv_path.empty()) {
    check_output_options(r, {"csv"}, option_paths(r, {"model", "placement", "stats", "routing-replay"}));
    check_csv_header(csv_path, csv_header());
  }
  const std::shared_ptr<RoutingReplay> replay = es.replay;
  const std::string& replay_path = es.replay_path;
  // With several ranks, barriers separate waiting from transfer; with the dense
  // part on a GPU, the stream is synchronised at each stage (BackendOptions::sync_stages).
  const bool stage_sync = (world > 1 || es.dense_device >= 0) && r.count("no-stage-sync") == 0;

  const std::vector<Request> reqs = make_requests(c, B, P, N, seed);
  const TensorView& embd = file->tensor(tname::token_embd());

  ModelBytes bytes;
  bytes.batch = B;
  dense_bytes(*file, bytes);
  bytes.kv = kv_bytes_per_step(c, B, P, N, kv_dtype);

  // The timed runs.
  std::vector<RepResult> res;
  NoiseProbe noise;
  std::vector<std::vector<int32_t>> first_tokens;
  bool identical = true;
  Communicator& comm = *rt.comm;
  std::vector<cluster::RankReport> before, after;
  DispatchStats disp_before, disp_after;
  LayerBalance bal_before, bal_after;
  uint64_t decode_bytes = 0;  // rank 0's bytes sent + received during the timed decodes
  int sig = 0;                // the signal that stopped the benchmark, if one did
  {
    EngineOptions eo = engine_options(B, P, N, chunk);
    eo.kv_dtype = kv_dtype;
    eo.placement = es.placement;
    eo.store = es.store;
    eo.device = es.dense_device;
    eo.replay = replay;
    eo.stage_sync = stage_sync;
    Engine engine(file, eo, comm);
    engine.start_workers();
    engine.validate(reqs);
    spdlog::info("bench {}: {} layers, {} experts top-{}, batch {}, prompt {}, {} new tokens, {} rank(s), {} threads/rank, {} kernels",
                 file->path(), c.num_layers, c.num_experts, c.experts_per_token, B, P, N, world, threads,
                 kernels::active().name);
    // The matrix products' time and flops during prefill, and the bytes
    // exchanged so far: read when the last sequence's first token (the end of
    // prefill) arrives.
    GenerateOptions go;
    go.interrupt = stop_flag();  // SIGINT/SIGTERM: stop after the current forward pass
    int64_t first_seen = 0;
    kernels::GemmStats prefill_gemm;
    uint64_t bytes_at_prefill_end = 0;
    auto comm_bytes = [&] { return comm.stats().bytes_sent + comm.stats().bytes_received; };
    go.on_token = [&](int, int, int32_t) {
      if (++first_seen == B) {
        prefill_gemm = kernels::gemm_stats();
        bytes_at_prefill_end = comm_bytes();
      }
      return true;
    };
    auto snapshot = [&](std::vector<cluster::RankReport>& reports, DispatchStats& ds, LayerBalance& lb) {
      reports = rank_reports(engine, comm);
      ds = engine.dispatcher().stats(Phase::Decode);
      lb = engine.dispatcher().balance(Phase::Decode);
    };
    kernels::enable_gemm_stats(true);
    for (int64_t i = 0; i < warmup + reps; ++i) {
      if (i == warmup) {
        snapshot(before, disp_before, bal_before);
        noise.start();
      }
      RepResult rr;
      first_seen = 0;
      kernels::reset_gemm_stats();
      auto out = engine.generate(reqs, go, &rr.st);
      if (rr.st.interrupted) {
        sig = rr.st.interrupted;
        break;
      }
      rr.prefill_gemm_flops = prefill_gemm.flops;
      rr.prefill_gemm_seconds = prefill_gemm.seconds;
      rr.prefill_gemm_gflops = prefill_gemm.seconds > 0 ? prefill_gemm.flops / prefill_gemm.seconds / 1e9 : 0;
      std::vector<std::vector<int32_t>> toks;
      for (auto& o : out) toks.push_back(o.tokens);
      if (i == 0) first_tokens = toks;
      else if (toks != first_tokens) identical = false;
      if (i < warmup) {
        spdlog::info("warm-up {}: prefill {:.3f} s, decode {:.3f} s", i + 1, rr.st.prefill_seconds, rr.st.decode_seconds);
        continue;
      }
      decode_bytes += comm_bytes() - bytes_at_prefill_end;
      res.push_back(rr);
      spdlog::info("rep {}: prefill {:.3f} s, decode {:.3f} s", res.size(), rr.st.prefill_seconds, rr.st.decode_seconds);
    }
    noise.stop();
    snapshot(after, disp_after, bal_after);
    kernels::enable_gemm_stats(false);
    engine.stop_workers();
    if (world > 1) comm.barrier();
  }
  if (sig) {
    spdlog::warn("interrupted by {}: the benchmark stopped; nothing was printed or written", signal_name(sig));
    rt.finish();
    return 128 + sig;
  }
  if (!identical) spdlog::warn("the repetitions generated different tokens (the engine should be deterministic)");

  // The cluster figures of the timed window.
  ClusterFigures cf;
  double cpu_others = 0;  // the workers' CPU time: part of the benchmark, not noise
  for (size_t i = 0; i < after.size(); ++i) {
    cf.ranks.push_back(after[i].minus(before[i]));
    if (i > 0) cpu_others += cf.ranks.back().cpu_seconds;
  }
  noise.exclude(cpu_others);
  double decode_wall = 0;
  for (const auto& rr : res) {
    for (double t : rr.st.decode_step_seconds) cf.step_ms.push_back(1000.0 * t);
    decode_wall += rr.st.decode_seconds;
    cf.decode_tokens += static_cast<uint64_t>(rr.st.decode_tokens);
  }
  std::sort(cf.step_ms.begin(), cf.step_ms.end());
  std::vector<double> prefill_ms;  // every prefill forward pass of every timed rep, sorted
  for (const auto& rr : res)
    for (double t : rr.st.prefill_pass_seconds) prefill_ms.push_back(1000.0 * t);
  std::sort(prefill_ms.begin(), prefill_ms.end());
  cf.decode_steps = cf.step_ms.size();
  cf.p50 = percentile(cf.step_ms, 50), cf.p90 = percentile(cf.step_ms, 90), cf.p99 = percentile(cf.step_ms, 99);
  for (double t : cf.step_ms) cf.mean += t / static_cast<double>(cf.step_ms.size());
  const double per_token = 1.0 / static_cast<double>(std::max<uint64_t>(1, cf.decode_tokens));
  const double row_bytes = static_cast<double>(c.hidden_size) * sizeof(float);
  const DispatchStats dd = disp_after.minus(disp_before);
  cf.exchange_bytes_per_token = static_cast<double>(decode_bytes) * per_token;
  cf.min_bytes_per_token = 2.0 * static_cast<double>(dd.token_ranks_remote) * row_bytes * per_token;
  const LayerBalance lb = bal_after.minus(bal_before);
  const int64_t M = c.num_moe_layers(), K = c.experts_per_token;
  for (int l = 0; l < M; ++l) cf.balancedness.push_back(lb.mean(l));
  int counted = 0;
  for (double b : cf.balancedness)
    if (std::isfinite(b)) cf.balancedness_mean += b, ++counted;
  cf.balancedness_mean = counted ? cf.balancedness_mean / counted : kNaN;
  const double passes = static_cast<double>(std::max<uint64_t>(1, cf.ranks[0].stages.passes[1]));
  uint64_t hits = 0, acc = 0;
  for (const auto& rr : cf.ranks) {
    std::vector<double> ms;
    for (int s = 0; s < kNumStages; ++s) ms.push_back(1000.0 * rr.stages.at(Phase::Decode, static_cast<Stage>(s)) / passes);
    ms.push_back(std::max(0.0, 1000.0 * (decode_wall - rr.stages.total(Phase::Decode)) / passes));  // other
    cf.stage_ms.push_back(ms);
    const uint64_t a = rr.hits + rr.misses;
    cf.hit_rate.push_back(rr.experts_owned && a ? static_cast<double>(rr.hits) / static_cast<double>(a) : kNaN);
    if (rr.experts_owned) hits += rr.hits, acc += a;
    cf.rss_max_mib = std::max(cf.rss_max_mib, static_cast<double>(rr.peak_rss_kb) / 1024.0);
  }
  cf.hit_rate_all = acc ? static_cast<double>(hits) / static_cast<double>(acc) : kNaN;

  // Routed experts per decode step: the distinct experts the timed decode
  // steps chose, as the dispatcher counted them.
  double mean_block = 0;
  for (const auto& e : file->experts()) mean_block += static_cast<double>(e.size);
  mean_block /= std::max<size_t>(1, file->experts().size());
  const uint64_t block0 = file->experts().empty() ? 0 : file->experts().front().size;
  const double steps_timed = static_cast<double>(std::max<uint64_t>(1, cf.decode_steps));
  bytes.distinct_per_layer = static_cast<double>(dd.distinct_experts) / steps_timed / static_cast<double>(std::max<int64_t>(1, M));
  bytes.routed = static_cast<double>(dd.distinct_experts) / steps_timed * mean_block;
  bytes.routed_source = "distinct experts per MoE layer per decode step, counted over the " +
                        std::to_string(cf.decode_steps) + " timed steps";

  const int64_t steps = N - 1;
  const double wstep = bytes.weights_per_step();
  for (auto& rr : res) {
    const auto& st = rr.st;
    rr.prefill_tps = st.prefill_seconds > 0 ? st.prefill_tokens / st.prefill_seconds : 0;
    rr.decode_tps = st.decode_seconds > 0 ? st.decode_tokens / st.decode_seconds : 0;
    rr.ms_per_step = 1000.0 * st.decode_seconds / static_cast<double>(steps);
    const double steps_per_s = st.decode_seconds > 0 ? steps / st.decode_seconds : 0;
    rr.weight_gbps = wstep * steps_per_s / 1e9;
    rr.total_gbps = (wstep + bytes.kv) * steps_per_s / 1e9;
  }
  auto col = [&](double RepResult::*m) {
    std::vector<double> v;
    for (const auto& rr : res) v.push_back(rr.*m);
    return summarize(v);
  };
  const Summary pgemm = col(&RepResult::prefill_gemm_gflops);
  const Summary prefill = col(&RepResult::prefill_tps), decode = col(&RepResult::decode_tps),
                msps = col(&RepResult::ms_per_step), gbps = col(&RepResult::weight_gbps),
                tgbps = col(&RepResult::total_gbps);

  // Storage as the file says: the embedding table's dtype, and quantisation where used.
  std::string dtype = dtype_name(embd.dtype);
  if (c.dense_quant.type != "none")
    dtype += " (dense matrices " + c.dense_quant.type + " g" + std::to_string(c.dense_quant.group_size) + ")";
  const std::string edtype = file->experts().empty()                ? "-"
                             : c.expert_quant.type != "none" ? c.expert_quant.type + " g" + std::to_string(c.expert_quant.group_size)
                                                             : dtype_name(file->expert_dtype());
  const std::string placement_src = r.count("placement") ? r["placement"].as<std::string>() : "";
  const std::string policy = r.count("placement") ? "file" : r["policy"].as<std::string>();
  const bool coord_experts = world == 1 || r.count("coordinator-experts") > 0;
  const int64_t budget_experts = es.store.budget_experts;
  const uint64_t budget_bytes = es.store.budget_bytes;
  const std::string label = r.count("label") ? r["label"].as<std::string>() : "";

  std::string csv_row;
  if (!csv_path.empty()) {
    std::vector<std::pair<std::string, std::string>> f;
    auto add = [&](const std::string& k, const std::string& v) { f.emplace_back(k, v); };
    auto addi = [&](const std::string& k, long long v) { f.emplace_back(k, std::to_string(v)); };
    char ts[32];
    const std::time_t now = std::time(nullptr);
    std::strftime(ts, sizeof ts, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
    add("timestamp", ts);
    add("version", COLIBRI_VERSION);
    add("command", command);
    add("label", label);
    add("model", file->path());
    addi("layers", c.num_layers), addi("moe_layers", M), addi("experts", c.num_experts), addi("top_k", K);
    addi("hidden", c.hidden_size), addi("world", world);
    add("comm", comm.backend());
    add("policy", policy);
    add("placement", placement_src);
    addi("coordinator_experts", coord_experts);
    addi("batch", B), addi("prompt_len", P), addi("new_tokens", N), addi("warmup", warmup), addi("reps", reps);
    add("seed", std::to_string(seed));
    addi("threads", threads);
    add("kernels", kernels::active().name);
    add("cache_policy", es.store.policy);
    addi("cache_budget_experts", budget_experts);
    add("cache_budget_bytes", std::to_string(budget_bytes));
    add("routing_replay", replay_path);
    addi("stage_sync", stage_sync);
    add("prefill_tok_s", csv_num(prefill.median)), add("decode_tok_s", csv_num(decode.median));
    add("step_ms_p50", csv_num(cf.p50)), add("step_ms_p90", csv_num(cf.p90)), add("step_ms_p99", csv_num(cf.p99));
    add("step_ms_mean", csv_num(cf.mean));
    addi("decode_steps", static_cast<long long>(cf.decode_steps));
    add("exchange_bytes_per_token", csv_num(cf.exchange_bytes_per_token));
    add("exchange_min_bytes_per_token", csv_num(cf.min_bytes_per_token));
    add("balancedness_mean", csv_num(cf.balancedness_mean));
    add("balancedness_per_layer", join(cf.balancedness));
    add("hit_rate", csv_num(cf.hit_rate_all));
    add("hit_rate_per_rank", join(cf.hit_rate));
    add("peak_rss_mib_max", csv_num(cf.rss_max_mib));
    std::vector<double> rss;
    for (const auto& rr : cf.ranks) rss.push_back(static_cast<double>(rr.peak_rss_kb) / 1024.0);
    add("peak_rss_mib_per_rank", join(rss));
    for (int who = 0; who < 2; ++who)
      for (int s = 0; s <= kNumStages; ++s) {
        const std::string name = s < kNumStages ? stage_name(static_cast<Stage>(s)) : "other";
        double v = kNaN;
        if (who == 0) {
          v = cf.stage_ms[0][static_cast<size_t>(s)];
        } else if (world > 1) {
          v = 0;
          for (int q = 1; q < world; ++q) v += cf.stage_ms[static_cast<size_t>(q)][static_cast<size_t>(s)] / (world - 1);
        }
        add((who == 0 ? "coord_" : "workers_") + name + "_ms", csv_num(v));
      }
    std::string header;
    for (size_t i = 0; i < f.size(); ++i) {
      header += (i ? "," : "") + f[i].first;
      csv_row += (i ? "," : "") + csv_field(f[i].second);
    }
    if (header != csv_header()) throw Error(Status::Internal, "bench's CSV row does not follow its header");
  }
  // After the results are printed: the CSV row, then the end of the cluster.
  auto finish = [&] {
    if (!csv_path.empty()) append_csv(csv_path, csv_header(), csv_row);
    rt.finish();
    return 0;
  };

  if (as_json) {
    json reps_j = json::array();
    for (const auto& rr : res)
      reps_j.push_back({{"prefill_gemm_flops", rr.prefill_gemm_flops},
                        {"prefill_gemm_seconds", rr.prefill_gemm_seconds},
                        {"prefill_gemm_gflops", rr.prefill_gemm_gflops},
                        {"prefill_tokens", rr.st.prefill_tokens},
                        {"prefill_seconds", rr.st.prefill_seconds},
                        {"prefill_tokens_per_s", rr.prefill_tps},
                        {"decode_tokens", rr.st.decode_tokens},
                        {"decode_seconds", rr.st.decode_seconds},
                        {"decode_tokens_per_s", rr.decode_tps},
                        {"decode_ms_per_step", rr.ms_per_step},
                        {"weight_gbps", rr.weight_gbps},
                        {"weight_and_kv_gbps", rr.total_gbps}});
    json ranks_j = json::array();
    for (size_t i = 0; i < cf.ranks.size(); ++i) {
      const auto& rr = cf.ranks[i];
      json st, pst;
      for (int s = 0; s <= kNumStages; ++s)
        st[s < kNumStages ? stage_name(static_cast<Stage>(s)) : "other"] = cf.stage_ms[i][static_cast<size_t>(s)];
      // Prefill: per forward pass of up to --prefill-chunk tokens (no 'other').
      const double pp = static_cast<double>(std::max<uint64_t>(1, cf.ranks[0].stages.passes[0]));
      for (int s = 0; s < kNumStages; ++s)
        pst[stage_name(static_cast<Stage>(s))] = 1000.0 * rr.stages.at(Phase::Prefill, static_cast<Stage>(s)) / pp;
      ranks_j.push_back({{"rank", rr.rank},
                         {"experts_owned", rr.experts_owned},
                         {"cache_policy", rr.experts_owned ? rr.policy : ""},
                         {"cache_slots", rr.cache_slots},
                         {"hits", rr.hits},
                         {"misses", rr.misses},
                         {"hit_rate", num(cf.hit_rate[i])},
                         {"bytes_loaded", rr.bytes_loaded},
                         {"evictions", rr.evictions},
                         {"rows_served", rr.rows_served},
                         {"bytes_sent", rr.bytes_sent},
                         {"bytes_received", rr.bytes_received},
                         {"peak_rss_bytes", rr.peak_rss_kb * 1024},
                         {"cpu_seconds", rr.cpu_seconds},
                         {"decode_stage_ms_per_step", st},
                         {"prefill_stage_ms_per_pass", pst}});
    }
    json bal = json::array();
    for (double b : cf.balancedness) bal.push_back(num(b));
    json out = {
        {"mode", "model"},
        {"command", command},
        {"version", COLIBRI_VERSION},
        {"label", label},
        {"config",
         {{"model", file->path()},
          {"batch", B},
          {"prompt_len", P},
          {"new_tokens", N},
          {"decode_steps", steps},
          {"threads", threads},
          {"reps", reps},
          {"warmup", warmup},
          {"seed", seed},
          {"prefill_chunk", chunk},
          {"kv_dtype", dtype_name(kv_dtype)},
          {"kernels", kernels::active().name},
          {"sampling", "greedy"},
          {"ignore_eos", true},
          {"world", world},
          {"comm", comm.backend()},
          {"policy", policy},
          {"placement", placement_src},
          {"coordinator_experts", coord_experts},
          {"redundant", r["redundant"].as<int>()},
          {"stats", r.count("stats") ? r["stats"].as<std::string>() : ""},
          {"cache_policy", es.store.policy},
          {"cache_budget_experts", budget_experts},
          {"cache_budget_bytes", budget_bytes},
          {"routing_replay", replay_path},
          {"stage_sync", stage_sync},
          {"device", r["device"].as<std::string>()},
          {"coordinator_gpu", es.dense_device},
          {"expert_gpu", es.store.device}}},
        {"machine", {{"cpu", cpu_model()}, {"hardware_threads", std::thread::hardware_concurrency()}}},
        {"model",
         {{"architecture", c.architecture},
          {"dtype", dtype},
          {"expert_dtype", edtype},
          {"layers", c.num_layers},
          {"moe_layers", M},
          {"experts", c.num_experts},
          {"top_k", K},
          {"hidden_size", c.hidden_size},
          {"vocab_size", c.vocab_size},
          {"file_bytes", file->file_size()},
          {"expert_block_bytes", block0}}},
        {"bytes",
         {{"dense_per_step", bytes.dense},
          {"embedding_row", bytes.embedding_row},
          {"lm_head", bytes.lm_head},
          {"routed_experts_per_step", bytes.routed},
          {"distinct_experts_per_moe_layer_per_step", bytes.distinct_per_layer},
          {"routed_source", bytes.routed_source},
          {"weights_per_step", wstep},
          {"weights_per_token", bytes.weights_per_token()},
          {"kv_cache_per_step", bytes.kv},
          {"kv_cache_per_token", bytes.kv / static_cast<double>(B)}}},
        {"tokens_identical_across_runs", identical},
        {"noise", noise.to_json()},
        {"reps", reps_j},
        {"prefill_tokens_per_s", to_json(prefill)},
        {"prefill_gemm_gflops", to_json(pgemm)},
        {"decode_tokens_per_s", to_json(decode)},
        {"decode_ms_per_step", to_json(msps)},
        {"prefill_pass_ms", {{"p50", num(percentile(prefill_ms, 50))}, {"p90", num(percentile(prefill_ms, 90))},
                             {"p99", num(percentile(prefill_ms, 99))}, {"passes", prefill_ms.size()}}},
        {"decode_step_ms", {{"p50", num(cf.p50)}, {"p90", num(cf.p90)}, {"p99", num(cf.p99)}, {"mean", num(cf.mean)},
                            {"steps", cf.decode_steps}}},
        {"exchange", {{"bytes_per_decode_token", cf.exchange_bytes_per_token},
                      {"routing_minimum_bytes_per_decode_token", cf.min_bytes_per_token},
                      {"row_bytes", row_bytes}}},
        {"balancedness", {{"per_moe_layer", bal}, {"mean", num(cf.balancedness_mean)}}},
        {"hit_rate", num(cf.hit_rate_all)},
        {"ranks", ranks_j},
        {"weight_gbps", to_json(gbps)},
        {"weight_and_kv_gbps", to_json(tgbps)},
        {"median",
         {{"prefill_tokens_per_s", prefill.median},
          {"prefill_gemm_gflops", pgemm.median},
          {"decode_tokens_per_s", decode.median},
          {"decode_ms_per_step", msps.median},
          {"weight_gbps", gbps.median},
          {"weight_and_kv_gbps", tgbps.median}}},
    };
    std::printf("%s\n", out.dump(2).c_str());
    std::fflush(stdout);
    return finish();
  }

  std::printf("model:    %s\n", file->path().c_str());
  std::printf("          %s, %lld layers (%lld MoE), %lld experts top-%lld, hidden %lld, vocab %lld; dtype %s, experts %s\n",
              c.architecture.c_str(), (long long)c.num_layers, (long long)M, (long long)c.num_experts, (long long)K,
              (long long)c.hidden_size, (long long)c.vocab_size, dtype.c_str(), edtype.c_str());
  std::printf("run:      batch %lld, prompt %lld, %lld new tokens (%lld decode steps), greedy, ignore_eos, seed %llu\n",
              (long long)B, (long long)P, (long long)N, (long long)steps, (unsigned long long)seed);
  std::printf("          %d threads/rank, %s kernels, %lld warm-up + %lld reps, prefill chunk %lld; cpu %s\n", threads,
              kernels::active().name, (long long)warmup, (long long)reps, (long long)chunk, cpu_model().c_str());
  std::printf("cluster:  %d rank(s) over %s, placement %s%s, coordinator %s experts; cache %s, budget %lld experts / %llu bytes "
              "per rank%s%s\n",
              world, comm.backend(), policy.c_str(), placement_src.empty() ? "" : (" " + placement_src).c_str(),
              coord_experts ? "hosts" : "hosts no", es.store.policy.c_str(), (long long)budget_experts,
              (unsigned long long)budget_bytes, replay ? "; routing replayed from " : "", replay_path.c_str());
  std::printf("weights read per decode step: %s = dense %s + LM head %s + %lld embedding row(s) of %s + routed experts %s\n",
              human_bytes(wstep).c_str(), human_bytes(static_cast<double>(bytes.dense)).c_str(),
              human_bytes(static_cast<double>(bytes.lm_head)).c_str(), (long long)B,
              human_bytes(static_cast<double>(bytes.embedding_row)).c_str(), human_bytes(bytes.routed).c_str());
  std::printf("          routed: %.2f distinct experts per MoE layer per step x %s per block; %s\n",
              bytes.distinct_per_layer, human_bytes(static_cast<double>(block0)).c_str(), bytes.routed_source.c_str());
  std::printf("weights per decode token: %s (%.0f bytes); KV cache read per token (mean, not included): %s\n",
              human_bytes(bytes.weights_per_token()).c_str(), bytes.weights_per_token(),
              human_bytes(bytes.kv / static_cast<double>(B)).c_str());
  if (!identical) std::printf("WARNING: the runs generated different tokens\n");
  std::printf("\n%-7s %14s %14s %14s %12s %14s\n", "", "prefill tok/s", "decode tok/s", "decode ms/step", "weight GB/s",
              "+KV GB/s");
  for (size_t i = 0; i < res.size(); ++i)
    std::printf("rep %-3zu %14.1f %14.2f %14.3f %12.2f %14.2f\n", i + 1, res[i].prefill_tps, res[i].decode_tps,
                res[i].ms_per_step, res[i].weight_gbps, res[i].total_gbps);
  std::printf("%-7s %14.1f %14.2f %14.3f %12.2f %14.2f\n", "median", prefill.median, decode.median, msps.median,
              gbps.median, tgbps.median);
  std::printf("%-7s %14.1f %14.2f %14.3f %12.2f %14.2f\n", "min", prefill.min, decode.min, msps.min, gbps.min, tgbps.min);
  std::printf("%-7s %14.1f %14.2f %14.3f %12.2f %14.2f\n", "max", prefill.max, decode.max, msps.max, gbps.max, tgbps.max);
  std::printf("\nachieved weight bandwidth (median): %s/step x %.2f steps/s = %.2f GB/s%s\n", human_bytes(wstep).c_str(),
              msps.median > 0 ? 1000.0 / msps.median : 0.0, gbps.median, world > 1 ? " (all ranks together)" : "");
  std::printf("prefill matrix products (attention, router, dense/shared FFNs, experts, LM head): median %.1f GFLOP/s "
              "(min %.1f, max %.1f), %.1f GFLOP per prefill; compare --peak-flops (quantised products are not counted%s)\n",
              pgemm.median, pgemm.min, pgemm.max, res.empty() ? 0.0 : res.front().prefill_gemm_flops / 1e9,
              world > 1 ? "; rank 0's only" : "");
  std::printf("\ndecode step latency: P50 %.3f ms, P90 %.3f ms, P99 %.3f ms, mean %.3f ms (%llu steps of %lld reps)\n", cf.p50,
              cf.p90, cf.p99, cf.mean, (unsigned long long)cf.decode_steps, (long long)reps);
  std::printf("\ndecode stages, ms per step (rank 0 coordinates%s; 'other': step time outside the stages%s):\n",
              stage_sync ? "; barriers after the rows arrive and before the results return separate wait from exchange "
                           "(--no-stage-sync omits them)"
                         : "",
              world > 1 ? "; a worker's 'wait' includes the coordinator's own stages" : "");
  std::printf("%-5s", "rank");
  for (int s = 0; s <= kNumStages; ++s) std::printf(" %13s", s < kNumStages ? stage_name(static_cast<Stage>(s)) : "other");
  std::printf(" %9s\n", "total");
  for (size_t i = 0; i < cf.ranks.size(); ++i) {
    std::printf("%-5d", cf.ranks[i].rank);
    double t = 0;
    for (double v : cf.stage_ms[i]) std::printf(" %13.3f", v), t += v;
    std::printf(" %9.3f\n", t);
  }
  if (world > 1)
    std::printf("\nexchanged per decode token: %s (rank 0, sent + received); routing minimum %s (each token once to each "
                "other rank serving it, and back; %.0f-byte f32 rows) = %.2fx the minimum\n",
                human_bytes(cf.exchange_bytes_per_token).c_str(), human_bytes(cf.min_bytes_per_token).c_str(), row_bytes,
                cf.min_bytes_per_token > 0 ? cf.exchange_bytes_per_token / cf.min_bytes_per_token : 0.0);
  std::printf("balancedness per MoE layer (decode, mean/max rows over the host ranks, mean over steps):");
  for (double b : cf.balancedness) std::printf(" %.3f", b);
  std::printf("; mean %.3f\n", cf.balancedness_mean);
  std::printf("\n%-5s %-8s %7s %8s %9s %9s %9s %11s %9s\n", "rank", "policy", "experts", "slots", "hits", "misses",
              "hit rate", "rows served", "RSS MiB");
  for (size_t i = 0; i < cf.ranks.size(); ++i) {
    const auto& rr = cf.ranks[i];
    char hr[16] = "-";
    if (std::isfinite(cf.hit_rate[i])) std::snprintf(hr, sizeof hr, "%.1f%%", 100.0 * cf.hit_rate[i]);
    std::printf("%-5d %-8s %7d %8llu %9llu %9llu %9s %11llu %9.1f\n", rr.rank, rr.experts_owned ? rr.policy : "-",
                rr.experts_owned, (unsigned long long)rr.cache_slots, (unsigned long long)rr.hits,
                (unsigned long long)rr.misses, hr, (unsigned long long)rr.rows_served, rr.peak_rss_kb / 1024.0);
  }
  noise.print();
  std::fflush(stdout);
  return finish();
}

int bench_model(const cxxopts::ParseResult& r, const std::string& command) {
  ClusterRuntime rt = open_cluster(r);
  return run_guarded(rt, [&] { return bench_model_rank(r, rt, command); });
}

// ===========================================================================
// Memory bandwidth (STREAM)

// Huge-page aligned, untouched memory (first touch happens in the parallel init).
struct Array {
  double* p = nullptr;
  size_t bytes = 0;
  explicit Array(size_t n) {
    const size_t align = size_t{2} << 20;
    bytes = (n * sizeof(double) + align - 1) / align * align;
    p = static_cast<double*>(std::aligned_alloc(align, bytes));
    if (!p) throw std::bad_alloc();
    madvise(p, bytes, MADV_HUGEPAGE);  // a hint; failure is harmless
  }
  ~Array() { std::free(p); }
  Array(const Array&) = delete;
  Array& operator=(const Array&) = delete;
};

// NOTE: no memcpy/memset substitution: STREAM measures the plain loops.
__attribute__((optimize("no-tree-loop-distribute-patterns"))) void k_copy(double* __restrict c,
                                                                           const double* __restrict a, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < n; ++j) c[j] = a[j];
}
void k_scale(double* __restrict b, const double* __restrict c, double s, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < n; ++j) b[j] = s * c[j];
}
void k_add(double* __restrict c, const double* __restrict a, const double* __restrict b, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < n; ++j) c[j] = a[j] + b[j];
}
void k_triad(double* __restrict a, const double* __restrict b, const double* __restrict c, double s, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < n; ++j) a[j] = b[j] + s * c[j];
}
// Read-only: 16 independent partial sums per thread so that the adds never
// limit the rate (a single chain would: the compiler may not reorder FP adds).
double k_sum(const double* __restrict a, int64_t n) {
  double total = 0;
#pragma omp parallel reduction(+ : total)
  {
    double s[16] = {0};
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < n / 16; ++blk)
      for (int k = 0; k < 16; ++k) s[k] += a[blk * 16 + k];
    double t = 0;
    for (int k = 0; k < 16; ++k) t += s[k];
    total += t;
  }
  return total;
}

volatile double g_sink;  // keeps every sum observable

int bench_memory(const cxxopts::ParseResult& r) {
  const int64_t mb = option_or(r, "size-mb", 1024, Range<int64_t>{1, int64_t{1} << 30});  // then: what memory holds
  const int64_t reps = option_or(r, "reps", 10, Range<int64_t>{1, 100, false,
                                                             "for --memory-bandwidth (the values grow 15x per repetition)"});
  const int64_t topt = option_or(r, "threads", 0, Range<int64_t>{0, kernels::kMaxThreads, false, "(0 = all cores)"});
  const bool as_json = r.count("json") > 0;
  const double phys = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGESIZE));
  const double need = 3.0 * static_cast<double>(mb) * 1048576.0;
  if (phys > 0 && need > 0.8 * phys)
    bad_arg("--size-mb " + std::to_string(mb) + ": three arrays need " + human_bytes(need) + ", more than 80% of the " +
            human_bytes(phys) + " of memory");
  const double l3 = l3_cache_bytes();
  if (l3 > 0 && static_cast<double>(mb) * 1048576.0 < 4.0 * l3)
    spdlog::warn("--size-mb {} is less than 4x the {} L3 cache: part of the traffic may hit the cache", mb,
                 human_bytes(l3));
  const int threads = kernels::set_threads(static_cast<int>(topt));
  const int64_t n = mb * 1048576 / static_cast<int64_t>(sizeof(double));  // a multiple of 16

  Array A(static_cast<size_t>(n)), Bv(static_cast<size_t>(n)), C(static_cast<size_t>(n));
  double *a = A.p, *b = Bv.p, *c = C.p;
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < n; ++j) {
    a[j] = 1.0;
    b[j] = 2.0;
    c[j] = 0.0;
  }
  const double scalar = 3.0;
  const char* names[5] = {"copy", "scale", "add", "triad", "sum"};
  const int arrays[5] = {2, 2, 3, 3, 1};
  std::vector<double> times[5];
  double aj = 1.0, bj = 2.0, cj = 0.0;  // the expected values, replayed
  bool sum_ok = true;
  double worst_sum_err = 0;
  NoiseProbe noise;
  // One untimed warm-up iteration, then `reps` timed ones.
  for (int64_t it = 0; it <= reps; ++it) {
    if (it == 1) noise.start();
    double t[5];
    double t0 = omp_get_wtime();
    k_copy(c, a, n);
    t[0] = omp_get_wtime() - t0;
    t0 = omp_get_wtime();
    k_scale(b, c, scalar, n);
    t[1] = omp_get_wtime() - t0;
    t0 = omp_get_wtime();
    k_add(c, a, b, n);
    t[2] = omp_get_wtime() - t0;
    t0 = omp_get_wtime();
    k_triad(a, b, c, scalar, n);
    t[3] = omp_get_wtime() - t0;
    t0 = omp_get_wtime();
    const double s = k_sum(a, n);
    t[4] = omp_get_wtime() - t0;
    g_sink = s;
    cj = aj;
    bj = scalar * cj;
    cj = aj + bj;
    aj = bj + scalar * cj;
    const double want = aj * static_cast<double>(n);
    const double err = std::fabs(s - want) / want;
    worst_sum_err = std::max(worst_sum_err, err);
    if (!(err < 1e-6)) sum_ok = false;
    if (it > 0)
      for (int k = 0; k < 5; ++k) times[k].push_back(t[k]);
  }
  noise.stop();
  // STREAM's check: the mean absolute error of each array against the replayed value.
  double ea = 0, eb = 0, ec = 0;
#pragma omp parallel for schedule(static) reduction(+ : ea, eb, ec)
  for (int64_t j = 0; j < n; ++j) {
    ea += std::fabs(a[j] - aj);
    eb += std::fabs(b[j] - bj);
    ec += std::fabs(c[j] - cj);
  }
  ea /= static_cast<double>(n);
  eb /= static_cast<double>(n);
  ec /= static_cast<double>(n);
  const double eps = 1e-13;
  if (!(ea / std::fabs(aj) < eps) || !(eb / std::fabs(bj) < eps) || !(ec / std::fabs(cj) < eps))
    throw Error(Status::Internal, "STREAM validation failed: mean relative errors a " + std::to_string(ea / aj) + ", b " +
                                      std::to_string(eb / bj) + ", c " + std::to_string(ec / cj));
  if (!sum_ok)
    throw Error(Status::Internal, "STREAM validation failed: the sum kernel is off by a relative " +
                                      std::to_string(worst_sum_err));

  const double array_bytes = static_cast<double>(n) * sizeof(double);
  json kj = json::object();
  struct Line {
    double best, median, worst, best_s, bytes;
  };
  std::vector<Line> lines;
  for (int k = 0; k < 5; ++k) {
    const double bytes = arrays[k] * array_bytes;
    std::vector<double> rates;
    for (double t : times[k]) rates.push_back(t > 0 ? bytes / t / 1e9 : 0);
    const Summary s = summarize(rates);
    const double best_s = *std::min_element(times[k].begin(), times[k].end());
    lines.push_back({s.max, s.median, s.min, best_s, bytes});
    kj[names[k]] = {{"bytes_per_iteration", bytes},
                    {"arrays_counted", arrays[k]},
                    {"best_gbps", s.max},
                    {"median_gbps", s.median},
                    {"worst_gbps", s.min},
                    {"seconds", times[k]}};
  }
  if (as_json) {
    json out = {{"mode", "memory-bandwidth"},
                {"config", {{"threads", threads}, {"size_mb", mb}, {"reps", reps}, {"array_bytes", array_bytes}}},
                {"machine",
                 {{"cpu", cpu_model()}, {"hardware_threads", std::thread::hardware_concurrency()}, {"l3_cache_bytes", l3}}},
                {"validated", true},
                {"noise", noise.to_json()},
                {"kernels", kj}};
    std::printf("%s\n", out.dump(2).c_str());
    return 0;
  }
  std::printf("STREAM-style memory bandwidth: %d threads, 3 arrays of %lld MiB (double), %lld reps after 1 warm-up; cpu %s\n",
              threads, (long long)mb, (long long)reps, cpu_model().c_str());
  std::printf("GB/s = 10^9 bytes/s; Copy/Scale count 2 arrays, Add/Triad 3, Sum 1 (read only)\n\n");
  std::printf("%-8s %12s %12s %12s %12s\n", "kernel", "best GB/s", "median GB/s", "worst GB/s", "best time s");
  for (int k = 0; k < 5; ++k)
    std::printf("%-8s %12.2f %12.2f %12.2f %12.6f\n", names[k], lines[static_cast<size_t>(k)].best,
                lines[static_cast<size_t>(k)].median, lines[static_cast<size_t>(k)].worst,
                lines[static_cast<size_t>(k)].best_s);
  std::printf("\nvalidation: passed (arrays within 1e-13 of the replayed values, sums within 1e-6)\n");
  noise.print();
  return 0;
}

// ===========================================================================
// Peak f32 FMA throughput

constexpr int kChains = 12;

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) float fma_avx2(int64_t iters, float m, float add) {
  const __m256 vm = _mm256_set1_ps(m), va = _mm256_set1_ps(add);
  __m256 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm256_set1_ps(0.01f * static_cast<float>(i + 1));
  for (int64_t it = 0; it < iters; ++it) {
    acc[0] = _mm256_fmadd_ps(acc[0], vm, va);
    acc[1] = _mm256_fmadd_ps(acc[1], vm, va);
    acc[2] = _mm256_fmadd_ps(acc[2], vm, va);
    acc[3] = _mm256_fmadd_ps(acc[3], vm, va);
    acc[4] = _mm256_fmadd_ps(acc[4], vm, va);
    acc[5] = _mm256_fmadd_ps(acc[5], vm, va);
    acc[6] = _mm256_fmadd_ps(acc[6], vm, va);
    acc[7] = _mm256_fmadd_ps(acc[7], vm, va);
    acc[8] = _mm256_fmadd_ps(acc[8], vm, va);
    acc[9] = _mm256_fmadd_ps(acc[9], vm, va);
    acc[10] = _mm256_fmadd_ps(acc[10], vm, va);
    acc[11] = _mm256_fmadd_ps(acc[11], vm, va);
  }
  __m256 s = acc[0];
  for (int i = 1; i < kChains; ++i) s = _mm256_add_ps(s, acc[i]);
  alignas(32) float out[8];
  _mm256_store_ps(out, s);
  float t = 0;
  for (float v : out) t += v;
  return t;
}

__attribute__((target("avx512f"))) float fma_avx512(int64_t iters, float m, float add) {
  const __m512 vm = _mm512_set1_ps(m), va = _mm512_set1_ps(add);
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(0.01f * static_cast<float>(i + 1));
  for (int64_t it = 0; it < iters; ++it) {
    acc[0] = _mm512_fmadd_ps(acc[0], vm, va);
    acc[1] = _mm512_fmadd_ps(acc[1], vm, va);
    acc[2] = _mm512_fmadd_ps(acc[2], vm, va);
    acc[3] = _mm512_fmadd_ps(acc[3], vm, va);
    acc[4] = _mm512_fmadd_ps(acc[4], vm, va);
    acc[5] = _mm512_fmadd_ps(acc[5], vm, va);
    acc[6] = _mm512_fmadd_ps(acc[6], vm, va);
    acc[7] = _mm512_fmadd_ps(acc[7], vm, va);
    acc[8] = _mm512_fmadd_ps(acc[8], vm, va);
    acc[9] = _mm512_fmadd_ps(acc[9], vm, va);
    acc[10] = _mm512_fmadd_ps(acc[10], vm, va);
    acc[11] = _mm512_fmadd_ps(acc[11], vm, va);
  }
  __m512 s = acc[0];
  for (int i = 1; i < kChains; ++i) s = _mm512_add_ps(s, acc[i]);
  alignas(64) float out[16];
  _mm512_store_ps(out, s);
  float t = 0;
  for (float v : out) t += v;
  return t;
}
#elif defined(__aarch64__)
// Advanced SIMD (NEON) is part of the aarch64 base ISA: 4 f32 lanes, FMLA.
float fma_neon(int64_t iters, float m, float add) {
  const float32x4_t vm = vdupq_n_f32(m), va = vdupq_n_f32(add);
  float32x4_t acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = vdupq_n_f32(0.01f * static_cast<float>(i + 1));
  for (int64_t it = 0; it < iters; ++it) {
    acc[0] = vfmaq_f32(va, acc[0], vm);
    acc[1] = vfmaq_f32(va, acc[1], vm);
    acc[2] = vfmaq_f32(va, acc[2], vm);
    acc[3] = vfmaq_f32(va, acc[3], vm);
    acc[4] = vfmaq_f32(va, acc[4], vm);
    acc[5] = vfmaq_f32(va, acc[5], vm);
    acc[6] = vfmaq_f32(va, acc[6], vm);
    acc[7] = vfmaq_f32(va, acc[7], vm);
    acc[8] = vfmaq_f32(va, acc[8], vm);
    acc[9] = vfmaq_f32(va, acc[9], vm);
    acc[10] = vfmaq_f32(va, acc[10], vm);
    acc[11] = vfmaq_f32(va, acc[11], vm);
  }
  float32x4_t s = acc[0];
  for (int i = 1; i < kChains; ++i) s = vaddq_f32(s, acc[i]);
  return vaddvq_f32(s);
}
#endif

volatile float g_fsink;
volatile float g_mul = 0.999999f, g_add = 1e-6f;  // read at run time: nothing to fold

struct Isa {
  const char* name;
  int lanes;
  float (*fn)(int64_t, float, float);
  bool available;
};

int bench_flops(const cxxopts::ParseResult& r) {
  const int64_t reps = option_or(r, "reps", 3, Range<int64_t>{1, 1000});
  const int64_t topt = option_or(r, "threads", 0, Range<int64_t>{0, kernels::kMaxThreads, false, "(0 = all cores)"});
  const bool as_json = r.count("json") > 0;
  const int threads = kernels::set_threads(static_cast<int>(topt));
#if defined(__x86_64__)
  __builtin_cpu_init();
  const std::vector<Isa> isas = {
      {"avx2+fma", 8, fma_avx2, __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")},
      {"avx512f", 16, fma_avx512, static_cast<bool>(__builtin_cpu_supports("avx512f"))},
  };
#elif defined(__aarch64__)
  const std::vector<Isa> isas = {{"neon", 4, fma_neon, true}};
#else
  const std::vector<Isa> isas;  // no vector FMA kernel written for this architecture
#endif
  json ij = json::object();
  struct Line {
    const char* name;
    int lanes;
    Summary gf;
    double seconds;
    int64_t iters;
  };
  std::vector<Line> lines;
  NoiseProbe noise;
  noise.start();
  for (const auto& isa : isas) {
    if (!isa.available) {
      spdlog::info("{}: not supported by this CPU, skipped", isa.name);
      continue;
    }
    // Calibrate on one thread: iterations for about 0.3 s.
    int64_t iters = 1 << 16;
    for (;;) {
      const double t0 = omp_get_wtime();
      g_fsink = isa.fn(iters, g_mul, g_add);
      const double dt = omp_get_wtime() - t0;
      if (dt > 0.03 || iters > (int64_t{1} << 40)) {
        iters = static_cast<int64_t>(static_cast<double>(iters) * 0.3 / std::max(dt, 1e-9));
        break;
      }
      iters *= 2;
    }
    iters = std::max<int64_t>(iters, 1);
    std::vector<double> gfs, secs;
    for (int64_t rep = 0; rep < reps; ++rep) {
      double t0 = 0, t1 = 0;
      float total = 0;
      int team = 1;
#pragma omp parallel reduction(+ : total)
      {
#pragma omp barrier
#pragma omp master
        {
          team = omp_get_num_threads();
          t0 = omp_get_wtime();
        }
        total += isa.fn(iters, g_mul, g_add);
#pragma omp barrier
#pragma omp master
        t1 = omp_get_wtime();
      }
      g_fsink = total;
      const double flops = static_cast<double>(team) * static_cast<double>(iters) * kChains * isa.lanes * 2.0;
      gfs.push_back(flops / (t1 - t0) / 1e9);
      secs.push_back(t1 - t0);
    }
    const Summary s = summarize(gfs);
    lines.push_back({isa.name, isa.lanes, s, summarize(secs).median, iters});
    ij[isa.name] = {{"lanes", isa.lanes},
                    {"chains", kChains},
                    {"iterations_per_thread", iters},
                    {"best_gflops", s.max},
                    {"median_gflops", s.median},
                    {"worst_gflops", s.min},
                    {"best_gflops_per_thread", s.max / threads},
                    {"gflops", gfs}};
  }
  noise.stop();
  if (as_json) {
    json out = {{"mode", "peak-flops"},
                {"noise", noise.to_json()},
                {"config", {{"threads", threads}, {"reps", reps}, {"chains", kChains}}},
                {"machine", {{"cpu", cpu_model()}, {"hardware_threads", std::thread::hardware_concurrency()}}},
                {"isas", ij}};
    std::printf("%s\n", out.dump(2).c_str());
    return 0;
  }
  std::printf("f32 FMA peak: %d threads, %d independent FMA chains per thread, %lld reps of about 0.3 s; cpu %s\n",
              threads, kChains, (long long)reps, cpu_model().c_str());
  std::printf("GFLOP/s = FMAs x lanes x 2 / s / 10^9\n\n");
  std::printf("%-10s %6s %12s %14s %14s %18s\n", "isa", "lanes", "best GFLOP/s", "median GFLOP/s", "worst GFLOP/s",
              "best per thread");
  for (const auto& l : lines)
    std::printf("%-10s %6d %12.1f %14.1f %14.1f %18.1f\n", l.name, l.lanes, l.gf.max, l.gf.median, l.gf.min,
                l.gf.max / threads);
  if (lines.empty()) std::printf("(no vector FMA kernel for this CPU: x86-64 needs AVX2+FMA or AVX-512F)\n");
  noise.print();
  return 0;
}

// A deterministic mixed text of about `bytes` bytes: English prose, code,
// numbers, punctuation and whitespace runs, Cyrillic, CJK and emoji.
std::string synthetic_text(size_t bytes) {
  static const char* const parts[] = {
      "The quick brown fox jumps over the lazy dog. ", "It was the best of times, it was the worst of times; ",
      "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }\n", "def tokenize(text):\n    return [t for t in text.split()]\n",
      "3.14159 2718 1,000,000 0x7fff -42 ", "    \t  \n\n", "Привет, мир! Как дела? ", "日本語のテキストと中文文本。",
      "emoji 🙂🚀👍🏽 ", "\"quoted\" (parens) [brackets] {braces} <tags/> ", "naïve café résumé Ünïcödé ",
      "https://example.com/path?q=1&r=2 ", "ALLCAPS lowercase MixedCase snake_case camelCase ", "\n"};
  const size_t np = sizeof parts / sizeof parts[0];
  std::string t;
  t.reserve(bytes + 64);
  uint64_t x = 0x9E3779B97F4A7C15ull;
  while (t.size() < bytes) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;  // xorshift64
    t += parts[x % np];
  }
  return t;
}

// colibri bench --tokenizer --model F [--text-file T]: the embedded tokenizer's
// encode and decode speed (MB/s of text, median of --reps) and tokens per byte.
int bench_tokenizer(const cxxopts::ParseResult& r) {
  if (!r.count("model")) bad_arg("--tokenizer needs --model FILE (a .colibri file with an embedded tokenizer)");
  const int64_t reps = option_or(r, "reps", 5, Range<int64_t>{1, 1000});
  const bool as_json = r.count("json") > 0;
  ColibriFile::Options fo;
  fo.verify_dense = false;
  auto file = ColibriFile::open(r["model"].as<std::string>(), fo);
  auto tok = open_tokenizer(*file);
  std::string text, source = "synthetic";
  if (r.count("text-file")) {
    source = r["text-file"].as<std::string>();
    text = read_input(source, "--text-file");
    if (text.empty()) bad_arg("--text-file '" + source + "' is empty");
  } else {
    const int64_t kib = option_or(r, "text-kib", 4096, Range<int64_t>{1, 1 << 20});
    text = synthetic_text(static_cast<size_t>(kib) << 10);
  }
  using clock = std::chrono::steady_clock;
  std::vector<double> enc_mbs, dec_mbs, enc_tps;
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < reps; ++i) {
    auto t0 = clock::now();
    ids = tok->encode(text, false);
    auto t1 = clock::now();
    const std::string back = tok->decode(ids, false);
    auto t2 = clock::now();
    const double es = std::chrono::duration<double>(t1 - t0).count(), ds = std::chrono::duration<double>(t2 - t1).count();
    enc_mbs.push_back(text.size() / 1e6 / std::max(es, 1e-9));
    dec_mbs.push_back(back.size() / 1e6 / std::max(ds, 1e-9));
    enc_tps.push_back(ids.size() / std::max(es, 1e-9));
  }
  const Summary e = summarize(enc_mbs), d = summarize(dec_mbs), tps = summarize(enc_tps);
  const double tpb = static_cast<double>(ids.size()) / static_cast<double>(text.size());
  const TokenizerSpec& ts = file->config().tokenizer;
  if (as_json) {
    json out = {{"mode", "tokenizer"},
                {"model", file->path()},
                {"kind", ts.kind},
                {"tokenizer_vocab", ts.vocab_size},
                {"text", source},
                {"text_bytes", text.size()},
                {"tokens", ids.size()},
                {"tokens_per_byte", tpb},
                {"reps", reps},
                {"encode_mb_per_s", to_json(e)},
                {"decode_mb_per_s", to_json(d)},
                {"encode_tokens_per_s", to_json(tps)}};
    std::printf("%s\n", out.dump(2).c_str());
  } else {
    std::printf("tokenizer %s (%lld ids) of %s; text: %s, %zu bytes -> %zu tokens (%.3f tokens/byte), %lld reps\n",
                printable(ts.kind).c_str(), (long long)ts.vocab_size, file->path().c_str(), source.c_str(), text.size(), ids.size(),
                tpb, (long long)reps);
    std::printf("encode   %8.2f MB/s median (min %.2f, max %.2f) = %.0f tokens/s\n", e.median, e.min, e.max, tps.median);
    std::printf("decode   %8.2f MB/s median (min %.2f, max %.2f)\n", d.median, d.min, d.max);
    std::printf("compare: encode's tokens/s with the prefill tokens/s of `colibri bench --model` (one thread here)\n");
  }
  return 0;
}

}  // namespace

int cmd_bench(int argc, char** argv) {
  cxxopts::Options o("colibri bench",
                     "Measure generation speed, memory bandwidth or peak FMA throughput (docs/benchmarks.md).\n"
                     "  colibri bench --model FILE [--batch B --prompt-len P --new-tokens N --reps R --warmup W]\n"
                     "  colibri launch -n N -- bench --model FILE [--policy P --expert-cache-experts C\n"
                     "      --routing-replay T --csv F --json]   (a cluster: stages, exchange, balance; docs/scaling.md)\n"
                     "  colibri bench --memory-bandwidth [--size-mb M --reps R]\n"
                     "  colibri bench --peak-flops [--reps R]\n"
                     "  colibri bench --tokenizer --model FILE [--text-file T | --text-kib K] [--reps R]");
  o.add_options()("m,model", ".colibri model file to benchmark", cxxopts::value<std::string>())(
      "memory-bandwidth", "STREAM-style memory bandwidth (Copy, Scale, Add, Triad, Sum) instead of a model")(
      "peak-flops", "f32 FMA throughput per ISA (x86-64: AVX2+FMA, AVX-512F; aarch64: NEON) instead of a model")(
      "tokenizer", "Encode/decode speed of the model's embedded tokenizer instead of generation")(
      "text-file", "--tokenizer: the text to encode (default: a built-in 4 MiB mixed text)", cxxopts::value<std::string>())(
      "text-kib", "--tokenizer: KiB of the built-in text, 1..1048576 (default 4096)", cxxopts::value<int64_t>())(
      "t,threads", "Compute threads, 0..1024; 0 = all cores (default 0)", cxxopts::value<int64_t>())(
      "reps", "Timed repetitions, 1..1000 (memory: ..100; default: model 3, memory 10, flops 3)", cxxopts::value<int64_t>())(
      "json", "Print one JSON object with the configuration and every measurement");
  o.add_options("model")("b,batch", "Sequences generated together, 1..65536 (default 1)", cxxopts::value<int64_t>())(
      "prompt-len", "Random prompt tokens per sequence, >= 1 (default 128)", cxxopts::value<int64_t>())(
      "new-tokens", "Tokens generated per sequence, >= 2 (default 32)", cxxopts::value<int64_t>())(
      "warmup", "Untimed runs before the timed ones, 0..1000 (default 1)", cxxopts::value<int64_t>())(
      "seed", "Seed of the random prompts (default 0)", cxxopts::value<uint64_t>())(
      "prefill-chunk", "Most tokens per prefill pass, 1..65536 (default 256)", cxxopts::value<int64_t>())(
      "kv-dtype", "KV cache storage: f32 (default), bf16 or f16", cxxopts::value<std::string>())(
      "kernels", "CPU kernels: auto, avx512, avx2 or generic (default auto: the widest the CPU has)", cxxopts::value<std::string>())(
      "no-verify", "Skip the checksum check of dense tensors at load")(
      "csv", "Append one row (configuration, then results) to this CSV; the header first when the file is new",
      cxxopts::value<std::string>())(
      "label", "Free text recorded in --json/--csv (e.g. a sweep's name)", cxxopts::value<std::string>())(
      "no-stage-sync", "Several ranks: no barrier before results return (wait and exchange then mix); the dense part "
      "on a GPU: no stream synchronisation per stage (its time then shows where the host waits)");
  add_cluster_options(o);
  o.add_options("memory")("size-mb", "MiB per array, >= 1 (default 1024; keep it well above the L3 cache)",
                          cxxopts::value<int64_t>());
  add_common_options(o);
  auto r = o.parse(argc, argv);
  if (handle_common(o, r)) return 0;
  if (!r.unmatched().empty()) bad_arg("unexpected argument '" + r.unmatched().front() + "'");

  const bool mem = r.count("memory-bandwidth") > 0, flops = r.count("peak-flops") > 0, model = r.count("model") > 0;
  if (mem + flops + model > 1) bad_arg("give one of --model, --memory-bandwidth and --peak-flops");
  const char* model_only[] = {"batch", "prompt-len", "new-tokens", "warmup", "seed", "prefill-chunk", "kv-dtype", "kernels",
                              "no-verify", "routing-replay", "csv", "label", "no-stage-sync", "placement", "stats",
                              "coordinator-experts", "inject-fault"};
  if (mem || flops) {
    for (const char* k : model_only)
      if (r.count(k)) bad_arg(std::string("--") + k + " applies to a model benchmark (--model), not to " +
                              (mem ? "--memory-bandwidth" : "--peak-flops"));
  }
  if (r.count("size-mb") && !mem) bad_arg("--size-mb applies to --memory-bandwidth only");
  if (r.count("text-file") && !r.count("tokenizer")) bad_arg("--text-file applies to --tokenizer only");
  if (r.count("text-kib") && !r.count("tokenizer")) bad_arg("--text-kib applies to --tokenizer only");
  if (r.count("text-kib") && r.count("text-file")) bad_arg("give one of --text-file and --text-kib");
  if (r.count("tokenizer")) {
    if (mem || flops) bad_arg("give one of --tokenizer, --memory-bandwidth and --peak-flops");
    return bench_tokenizer(r);
  }
  if (mem) return bench_memory(r);
  if (flops) return bench_flops(r);
  std::string command = "colibri";
  for (int i = 0; i < argc; ++i) command += " " + shell_quote(argv[i]);
  return bench_model(r, command);
}

}  // namespace colibri::cli
