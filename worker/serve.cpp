// serve.cpp: a worker rank's serve loop (see serve.h).
#include "worker/serve.h"

#include <chrono>
#include <csignal>
#include <string>
#include <thread>

#include "model/error.h"
#include "worker/dispatch.h"
#include "worker/protocol.h"
#include "worker/worker.h"

namespace colibri::cluster {

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
