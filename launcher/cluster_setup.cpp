// cluster_setup.cpp: the cluster plumbing shared by `colibri run` and `colibri bench`.
#include "launcher/cluster_setup.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "kernels/cpu/kernels.h"
#include "launcher/options.h"
#include "launcher/signals.h"
#include "model/error.h"
#include "model/printable.h"
#include "worker/worker.h"

namespace colibri::cli {

void add_cluster_options(cxxopts::Options& o, bool one_process) {
  // colibri generate: the options it refuses (refuse_cluster_only_options) say so.
  // NOTE: at the start of the description, where --help keeps it on the option's line.
  const std::string run_only = one_process ? "[colibri run only: generate refuses it] " : "";
  o.add_options("experts")("placement", run_only + "Placement JSON (which ranks own which experts)",
                           cxxopts::value<std::string>())(
      "policy", run_only + "Without --placement: contiguous, round_robin, balanced or replicated",
      cxxopts::value<std::string>()->default_value("contiguous"))(
      "stats",
      std::string(one_process ? "[generate: with --cache-policy pinned only] " : "") +
          "Expert-load STATS.json for the balanced/replicated policies and the pinned cache",
      cxxopts::value<std::string>())(
      "redundant", run_only + "Replicated policy: extra replicas per layer, 0..65536",
      cxxopts::value<int>()->default_value("0"))(
      "coordinator-experts", run_only + "Rank 0 hosts experts too (always so with one rank)")(
      "expert-cache-bytes", "Fast-tier budget per rank in bytes (K/M/G suffix); 0 = no fast tier",
      cxxopts::value<std::string>()->default_value("0"))(
      "expert-cache-experts", "Fast-tier budget per rank in experts, 0..2^24", cxxopts::value<int64_t>()->default_value("0"))(
      "cache-policy", "lru, lfu, hybrid, pinned, ...", cxxopts::value<std::string>()->default_value("lru"))(
      "cache-decay", "Hybrid policy: decay per tick, in (0, 1]", cxxopts::value<double>()->default_value("0.9"))(
      "routing-replay",
      "Replace the router's choices with a recorded trace's (the model's top-k, no more experts than it has, "
      "at least its MoE layers; e.g. ../shared/traces/mixtral-8x7b/*.jsonl), each layer's rows in order",
      cxxopts::value<std::string>());
  o.add_options("cluster")(
      "comm",
      std::string(one_process ? "[generate: local only] " : "") +
          "Communicator: auto (mpi under mpirun/srun, else local), local, mpi, nccl",
      cxxopts::value<std::string>()->default_value("auto"))(
      "device", "Where every rank computes: cpu, or cuda (the coordinator's dense part and the experts on the "
      "rank's GPU; docs/cuda.md)", cxxopts::value<std::string>()->default_value("cpu"))(
      "coordinator-device", "Where rank 0's dense part runs when it differs from --device: cpu or cuda",
      cxxopts::value<std::string>()->default_value("same"))(
      "gpu", "GPU of this rank (NCCL backend, --device cuda), -1..1023; -1 = the local rank", cxxopts::value<int>()->default_value("-1"))(
      "comm-timeout", run_only + "Seconds a rank waits for a peer before failing, 0.1..86400",
      cxxopts::value<double>()->default_value("120"))(
      "inject-fault", "Testing aid: RANK:kill:N kills a worker at its N-th forward pass, rank 0 at its N-th token; RANK:kill:start at "
      "start-up; RANK:stall:N makes a worker stop answering (sleep) at its N-th forward pass", cxxopts::value<std::string>());
}

void refuse_cluster_only_options(const cxxopts::ParseResult& r) {
  auto refuse = [](const std::string& option, const std::string& why) {
    throw Error(Status::InvalidArgument,
                option + " is a cluster option (" + why + "), and colibri generate runs in one process, which would "
                "ignore it: use colibri run (under mpirun/srun, or colibri launch -n N -- run ...)");
  };
  // Started as one of several ranks: each would generate alone, the same tokens N times.
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS"})
    if (const char* s = std::getenv(v); s && std::atoi(s) > 1)
      throw Error(Status::InvalidArgument, std::string("colibri generate was started as one of ") + s +
                                               " ranks (" + v + "), and it runs in one process: every rank would "
                                               "generate alone; use colibri run under mpirun/srun for a cluster");
  // NOTE: count() is 0 for an option left at its default.
  if (r.count("placement")) refuse("--placement", "which ranks own which experts; one process owns them all");
  if (r.count("policy")) refuse("--policy", "how experts are placed on ranks; one process owns them all");
  if (r.count("redundant")) refuse("--redundant", "extra replicas of experts on other ranks");
  if (r.count("coordinator-experts")) refuse("--coordinator-experts", "rank 0 hosts experts too; one process always does");
  if (r.count("stats") && r["cache-policy"].as<std::string>() != "pinned")
    refuse("--stats", "expert loads for the balanced and replicated placements; in one process only "
                      "--cache-policy pinned reads it");
  if (r.count("comm") && r["comm"].as<std::string>() != "local")
    refuse("--comm " + r["comm"].as<std::string>(), "the communicator between ranks; generate always uses the "
                                                    "in-process one, --comm local");
  if (r.count("comm-timeout")) refuse("--comm-timeout", "how long a rank waits for a peer; one process has none");
}

void ClusterRuntime::finish() {
  comm.reset();
  if (comm_kind != "local") mpi_runtime::finalize();
}

int rank_gpu(const cxxopts::ParseResult& r) {
  int gpu = option_in_range(r, "gpu", Range<int>{-1, 1023, false, "(-1 = the local rank)"});
  if (gpu < 0) {
    const char* lr = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
    if (!lr) lr = std::getenv("SLURM_LOCALID");
    gpu = lr ? std::atoi(lr) : 0;
  }
  return gpu;
}

ClusterRuntime open_cluster(const cxxopts::ParseResult& r, bool local_only) {
  ClusterRuntime rt;
  // NOTE: checked before MPI starts: a deadline of 0 or less would wait forever for a stuck peer.
  const double timeout =
      option_in_range(r, "comm-timeout", Range<double>{kMinCommTimeout, kMaxCommTimeout, false, "seconds"});
  option_in_range(r, "gpu", Range<int>{-1, 1023, false, "(-1 = the local rank)"});
  // The communicator first: every rank must reach the same collectives.
  std::string kind = local_only ? "local" : r["comm"].as<std::string>();
  if (kind == "auto") kind = mpi_runtime::launched_by_mpi() ? "mpi" : "local";
  if (kind == "local") {
    rt.comm = make_local_communicator();
  } else if (kind == "mpi" || kind == "nccl") {
    mpi_runtime::init();
    if (kind == "mpi") {
      rt.comm = make_mpi_communicator();
    } else {
      rt.comm = make_nccl_communicator(rank_gpu(r));
      if (!rt.comm) throw Error(Status::Unsupported, "this build has no NCCL (CUDA and NCCL were not found at configure time)");
    }
    if (!rt.comm) throw Error(Status::Unsupported, "this build has no MPI (configure with Open MPI installed)");
  } else {
    throw Error(Status::InvalidArgument, "--comm '" + kind + "' (auto, local, mpi, nccl)");
  }
  rt.comm_kind = kind;
  rt.comm->set_timeout(timeout);
  // SIGINT/SIGTERM: the coordinator stops between forward passes, tells the
  // workers to stop, and reports what it has; workers keep serving until then
  // (at most 10 s more).
  install_stop_handlers();
  rt.comm->set_interrupt(stop_flag(), 10.0);
  rt.rank = rt.comm->rank();
  rt.world = rt.comm->size();
  if (rt.world > 1) spdlog::set_pattern("[%H:%M:%S.%e] [rank " + std::to_string(rt.rank) + "] [%^%l%$] %v");
  return rt;
}

int set_rank_threads(int threads, int world) {
  check_option("threads", threads, Range<int>{0, kernels::kMaxThreads, false, "(0 = all cores)"});
  if (threads == 0 && world > 1) {
    // NOTE: ranks on one node share its cores; by default each gets its share.
    int cores = static_cast<int>(std::thread::hardware_concurrency());
    threads = std::max(1, cores / std::max(1, mpi_runtime::local_size()));
  }
  return kernels::set_threads(threads);
}

RankModel open_rank_model(const cxxopts::ParseResult& r, int threads_opt, int rank, int world) {
  const std::string kn = r["kernels"].as<std::string>();
  if (kn != "auto" && !kernels::select(kn.c_str()))
    throw Error(Status::InvalidArgument, "--kernels '" + kn + "' is not available on this CPU (auto, avx512, avx2, generic; avx512/avx2: x86-64 only)");
  RankModel m;
  m.threads = set_rank_threads(threads_opt, world);
  ColibriFile::Options fo;
  fo.verify_dense = rank == 0 && r.count("no-verify") == 0;
  m.file = ColibriFile::open(r["model"].as<std::string>(), fo);
  m.es = expert_setup(r, *m.file, rank, world);
  return m;
}

ExpertSetup expert_setup(const cxxopts::ParseResult& r, const ColibriFile& file, int rank, int world) {
  const ModelConfig& cfg = file.config();
  ExpertSetup es;
  if (r.count("stats")) es.stats = std::make_unique<ExpertStats>(load_expert_stats(r["stats"].as<std::string>()));
  const bool coord_hosts = world == 1 || r.count("coordinator-experts") > 0;
  const int L = static_cast<int>(cfg.num_moe_layers()), E = static_cast<int>(cfg.num_experts);
  if (r.count("placement"))
    es.placement = std::make_shared<const Placement>(Placement::load(r["placement"].as<std::string>(), world, L, E));
  else
    es.placement = std::make_shared<const Placement>(
        make_placement(r["policy"].as<std::string>(), L, E, world, coord_hosts, es.stats.get(),
                       option_in_range(r, "redundant", Range<int>{0, 65536})));
  cluster::check_placement(*es.placement, cfg, world);

  ExpertStoreOptions& so = es.store;
  so.budget_bytes = parse_bytes(r["expert-cache-bytes"].as<std::string>());
  so.budget_experts = option_in_range(r, "expert-cache-experts", Range<int64_t>{0, kMaxPositions});
  so.policy = r["cache-policy"].as<std::string>();
  so.decay = option_in_range(r, "cache-decay", Range<double>{0, 1, true});
  const std::string device = r["device"].as<std::string>();
  if (device == "cuda")
    so.device = rank_gpu(r);
  else if (device != "cpu")
    throw Error(Status::InvalidArgument, "--device '" + device + "' (cpu or cuda)");
  std::string dense = r["coordinator-device"].as<std::string>();
  if (dense == "same") dense = device;
  if (dense == "cuda")
    es.dense_device = rank_gpu(r);
  else if (dense != "cpu")
    throw Error(Status::InvalidArgument, "--coordinator-device '" + dense + "' (cpu, cuda or same)");
  if (so.policy == "pinned") {
    if (!es.stats) throw Error(Status::InvalidArgument, "--cache-policy pinned needs --stats STATS.json");
    if (es.stats->num_layers != L || es.stats->num_experts != E)
      throw Error(Status::InvalidArgument, "--stats describes " + std::to_string(es.stats->num_layers) + " layers x " +
                                               std::to_string(es.stats->num_experts) + " experts, the model has " +
                                               std::to_string(L) + " x " + std::to_string(E));
    so.pinned = hottest_experts(*es.stats, file.experts().size());
  }
  if (rank == 0 && r.count("routing-replay")) {
    es.replay_path = r["routing-replay"].as<std::string>();
    es.replay = std::make_shared<RoutingReplay>(read_routing_trace(es.replay_path));
    es.replay->check(cfg);
  }
  if (r.count("inject-fault")) {
    const std::string f = r["inject-fault"].as<std::string>();
    const size_t c1 = f.find(':'), c2 = c1 == std::string::npos ? c1 : f.find(':', c1 + 1);
    auto number = [](const std::string& s, long long hi) {
      size_t used = 0;
      long long v = -1;
      try {
        v = std::stoll(s, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      return used == s.size() && !s.empty() && v >= 0 && v <= hi ? v : -1;
    };
    const std::string kind = c2 == std::string::npos ? "" : f.substr(c1 + 1, c2 - c1 - 1);
    const std::string at = c2 == std::string::npos ? "" : f.substr(c2 + 1);
    const long long fault_rank = c1 == std::string::npos ? -1 : number(f.substr(0, c1), world - 1);
    if (fault_rank < 0 || (kind != "kill" && kind != "stall") || (at != "start" && number(at, 1LL << 40) < 0) ||
        (kind == "stall" && (at == "start" || fault_rank == 0)))
      throw Error(Status::InvalidArgument, "--inject-fault '" + f + "': expected RANK:kill:N, RANK:kill:start or RANK:stall:N "
                                           "with RANK in [0, " + std::to_string(world - 1) + "] (stall: a worker, >= 1) "
                                           "and N >= 0");
    if (fault_rank == rank) es.fault = f.substr(c1 + 1);
  }
  return es;
}

void serve_worker(ClusterRuntime& rt, const std::shared_ptr<const ColibriFile>& file, const ExpertSetup& es) {
  cluster::WorkerOptions wo;
  wo.store = es.store;
  wo.fault = es.fault;
  cluster::serve(file, es.placement, *rt.comm, wo);
  rt.comm->barrier();
  rt.finish();
}

std::vector<cluster::RankReport> rank_reports(Engine& engine, Communicator& comm) {
  const cluster::RankReport mine = cluster::make_report(comm, engine.placement(), engine.config(), engine.local_worker(),
                                                        engine.dispatch_stats(), engine.stage_times());
  if (comm.size() == 1) return {mine};
  cluster::send_op(comm, cluster::Op::Report);
  return cluster::gather_reports(comm, mine);
}

void abort_cluster(const ClusterRuntime& rt) {
  // NOTE: one rank's error must end the whole job, not leave peers waiting.
  int code = exit_code(Status::Internal);
  try {
    throw;
  } catch (const Error& e) {
    spdlog::error("{}", terminal_safe(e.what()));
    code = exit_code(e.status());
  } catch (const std::bad_alloc&) {
    spdlog::error("rank {}: out of memory", rt.rank);
    code = exit_code(Status::OutOfMemory);
  } catch (const std::exception& e) {
    spdlog::error("rank {}: {}", rt.rank, terminal_safe(e.what()));
  } catch (...) {
    spdlog::error("rank {}: unknown error", rt.rank);
  }
  std::fflush(stdout);
  std::fflush(stderr);
  mpi_runtime::abort(code);
  std::_Exit(code);
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

}  // namespace colibri::cli
