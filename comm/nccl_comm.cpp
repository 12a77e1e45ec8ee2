// nccl_comm.cpp: the NCCL backend: one GPU per rank, bootstrapped by
// broadcasting the ncclUniqueId over MPI; all-to-all-v as grouped
// ncclSend/ncclRecv. Device buffers are exchanged directly; host buffers are
// staged through device scratch (so the CPU engine can use it too).
#include "comm/communicator.h"
#include "model/error.h"

#if defined(COLIBRI_HAVE_NCCL) && defined(COLIBRI_HAVE_MPI)
#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace colibri {

// Every CUDA and NCCL call goes through these: the error names rank, device and place.
#define COLIBRI_CUDA_CHECK(rank, dev, call)                                                                          \
  do {                                                                                                              \
    cudaError_t e_ = (call);                                                                                        \
    if (e_ != cudaSuccess)                                                                                          \
      throw Error(Status::Comm, "rank " + std::to_string(rank) + " (GPU " + std::to_string(dev) + "): " #call      \
                                    " failed at " __FILE__ ":" + std::to_string(__LINE__) + ": " + cudaGetErrorString(e_)); \
  } while (0)
#define COLIBRI_NCCL_CHECK(rank, dev, call)                                                                          \
  do {                                                                                                              \
    ncclResult_t r_ = (call);                                                                                       \
    if (r_ != ncclSuccess)                                                                                          \
      throw Error(Status::Comm, "rank " + std::to_string(rank) + " (GPU " + std::to_string(dev) + "): " #call      \
                                    " failed at " __FILE__ ":" + std::to_string(__LINE__) + ": " + ncclGetErrorString(r_)); \
  } while (0)

namespace {

class NcclCommunicator final : public Communicator {
 public:
  explicit NcclCommunicator(int device) : dev_(device) {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
      cudaGetLastError();
      throw Error(Status::Comm, "rank " + std::to_string(rank_) + ": the NCCL backend needs a GPU and none is visible");
    }
    if (dev_ < 0 || dev_ >= n)
      throw Error(Status::Comm, "rank " + std::to_string(rank_) + ": GPU " + std::to_string(dev_) + " does not exist (" +
                                    std::to_string(n) + " visible)");
    COLIBRI_CUDA_CHECK(rank_, dev_, cudaSetDevice(dev_));
    ncclUniqueId id;
    if (rank_ == 0) COLIBRI_NCCL_CHECK(rank_, dev_, ncclGetUniqueId(&id));
    if (MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD) != MPI_SUCCESS)
      throw Error(Status::Comm, "rank " + std::to_string(rank_) + ": broadcasting the ncclUniqueId failed");
    COLIBRI_NCCL_CHECK(rank_, dev_, ncclCommInitRank(&comm_, size_, id, rank_));
    COLIBRI_CUDA_CHECK(rank_, dev_, cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    a2a_bytes_.resize(static_cast<size_t>(size_));
    a2a_offsets_.resize(static_cast<size_t>(size_));
  }
  ~NcclCommunicator() override {
    if (send_dev_) cudaFree(send_dev_);
    if (recv_dev_) cudaFree(recv_dev_);
    if (stream_) cudaStreamDestroy(stream_);
    if (comm_) ncclCommDestroy(comm_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* backend() const override { return "nccl"; }

  void alltoallv(const void* send, const uint64_t* send_bytes, const uint64_t* send_offsets, void* recv,
                 const uint64_t* recv_bytes, const uint64_t* recv_offsets) override {
    uint64_t send_total = 0, recv_total = 0;
    for (int r = 0; r < size_; ++r) {
      send_total = std::max(send_total, send_offsets[r] + send_bytes[r]);
      recv_total = std::max(recv_total, recv_offsets[r] + recv_bytes[r]);
    }
    const bool dev_send = is_device(send), dev_recv = is_device(recv);
    const char* s = static_cast<const char*>(send);
    char* d = static_cast<char*>(recv);
    if (!dev_send) {
      reserve(&send_dev_, &send_cap_, send_total);
      COLIBRI_CUDA_CHECK(rank_, dev_, cudaMemcpyAsync(send_dev_, send, send_total, cudaMemcpyHostToDevice, stream_));
      s = send_dev_;
    }
    if (!dev_recv) {
      reserve(&recv_dev_, &recv_cap_, recv_total);
      d = recv_dev_;
    }
    COLIBRI_NCCL_CHECK(rank_, dev_, ncclGroupStart());
    for (int r = 0; r < size_; ++r) {
      if (send_bytes[r]) COLIBRI_NCCL_CHECK(rank_, dev_, ncclSend(s + send_offsets[r], send_bytes[r], ncclChar, r, comm_, stream_));
      if (recv_bytes[r]) COLIBRI_NCCL_CHECK(rank_, dev_, ncclRecv(d + recv_offsets[r], recv_bytes[r], ncclChar, r, comm_, stream_));
      if (r != rank_) stats_.bytes_sent += send_bytes[r], stats_.bytes_received += recv_bytes[r];
      else stats_.bytes_self += send_bytes[r];
    }
    COLIBRI_NCCL_CHECK(rank_, dev_, ncclGroupEnd());
    if (!dev_recv)
      COLIBRI_CUDA_CHECK(rank_, dev_, cudaMemcpyAsync(recv, recv_dev_, recv_total, cudaMemcpyDeviceToHost, stream_));
    ++stats_.collectives;
    wait("the all-to-all exchange");
  }

  void alltoall(const void* send, void* recv, size_t bytes) override {
    // NOTE: member buffers sized at construction: no allocation per call.
    for (int r = 0; r < size_; ++r) {
      a2a_bytes_[static_cast<size_t>(r)] = bytes;
      a2a_offsets_[static_cast<size_t>(r)] = static_cast<uint64_t>(r) * bytes;
    }
    alltoallv(send, a2a_bytes_.data(), a2a_offsets_.data(), recv, a2a_bytes_.data(), a2a_offsets_.data());
  }

  // Control messages are small and on the host: they travel over MPI.
  void broadcast(void* data, size_t bytes, int root) override {
    if (MPI_Bcast(data, static_cast<int>(bytes), MPI_BYTE, root, MPI_COMM_WORLD) != MPI_SUCCESS)
      throw Error(Status::Comm, "rank " + std::to_string(rank_) + ": broadcast from rank " + std::to_string(root) + " failed");
    ++stats_.collectives;
  }
  void gather(const void* send, size_t bytes, void* recv, int root) override {
    if (MPI_Gather(send, static_cast<int>(bytes), MPI_BYTE, recv, static_cast<int>(bytes), MPI_BYTE, root, MPI_COMM_WORLD) !=
        MPI_SUCCESS)
      throw Error(Status::Comm, "rank " + std::to_string(rank_) + ": gather to rank " + std::to_string(root) + " failed");
    ++stats_.collectives;
  }
  void barrier() override {
    if (MPI_Barrier(MPI_COMM_WORLD) != MPI_SUCCESS) throw Error(Status::Comm, "rank " + std::to_string(rank_) + ": barrier failed");
  }

 private:
  static bool is_device(const void* p) {
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
  }
  void reserve(char** buf, uint64_t* cap, uint64_t need) {
    if (need <= *cap) return;
    if (*buf) COLIBRI_CUDA_CHECK(rank_, dev_, cudaFree(*buf));
    COLIBRI_CUDA_CHECK(rank_, dev_, cudaMalloc(reinterpret_cast<void**>(buf), need));
    *cap = need;
  }
  // Polls the stream with a deadline; on timeout the communicator is aborted so
  // the error surfaces instead of a hang.
  void wait(const char* what) {
    const auto start = std::chrono::steady_clock::now();
    while (true) {
      cudaError_t q = cudaStreamQuery(stream_);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) COLIBRI_CUDA_CHECK(rank_, dev_, q);
      ncclResult_t async = ncclSuccess;
      COLIBRI_NCCL_CHECK(rank_, dev_, ncclCommGetAsyncError(comm_, &async));
      if (async != ncclSuccess) COLIBRI_NCCL_CHECK(rank_, dev_, async);
      if (timeout_s_ > 0 && std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > timeout_s_) {
        ncclCommAbort(comm_);
        comm_ = nullptr;
        throw Error(Status::Comm, "rank " + std::to_string(rank_) + " (GPU " + std::to_string(dev_) + "): timed out after " +
                                      std::to_string(static_cast<int>(timeout_s_)) + " s in " + what + " (a peer is lost or stuck)");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  int rank_ = 0, size_ = 1, dev_ = 0;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  char *send_dev_ = nullptr, *recv_dev_ = nullptr;
  uint64_t send_cap_ = 0, recv_cap_ = 0;
  std::vector<uint64_t> a2a_bytes_, a2a_offsets_;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(int device) { return std::make_unique<NcclCommunicator>(device); }

}  // namespace colibri

#else

namespace colibri {
std::unique_ptr<Communicator> make_nccl_communicator(int) { return nullptr; }
}  // namespace colibri

#endif
