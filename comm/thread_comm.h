// thread_comm.h: an in-process world of N ranks, one per thread, that talk
// through shared memory. Each rank's Communicator is used by one thread; the
// collectives are rendezvous (every rank posts its buffers, each copies what it
// receives, every rank waits until all have copied), so the data moves exactly
// as over MPI and the traffic counters (CommStats) are the MPI backend's. The
// deadlines are the MPI backend's too: a collective that waits longer than
// timeout() for a peer throws Error(Comm) naming the ranks that did not arrive
// (a broadcast received waits without a deadline, as a worker waiting for its
// next command does), and a set_interrupt flag bounds every wait by its grace.
//
// Used by the cluster tests to run a coordinator and its workers in one process
// (tests/test_cluster_parity.cpp); `colibri run` uses MPI.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace colibri {

// The `size` ranks of one new world: element r is rank r.
std::vector<std::unique_ptr<Communicator>> make_thread_communicators(int size);

// Ends the world that `rank` belongs to: every rank waiting in a collective, or
// entering one later, throws Error(Comm) with `why` (a thread whose rank failed
// calls this so that its peers stop instead of waiting for it). `rank` must come
// from make_thread_communicators.
void abort_thread_world(Communicator& rank, const std::string& why);

}  // namespace colibri
