// protocol.cpp: the control messages between the coordinator and the workers.
#include "worker/protocol.h"

#include <spdlog/spdlog.h>

#include <sys/resource.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "model/error.h"
#include "worker/dispatch.h"
#include "worker/worker.h"

namespace colibri::cluster {

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

}  // namespace colibri::cluster
