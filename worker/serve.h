// serve.h: a worker rank's serve loop. It receives the coordinator's setup,
// then serves forward passes (the MoE layers' exchanges, worker/dispatch.h)
// until the coordinator stops it (the protocol: worker/protocol.h).
#pragma once
#include <memory>
#include <string>

#include "comm/communicator.h"
#include "model/colibri_file.h"
#include "model/placement.h"
#include "worker/expert_store.h"

namespace colibri::cluster {

struct WorkerOptions {
  ExpertStoreOptions store;
  std::string fault;  // testing aid: "kill:N" / "kill:start": SIGKILL at forward pass N / before setup;
                      // "stall:N": stop answering (sleep for ever) at forward pass N
};

// A worker rank's life: receive Setup, then serve forward passes until Stop.
// Returns normally on Stop; throws on errors (the caller aborts the job).
void serve(std::shared_ptr<const ColibriFile> file, std::shared_ptr<const Placement> placement, Communicator& comm,
           const WorkerOptions& opts);

}  // namespace colibri::cluster
