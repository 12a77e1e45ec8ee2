// communicator.h: the interface every exchange backend implements (local
// in-process, MPI, NCCL). Collective calls: every rank calls them in the same
// order. Errors throw Error(Comm) naming the rank.
#pragma once
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
  virtual void barrier() = 0;

  const CommStats& stats() const { return stats_; }
  void reset_stats() { stats_ = {}; }

 protected:
  CommStats stats_;
};

// The one-process backend: every collective is a copy to self.
std::unique_ptr<Communicator> make_local_communicator();

}  // namespace colibri
