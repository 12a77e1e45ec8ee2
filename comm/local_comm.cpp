// local_comm.cpp: the in-process communicator of a one-rank world.
#include <cstring>

#include "comm/communicator.h"
#include "model/error.h"

namespace colibri {

namespace {

class LocalCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  const char* backend() const override { return "local"; }

  void alltoallv(const void* send, const uint64_t* send_bytes, const uint64_t* send_offsets, void* recv,
                 const uint64_t* recv_bytes, const uint64_t* recv_offsets) override {
    if (send_bytes[0] != recv_bytes[0])
      throw Error(Status::Comm, "rank 0: alltoallv sends " + std::to_string(send_bytes[0]) + " bytes to itself but expects " +
                                    std::to_string(recv_bytes[0]));
    if (send_bytes[0])
      std::memcpy(static_cast<char*>(recv) + recv_offsets[0], static_cast<const char*>(send) + send_offsets[0],
                  send_bytes[0]);
    stats_.bytes_self += send_bytes[0];
    ++stats_.collectives;
  }
  void alltoall(const void* send, void* recv, size_t bytes) override {
    if (bytes) std::memcpy(recv, send, bytes);
    stats_.bytes_self += bytes;
    ++stats_.collectives;
  }
  void broadcast(void*, size_t, int root) override {
    if (root != 0) throw Error(Status::Comm, "rank 0: broadcast from rank " + std::to_string(root) + " in a world of 1");
    ++stats_.collectives;
  }
  void gather(const void* send, size_t bytes, void* recv, int root) override {
    if (root != 0) throw Error(Status::Comm, "rank 0: gather to rank " + std::to_string(root) + " in a world of 1");
    if (bytes) std::memcpy(recv, send, bytes);
    ++stats_.collectives;
  }
  void barrier() override {}
};

}  // namespace

std::unique_ptr<Communicator> make_local_communicator() { return std::make_unique<LocalCommunicator>(); }

}  // namespace colibri
