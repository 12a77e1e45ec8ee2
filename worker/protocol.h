// protocol.h: the control protocol between the coordinator (rank 0) and the
// worker ranks (the workers' serve loop is worker/serve.h). Data moves in
// MoeDispatcher's exchanges; these small messages say what comes next.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "model/colibri_file.h"
#include "model/placement.h"
#include "model/stage_clock.h"
#include "worker/expert_store.h"

namespace colibri {
class Worker;
struct DispatchStats;
}  // namespace colibri

namespace colibri::cluster {

enum class Op : int32_t { Setup = 1, Forward = 2, Report = 3, Stop = 4 };

// What the coordinator tells every rank before the first forward pass.
struct Setup {
  int64_t rows_cap = 0;        // most tokens per forward pass (sizes the buffers)
  uint64_t model_checksum = 0; // meta checksum of the model file: all ranks must agree
  int32_t stage_sync = 0;      // MoeDispatcher::set_stage_sync on every rank
};

// The message rank 0 broadcasts before each step (send_op, send_setup).
struct Message {
  int32_t op = 0;
  int32_t phase = 0;  // Forward: Phase
  Setup setup;
};

// One rank's figures, gathered on rank 0 at the end.
struct RankReport {
  int32_t rank = 0;
  int32_t experts_owned = 0;
  uint64_t hits = 0, misses = 0, bytes_loaded = 0, evictions = 0;
  uint64_t cache_slots = 0;
  uint64_t rows_served = 0;
  uint64_t bytes_sent = 0, bytes_received = 0;
  uint64_t peak_rss_kb = 0;
  double cpu_seconds = 0;  // user + system CPU time of this process so far
  char policy[16] = {0};
  StageTimes stages;  // where this rank's time went

  // The counters over a window (this - before); peak RSS, slots and ownership stay this report's.
  RankReport minus(const RankReport& before) const;
};

// rank 0: sends an op (and for Setup the payload) to every rank. A Forward
// op's phase tells the workers which phase to charge their time to.
void send_op(Communicator& comm, Op op, Phase phase = Phase::Prefill);
void send_setup(Communicator& comm, const Setup& s);
// This rank's report: its experts, cache, rows served, traffic, RSS, CPU time and stages.
RankReport make_report(Communicator& comm, const Placement& placement, const ModelConfig& c, Worker* worker,
                       const DispatchStats& dispatch, const StageTimes& stages);
// Gathers every rank's report on rank 0 (every rank calls it after a Report op).
std::vector<RankReport> gather_reports(Communicator& comm, const RankReport& mine);
uint64_t peak_rss_kb();
double cpu_seconds();  // user + system CPU time of this process

// The end of every forward pass on every rank (with several ranks): each worker
// tells the coordinator whether it can go on (its model file unchanged, else
// it logs why); the coordinator throws Error with a failed worker's status,
// naming the rank, so that it ends the run keeping what was generated. A
// collective: a gather of one word per rank.
void end_pass(Communicator& comm, const ColibriFile& file);

// Checks that a placement fits the model and the world (ranks in range).
void check_placement(const Placement& p, const ModelConfig& c, int world);

}  // namespace colibri::cluster
