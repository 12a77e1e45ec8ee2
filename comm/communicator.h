// communicator.h: the interface every exchange backend implements (local
// in-process, MPI, NCCL). Collective calls: every rank calls them in the same
// order. Errors throw Error(Comm) naming the rank.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace colibri {

struct CommStats {
  uint64_t bytes_sent = 0;      // to other ranks (not counting self-copies)
  uint64_t bytes_received = 0;  // from other ranks
  uint64_t bytes_self = 0;      // copied to self
  uint64_t collectives = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const char* backend() const = 0;

  // Sends send_bytes[r] bytes from send + send_offsets[r] to rank r and receives
  // recv_bytes[r] bytes from rank r into recv + recv_offsets[r]. The receive sizes
  // must be known (exchange counts first with alltoall).
  virtual void alltoallv(const void* send, const uint64_t* send_bytes, const uint64_t* send_offsets, void* recv,
                         const uint64_t* recv_bytes, const uint64_t* recv_offsets) = 0;
  // Sends `bytes` bytes to every rank (block r of send goes to rank r) and
  // receives `bytes` from every rank (block r of recv comes from rank r).
  virtual void alltoall(const void* send, void* recv, size_t bytes) = 0;
  virtual void broadcast(void* data, size_t bytes, int root) = 0;
  // Rank r's `bytes` land in block r of `recv` on `root` (recv unused elsewhere).
  virtual void gather(const void* send, size_t bytes, void* recv, int root) = 0;
  virtual void barrier() = 0;

  // How long a collective may wait for a peer before failing with an error that
  // names the ranks that did not answer (0: forever).
  void set_timeout(double seconds) { timeout_s_ = seconds; }
  double timeout() const { return timeout_s_; }
  // A flag (set by a signal handler) that turns an otherwise unbounded wait into
  // one bounded by `grace_s` seconds once the flag is non-zero.
  void set_interrupt(const std::atomic<int>* flag, double grace_s) {
    interrupt_ = flag;
    interrupt_grace_s_ = grace_s;
  }

  const CommStats& stats() const { return stats_; }
  void reset_stats() { stats_ = {}; }

 protected:
  CommStats stats_;
  double timeout_s_ = 300.0;
  const std::atomic<int>* interrupt_ = nullptr;
  double interrupt_grace_s_ = 10.0;
};

// The one-process backend: every collective is a copy to self.
std::unique_ptr<Communicator> make_local_communicator();

// The MPI backend over MPI_COMM_WORLD (MPI must be initialised, see
// mpi_runtime below). Returns null when this build has no MPI.
std::unique_ptr<Communicator> make_mpi_communicator();

// The NCCL backend: one GPU per rank, bootstrapped over MPI (the ncclUniqueId
// is broadcast from rank 0). Returns null when this build has no NCCL; throws
// Error(Comm) when no GPU can be used.
std::unique_ptr<Communicator> make_nccl_communicator(int device);

// MPI start-up and shutdown for the launcher. init() returns false when the
// process was not started by an MPI launcher (then the local backend is used).
namespace mpi_runtime {
bool launched_by_mpi();  // environment of mpirun/srun present
void init();             // MPI_Init_thread(FUNNELED); throws Error(Comm)
void finalize();
void abort(int code);    // MPI_Abort on the world, for fatal errors on one rank
int local_size();        // ranks on this node (from the launcher's environment), 1 if unknown
}  // namespace mpi_runtime

}  // namespace colibri
