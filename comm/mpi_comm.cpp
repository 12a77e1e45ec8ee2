// mpi_comm.cpp: the MPI backend. Collectives are built from non-blocking
// point-to-point messages polled with a deadline, so a peer that stops
// answering becomes an error naming it instead of a hang, and a waiting rank
// sleeps between polls (oversubscribed ranks yield the core).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "model/error.h"

#ifdef COLIBRI_HAVE_MPI
#include <mpi.h>

#include <chrono>
#include <climits>
#endif

namespace colibri {

#ifdef COLIBRI_HAVE_MPI

// Every MPI call goes through this: the error names the rank, the call and the place.
#define COLIBRI_MPI_CHECK(rank, call)                                                                           \
  do {                                                                                                          \
    int rc_ = (call);                                                                                           \
    if (rc_ != MPI_SUCCESS) {                                                                                   \
      char msg_[MPI_MAX_ERROR_STRING];                                                                          \
      int len_ = 0;                                                                                             \
      MPI_Error_string(rc_, msg_, &len_);                                                                       \
      throw Error(Status::Comm, "rank " + std::to_string(rank) + ": " #call " failed at " __FILE__ ":" +        \
                                    std::to_string(__LINE__) + ": " + std::string(msg_, static_cast<size_t>(len_))); \
    }                                                                                                           \
  } while (0)

namespace {

constexpr int kTagData = 1001, kTagCounts = 1002, kTagBcast = 1003, kTagGather = 1004, kTagBarrier = 1005;

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator() {
    COLIBRI_MPI_CHECK(-1, MPI_Comm_dup(MPI_COMM_WORLD, &comm_));
    COLIBRI_MPI_CHECK(-1, MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    COLIBRI_MPI_CHECK(-1, MPI_Comm_rank(comm_, &rank_));
    COLIBRI_MPI_CHECK(rank_, MPI_Comm_size(comm_, &size_));
    reqs_.reserve(static_cast<size_t>(2 * size_));
    peers_.reserve(static_cast<size_t>(2 * size_));
  }
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* backend() const override { return "mpi"; }

  void alltoallv(const void* send, const uint64_t* send_bytes, const uint64_t* send_offsets, void* recv,
                 const uint64_t* recv_bytes, const uint64_t* recv_offsets) override {
    begin();
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) {
        if (send_bytes[r] != recv_bytes[r])
          throw Error(Status::Comm, "rank " + std::to_string(rank_) + ": alltoallv sends itself " +
                                        std::to_string(send_bytes[r]) + " bytes but expects " + std::to_string(recv_bytes[r]));
        if (send_bytes[r])
          std::memcpy(static_cast<char*>(recv) + recv_offsets[r], static_cast<const char*>(send) + send_offsets[r], send_bytes[r]);
        stats_.bytes_self += send_bytes[r];
        continue;
      }
      // NOTE: a zero-byte message still travels, so every pair of ranks meets
      // in every exchange and a missing peer is noticed at once.
      irecv(static_cast<char*>(recv) + recv_offsets[r], recv_bytes[r], r, kTagData);
      isend(static_cast<const char*>(send) + send_offsets[r], send_bytes[r], r, kTagData);
      stats_.bytes_sent += send_bytes[r];
      stats_.bytes_received += recv_bytes[r];
    }
    wait_all("the all-to-all exchange of rows");
  }

  void alltoall(const void* send, void* recv, size_t bytes) override {
    begin();
    for (int r = 0; r < size_; ++r) {
      const char* s = static_cast<const char*>(send) + static_cast<size_t>(r) * bytes;
      char* d = static_cast<char*>(recv) + static_cast<size_t>(r) * bytes;
      if (r == rank_) {
        std::memcpy(d, s, bytes);
        continue;
      }
      irecv(d, bytes, r, kTagCounts);
      isend(s, bytes, r, kTagCounts);
      stats_.bytes_sent += bytes;
      stats_.bytes_received += bytes;
    }
    wait_all("the all-to-all exchange of counts");
  }

  void broadcast(void* data, size_t bytes, int root) override {
    check_root(root);
    begin();
    if (rank_ == root) {
      for (int r = 0; r < size_; ++r)
        if (r != root) isend(data, bytes, r, kTagBcast);
    } else {
      irecv(data, bytes, root, kTagBcast);
    }
    // NOTE: a worker waits for the coordinator's next command without a deadline:
    // it is idle between requests, and a lost coordinator ends the job anyway.
    wait_all("a broadcast from rank", rank_ != root ? 0.0 : timeout_s_, root);
  }

  void gather(const void* send, size_t bytes, void* recv, int root) override {
    check_root(root);
    begin();
    if (rank_ == root) {
      std::memcpy(static_cast<char*>(recv) + static_cast<size_t>(root) * bytes, send, bytes);
      for (int r = 0; r < size_; ++r)
        if (r != root) irecv(static_cast<char*>(recv) + static_cast<size_t>(r) * bytes, bytes, r, kTagGather);
    } else {
      isend(send, bytes, root, kTagGather);
    }
    wait_all("a gather to rank", timeout_s_, root);
  }

  void barrier() override {
    char token = 0, sink[1];
    begin();
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      irecv(sink, 0, r, kTagBarrier);
      isend(&token, 0, r, kTagBarrier);
    }
    wait_all("a barrier");
  }

 private:
  void check_root(int root) const {
    if (root < 0 || root >= size_)
      throw Error(Status::Comm, "rank " + std::to_string(rank_) + ": root " + std::to_string(root) + " outside the world of " +
                                    std::to_string(size_));
  }
  void begin() {
    reqs_.clear();
    peers_.clear();
    ++stats_.collectives;
  }
  static int count_of(uint64_t bytes, int rank) {
    if (bytes > static_cast<uint64_t>(INT_MAX))
      throw Error(Status::Comm, "rank " + std::to_string(rank) + ": a message of " + std::to_string(bytes) +
                                    " bytes exceeds MPI's 2 GiB count limit; lower the batch or prefill chunk");
    return static_cast<int>(bytes);
  }
  void irecv(void* buf, uint64_t bytes, int peer, int tag) {
    reqs_.emplace_back();
    peers_.push_back(peer);
    COLIBRI_MPI_CHECK(rank_, MPI_Irecv(buf, count_of(bytes, rank_), MPI_BYTE, peer, tag, comm_, &reqs_.back()));
  }
  void isend(const void* buf, uint64_t bytes, int peer, int tag) {
    reqs_.emplace_back();
    peers_.push_back(-1 - peer);  // negative: a send to `peer`
    COLIBRI_MPI_CHECK(rank_, MPI_Isend(buf, count_of(bytes, rank_), MPI_BYTE, peer, tag, comm_, &reqs_.back()));
  }
  // Polls until every request completes; sleeps a little more each idle round
  // (up to 1 ms) so waiting ranks give their core to ranks that compute.
  // NOTE: `what` (and `root`, when >= 0) only go into the timeout message, which
  // is built only then: the polling path allocates nothing.
  void wait_all(const char* what) { wait_all(what, timeout_s_, -1); }
  void wait_all(const char* what, double timeout_s, int root) {
    using clock = std::chrono::steady_clock;
    auto start = clock::now();
    bool interrupted = false;
    int idle = 0;
    while (true) {
      int done = 0;
      COLIBRI_MPI_CHECK(rank_, MPI_Testall(static_cast<int>(reqs_.size()), reqs_.data(), &done, MPI_STATUSES_IGNORE));
      if (done) return;
      // Spin briefly, then yield, then sleep up to 200 us: a short wait stays fast
      // and an oversubscribed rank still gives its core to the ranks computing.
      ++idle;
      if (idle > 2000)
        std::this_thread::sleep_for(std::chrono::microseconds(std::min(200, (idle - 2000) / 4 + 5)));
      else if (idle > 200)
        std::this_thread::yield();
      if (!interrupted && interrupt_ && interrupt_->load() != 0) {
        // Stopping: wait at most the grace period from now on, even where the
        // wait had no deadline (an idle worker waiting for its next command).
        interrupted = true;
        start = clock::now();
        timeout_s = timeout_s > 0 ? std::min(timeout_s, interrupt_grace_s_) : interrupt_grace_s_;
      }
      if (timeout_s > 0 && std::chrono::duration<double>(clock::now() - start).count() > timeout_s) {
        // NOTE: every peer with a request still pending is named: a receive not
        // matched, or a send it has not taken (a large message waits for the
        // receiver). Requests that completed meanwhile count as answered; when
        // all have, the collective finished just at the deadline.
        std::vector<int> missing;
        for (size_t i = 0; i < reqs_.size(); ++i) {
          int flag = 0;
          MPI_Test(&reqs_[i], &flag, MPI_STATUS_IGNORE);
          if (!flag) missing.push_back(peers_[i] >= 0 ? peers_[i] : -1 - peers_[i]);
        }
        if (missing.empty()) return;
        std::sort(missing.begin(), missing.end());
        missing.erase(std::unique(missing.begin(), missing.end()), missing.end());
        std::string names;
        for (int p : missing) names += (names.empty() ? "" : ", ") + std::to_string(p);
        char secs[32];
        std::snprintf(secs, sizeof secs, "%g", timeout_s);
        throw Error(Status::Comm, "rank " + std::to_string(rank_) + ": timed out after " + secs + " s waiting for " + what +
                                      (root >= 0 ? " " + std::to_string(root) : std::string()) + "; no answer from rank(s) " +
                                      names + " (lost or stuck)");
      }
    }
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  std::vector<MPI_Request> reqs_;
  std::vector<int> peers_;
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator() { return std::make_unique<MpiCommunicator>(); }

namespace mpi_runtime {

bool launched_by_mpi() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE") || std::getenv("PMIX_RANK") ||
         std::getenv("SLURM_STEP_ID");
}

void init() {
  int inited = 0;
  MPI_Initialized(&inited);
  if (inited) return;
  int provided = 0;
  COLIBRI_MPI_CHECK(-1, MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided));
  if (provided < MPI_THREAD_FUNNELED) throw Error(Status::Comm, "MPI does not provide MPI_THREAD_FUNNELED");
}

void finalize() {
  int inited = 0, finalized = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&finalized);
  if (inited && !finalized) MPI_Finalize();
}

void abort(int code) {
  int inited = 0, finalized = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&finalized);
  if (inited && !finalized) MPI_Abort(MPI_COMM_WORLD, code);
}

int local_size() {
  for (const char* v : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"})
    if (const char* s = std::getenv(v)) {
      int n = std::atoi(s);
      if (n > 0) return n;
    }
  return 1;
}

}  // namespace mpi_runtime

#else  // no MPI in this build

std::unique_ptr<Communicator> make_mpi_communicator() { return nullptr; }

namespace mpi_runtime {
bool launched_by_mpi() { return std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE"); }
void init() { throw Error(Status::Unsupported, "this build has no MPI (configure with -DCOLIBRI_MPI=ON and Open MPI installed)"); }
void finalize() {}
void abort(int) {}
int local_size() { return 1; }
}  // namespace mpi_runtime

#endif

}  // namespace colibri
