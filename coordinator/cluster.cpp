// cluster.cpp: control messages and the worker serve loop.
#include "coordinator/cluster.h"

#include <spdlog/spdlog.h>

#include <sys/resource.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>

#include "coordinator/dispatch.h"
#include "model/error.h"
#include "worker/worker.h"

namespace colibri::cluster {

namespace {
struct Message {
  int32_t op = 0;
  int32_t phase = 0;  // Forward: Phase
  Setup setup;
};
}  // namespace

void send_op(Communicator& comm, Op op, Phase phase) {
  Message m;
  m.op = static_cast<int32_t>(op);
  m.phase = static_cast<int32_t>(phase);
  comm.broadcast(&m, sizeof m, 0);
}

void send_setup(Communicator& comm, const Setup& s) {
  Message m;
  m.op = static_cast<int32_t>(Op::Setup);
  m.setup = s;
  comm.broadcast(&m, sizeof m, 0);
}

std::vector<RankReport> gather_reports(Communicator& comm, const RankReport& mine) {
  std::vector<RankReport> all(static_cast<size_t>(comm.rank() == 0 ? comm.size() : 1));
  comm.gather(&mine, sizeof mine, all.data(), 0);
  return all;
}

uint64_t peak_rss_kb() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<uint64_t>(ru.ru_maxrss);
}

RankReport RankReport::minus(const RankReport& b) const {
  RankReport d = *this;
  d.hits -= b.hits, d.misses -= b.misses, d.bytes_loaded -= b.bytes_loaded, d.evictions -= b.evictions;
  d.rows_served -= b.rows_served, d.bytes_sent -= b.bytes_sent, d.bytes_received -= b.bytes_received;
  d.cpu_seconds -= b.cpu_seconds;
  d.stages = stages.minus(b.stages);
  return d;
}

RankReport make_report(Communicator& comm, const Placement& placement, const ModelConfig& c, Worker* worker,
                       const DispatchStats& dispatch, const StageTimes& stages) {
  RankReport r;
  r.rank = comm.rank();
  for (int l = 0; l < c.num_moe_layers(); ++l)
    for (int e = 0; e < c.num_experts; ++e) r.experts_owned += placement.owns(comm.rank(), l, e);
  if (worker) {
    const CacheStats s = worker->cache_stats();
    r.hits = s.hits, r.misses = s.misses, r.bytes_loaded = s.bytes_loaded, r.evictions = s.evictions;
    r.cache_slots = worker->cache_slots();
    std::snprintf(r.policy, sizeof r.policy, "%s", worker->cache_policy());
  }
  r.rows_served = dispatch.rows_served;
  r.bytes_sent = comm.stats().bytes_sent;
  r.bytes_received = comm.stats().bytes_received;
  r.peak_rss_kb = peak_rss_kb();
  r.cpu_seconds = cpu_seconds();
  r.stages = stages;
  return r;
}

double cpu_seconds() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
}

void check_placement(const Placement& p, const ModelConfig& c, int world) {
  p.check_fits(world, static_cast<int>(c.num_moe_layers()), static_cast<int>(c.num_experts));
}

void end_pass(Communicator& comm, const ColibriFile& file) {
  int32_t status = 0;
  if (comm.rank() != 0) {
    try {
      file.check_unchanged();
    } catch (const Error& e) {
      // NOTE: this rank goes on serving; the coordinator ends the run (it keeps
      // the tokens so far) and the job, with this status.
      spdlog::error("{}", e.what());
      status = static_cast<int32_t>(e.status());
    }
  }
  // NOTE: grows once, so that a pass allocates nothing.
  static thread_local std::vector<int32_t> all;
  if (comm.rank() == 0 && all.size() < static_cast<size_t>(comm.size())) all.resize(static_cast<size_t>(comm.size()));
  comm.gather(&status, sizeof status, all.data(), 0);
  if (comm.rank() != 0) return;
  for (int r = 1; r < comm.size(); ++r)
    if (all[static_cast<size_t>(r)] != 0)
      throw Error(static_cast<Status>(all[static_cast<size_t>(r)]),
                  "rank " + std::to_string(r) + " cannot go on: " +
                      status_name(static_cast<Status>(all[static_cast<size_t>(r)])) + " (its log names the file: " +
                      file.path() + " there); the last forward pass is discarded");
}

void serve(std::shared_ptr<const ColibriFile> file, std::shared_ptr<const Placement> placement, Communicator& comm,
           const WorkerOptions& opts) {
  const ModelConfig& c = file->config();
  check_placement(*placement, c, comm.size());
  if (opts.fault == "kill:start") std::raise(SIGKILL);  // testing aid: lost during start-up
  Message m;
  comm.broadcast(&m, sizeof m, 0);
  if (static_cast<Op>(m.op) == Op::Stop) return;  // the coordinator failed before starting
  if (static_cast<Op>(m.op) != Op::Setup)
    throw Error(Status::Comm, "rank " + std::to_string(comm.rank()) + ": expected the setup message, got op " + std::to_string(m.op));
  if (m.setup.model_checksum != file->header().meta_checksum)
    throw Error(Status::InvalidArgument, "rank " + std::to_string(comm.rank()) + " loaded a different model file (" +
                                             file->path() + ") than the coordinator");
  const int64_t rows_cap = m.setup.rows_cap;
  if (rows_cap < 1 || rows_cap > (int64_t(1) << 24))
    throw Error(Status::Comm, "rank " + std::to_string(comm.rank()) + ": bad setup (rows " + std::to_string(rows_cap) + ")");

  std::unique_ptr<Worker> worker;
  int owned = 0;
  for (int l = 0; l < c.num_moe_layers(); ++l)
    for (int e = 0; e < c.num_experts; ++e) owned += placement->owns(comm.rank(), l, e);
  if (owned > 0)
    worker = std::make_unique<Worker>(file, *placement, comm.rank(), comm.size(), rows_cap * c.experts_per_token, opts.store);
  StageClock clock;
  // NOTE: rows arrive in the GPU's memory when NCCL moves them and the experts
  // compute there; otherwise in host memory (NCCL stages host buffers itself).
  const bool device_rows = worker && worker->gpu() && std::string(comm.backend()) == "nccl";
  MoeDispatcher dispatch(c, *placement, comm, worker.get(), rows_cap, clock, device_rows ? worker->gpu()->device() : -1);
  dispatch.set_stage_sync(m.setup.stage_sync != 0);
  {
    // Set up: tell the coordinator (it waits without a deadline).
    const double t = comm.timeout();
    comm.set_timeout(0);
    comm.barrier();
    comm.set_timeout(t);
  }

  long kill_at = -1, stall_at = -1;
  if (opts.fault.rfind("kill:", 0) == 0) kill_at = std::stol(opts.fault.substr(5));
  if (opts.fault.rfind("stall:", 0) == 0) stall_at = std::stol(opts.fault.substr(6));
  long passes = 0;
  clock.mark();
  while (true) {
    comm.broadcast(&m, sizeof m, 0);
    switch (static_cast<Op>(m.op)) {
      case Op::Forward:
        if (passes == stall_at)  // testing aid: a rank alive but stuck (ended by the job's abort)
          while (true) std::this_thread::sleep_for(std::chrono::seconds(1));
        if (passes++ == kill_at) std::raise(SIGKILL);  // testing aid: a lost rank
        // NOTE: the time waiting for this pass belongs to its phase.
        clock.set_phase(m.phase == static_cast<int32_t>(Phase::Decode) ? Phase::Decode : Phase::Prefill);
        clock.lap(Stage::Wait);
        clock.count_pass();
        for (int l = 0; l < c.num_moe_layers(); ++l) dispatch.serve(l);
        end_pass(comm, *file);
        break;
      case Op::Report: {
        // NOTE: the wait since the last pass belongs to its phase (the coordinator's
        // last stages of that pass); the report itself is not a stage.
        clock.lap(Stage::Wait);
        gather_reports(comm, make_report(comm, *placement, c, worker.get(), dispatch.stats(), clock.times()));
        clock.mark();
        break;
      }
      case Op::Stop:
        return;
      default:
        throw Error(Status::Comm, "rank " + std::to_string(comm.rank()) + ": unknown op " + std::to_string(m.op));
    }
  }
}

}  // namespace colibri::cluster
