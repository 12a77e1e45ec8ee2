// cluster_setup.h: what `colibri run` and `colibri bench` share to run as an
// expert-parallel cluster: the expert/cluster options, the communicator, the
// placement and expert-store options, the worker ranks' life, every rank's
// report, and the rule that one rank's error ends the whole job.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "coordinator/engine.h"
#include "launcher/commands.h"
#include "model/colibri_file.h"
#include "model/placement.h"
#include "model/routing_trace.h"
#include "worker/expert_store.h"
#include "worker/protocol.h"
#include "worker/serve.h"

namespace colibri::cli {

// The "experts" group (--placement, --policy, --stats, --redundant,
// --coordinator-experts, --expert-cache-bytes, --expert-cache-experts,
// --cache-policy, --cache-decay) and the "cluster" group (--comm, --gpu,
// --comm-timeout, --inject-fault). `one_process` (colibri generate): the help
// marks the options refuse_cluster_only_options() refuses.
void add_cluster_options(cxxopts::Options& o, bool one_process = false);

// colibri generate runs in one process (the in-process communicator, every
// expert on rank 0), where the options that only shape a cluster would be
// silently ignored: --placement, --policy, --redundant, --coordinator-experts,
// --stats (unless --cache-policy pinned reads it), --comm other than local,
// --comm-timeout, and being started as one of several ranks by mpirun/srun.
// Throws Error(InvalidArgument) naming the first such option and pointing to
// colibri run; call it before any work.
void refuse_cluster_only_options(const cxxopts::ParseResult& r);

struct ClusterRuntime {
  std::string comm_kind;  // local, mpi or nccl
  std::unique_ptr<Communicator> comm;
  int rank = 0, world = 1;
  // Ends the communicator (and MPI when it was started).
  void finish();
};

// The communicator from --comm (auto: mpi under mpirun/srun, else local;
// `local_only` forces the in-process one), with --comm-timeout, the SIGINT/
// SIGTERM stop flag and, with several ranks, the rank in every log line.
ClusterRuntime open_cluster(const cxxopts::ParseResult& r, bool local_only = false);

// --gpu, or this node's local rank (Open MPI, SLURM) when it is -1.
int rank_gpu(const cxxopts::ParseResult& r);

// --threads for this rank: 0 = all cores for one rank, the cores divided among
// this node's ranks otherwise. Applies it (kernels::set_threads); returns it.
int set_rank_threads(int requested, int world);

struct ExpertSetup {
  std::unique_ptr<ExpertStats> stats;  // --stats
  std::shared_ptr<const Placement> placement;
  ExpertStoreOptions store;
  // The coordinator's dense part (--device / --coordinator-device): its GPU, or -1 on the CPU.
  int dense_device = -1;
  std::string fault;  // --inject-fault for this rank ("" if none)
  std::shared_ptr<RoutingReplay> replay;  // --routing-replay (rank 0 only)
  std::string replay_path;
};
// Placement (from --placement or --policy for this world), the expert store
// options, this rank's fault and (rank 0) the routing replay; throws Error(InvalidArgument) naming the option.
ExpertSetup expert_setup(const cxxopts::ParseResult& r, const ColibriFile& file, int rank, int world);

// What `run` and `batch` do first on every rank: --kernels (auto, or a table
// this CPU has), --threads for this rank (set_rank_threads), the model file
// (--model; rank 0 checks the dense tensors' checksums unless --no-verify)
// and its expert setup. Throws Error(InvalidArgument) naming the option.
struct RankModel {
  int threads = 0;
  std::shared_ptr<const ColibriFile> file;
  ExpertSetup es;
};
RankModel open_rank_model(const cxxopts::ParseResult& r, int threads_opt, int rank, int world);

// A worker rank's whole life: serves until the coordinator stops it.
void serve_worker(ClusterRuntime& rt, const std::shared_ptr<const ColibriFile>& file, const ExpertSetup& es);

// Rank 0's own report (cache, rows, traffic, RSS, stage times) and, with
// several ranks, every rank's (a collective: the workers answer a Report op).
std::vector<cluster::RankReport> rank_reports(Engine& engine, Communicator& comm);

// Runs `body`; with several ranks, an error on this rank is logged and ends
// the whole job (MPI_Abort with the error's exit code) instead of leaving the
// peers waiting. With one rank the error propagates as usual.
template <class F>
int run_guarded(const ClusterRuntime& rt, F&& body);
[[noreturn]] void abort_cluster(const ClusterRuntime& rt);  // inside a catch block: logs and aborts

template <class F>
int run_guarded(const ClusterRuntime& rt, F&& body) {
  try {
    return body();
  } catch (...) {
    if (rt.world > 1) abort_cluster(rt);
    throw;
  }
}

// "5" / "8.5M" / "2G" ... (K, M, G = 2^10, 2^20, 2^30) -> bytes.
uint64_t parse_bytes(const std::string& s);

}  // namespace colibri::cli
