// thread_comm.cpp: the in-process multi-rank backend (comm/thread_comm.h).
//
// Every collective is one or two phases of a rendezvous over the world's shared
// state: a rank posts what it sends (pointers and sizes) and arrives; once every
// rank has arrived, each copies what it receives straight from the senders'
// buffers; a second arrival then keeps every send buffer alive until all copies
// are done. A rank counts its arrivals, so "rank r has arrived at this phase"
// is arrived[r] >= mine, and the ranks a timed-out rank names are those below.
#include "comm/thread_comm.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <mutex>

#include "model/error.h"

namespace colibri {

namespace {

enum class Op : int { AllToAllV, AllToAll, Broadcast, Gather, Barrier };

const char* op_name(Op op) {
  switch (op) {
    case Op::AllToAllV: return "alltoallv";
    case Op::AllToAll: return "alltoall";
    case Op::Broadcast: return "broadcast";
    case Op::Gather: return "gather";
    case Op::Barrier: return "barrier";
  }
  return "?";
}

// What a rank offers the others in the current collective.
struct Post {
  Op op = Op::Barrier;
  const void* send = nullptr;             // the send buffer (broadcast: the root's data)
  const uint64_t* send_bytes = nullptr;   // alltoallv: bytes to each rank
  const uint64_t* send_offsets = nullptr; // alltoallv: where they start in send
  size_t bytes = 0;                       // alltoall, broadcast, gather: bytes per block
  int root = -1;                          // broadcast, gather
};

struct World {
  explicit World(int n) : size(n), arrived(static_cast<size_t>(n), 0), posts(static_cast<size_t>(n)) {}
  const int size;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<uint64_t> arrived;  // phases each rank has arrived at
  std::vector<Post> posts;        // each rank's offer in its current collective
  std::string aborted;            // non-empty: the world has ended, and why
};

class ThreadCommunicator final : public Communicator {
 public:
  ThreadCommunicator(std::shared_ptr<World> w, int rank) : w_(std::move(w)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return w_->size; }
  const char* backend() const override { return "thread"; }
  World& world() { return *w_; }

  void alltoallv(const void* send, const uint64_t* send_bytes, const uint64_t* send_offsets, void* recv,
                 const uint64_t* recv_bytes, const uint64_t* recv_offsets) override {
    ++stats_.collectives;
    Post p{Op::AllToAllV, send, send_bytes, send_offsets, 0, -1};
    arrive(&p, "the all-to-all exchange", timeout_s_, -1);
    for (int r = 0; r < w_->size; ++r) {
      const Post& q = peer(r, Op::AllToAllV, -1);
      const uint64_t n = q.send_bytes[rank_];
      if (n != recv_bytes[r])
        fail("rank " + std::to_string(rank_) + ": alltoallv expects " + std::to_string(recv_bytes[r]) + " bytes from rank " +
             std::to_string(r) + ", which sends " + std::to_string(n));
      if (n) std::memcpy(static_cast<char*>(recv) + recv_offsets[r], static_cast<const char*>(q.send) + q.send_offsets[rank_], n);
      if (r == rank_) {
        stats_.bytes_self += n;
      } else {
        stats_.bytes_sent += send_bytes[r];
        stats_.bytes_received += n;
      }
    }
    arrive(nullptr, "the all-to-all exchange", timeout_s_, -1);
  }

  void alltoall(const void* send, void* recv, size_t bytes) override {
    ++stats_.collectives;
    Post p{Op::AllToAll, send, nullptr, nullptr, bytes, -1};
    arrive(&p, "the all-to-all exchange of counts", timeout_s_, -1);
    for (int r = 0; r < w_->size; ++r) {
      const Post& q = peer(r, Op::AllToAll, -1);
      if (q.bytes != bytes)
        fail("rank " + std::to_string(rank_) + ": alltoall of " + std::to_string(bytes) + " bytes per rank, rank " +
             std::to_string(r) + " sends " + std::to_string(q.bytes));
      if (bytes)
        std::memcpy(static_cast<char*>(recv) + static_cast<size_t>(r) * bytes,
                    static_cast<const char*>(q.send) + static_cast<size_t>(rank_) * bytes, bytes);
      if (r == rank_) {
        stats_.bytes_self += bytes;
      } else {
        stats_.bytes_sent += bytes;
        stats_.bytes_received += bytes;
      }
    }
    arrive(nullptr, "the all-to-all exchange of counts", timeout_s_, -1);
  }

  void broadcast(void* data, size_t bytes, int root) override {
    check_root(root);
    ++stats_.collectives;
    Post p{Op::Broadcast, data, nullptr, nullptr, bytes, root};
    // NOTE: as over MPI, a rank receiving a broadcast waits without a deadline:
    // a worker is idle between the coordinator's commands.
    arrive(&p, "a broadcast from rank", rank_ != root ? 0.0 : timeout_s_, root);
    if (rank_ != root) {
      const Post& q = peer(root, Op::Broadcast, root);
      if (q.bytes != bytes)
        fail("rank " + std::to_string(rank_) + ": broadcast of " + std::to_string(bytes) + " bytes, the root (rank " +
             std::to_string(root) + ") sends " + std::to_string(q.bytes));
      if (bytes) std::memcpy(data, q.send, bytes);
    }
    for (int r = 0; r < w_->size; ++r) peer(r, Op::Broadcast, root);
    arrive(nullptr, "a broadcast from rank", timeout_s_, root);
  }

  void gather(const void* send, size_t bytes, void* recv, int root) override {
    check_root(root);
    ++stats_.collectives;
    Post p{Op::Gather, send, nullptr, nullptr, bytes, root};
    arrive(&p, "a gather to rank", timeout_s_, root);
    for (int r = 0; r < w_->size; ++r) {
      const Post& q = peer(r, Op::Gather, root);
      if (q.bytes != bytes)
        fail("rank " + std::to_string(rank_) + ": gather of " + std::to_string(bytes) + " bytes per rank, rank " +
             std::to_string(r) + " sends " + std::to_string(q.bytes));
      if (rank_ == root && bytes) std::memcpy(static_cast<char*>(recv) + static_cast<size_t>(r) * bytes, q.send, bytes);
    }
    arrive(nullptr, "a gather to rank", timeout_s_, root);
  }

  void barrier() override {
    ++stats_.collectives;
    Post p{};  // Op::Barrier
    arrive(&p, "a barrier", timeout_s_, -1);
    for (int r = 0; r < w_->size; ++r) peer(r, Op::Barrier, -1);
    // NOTE: a second phase, so that no rank posts its next collective while a
    // slower one still reads this one's posts.
    arrive(nullptr, "a barrier", timeout_s_, -1);
  }

  // Ends the world (every waiting rank throws `why`).
  void abort_world(const std::string& why) {
    std::lock_guard<std::mutex> lk(w_->mu);
    if (w_->aborted.empty()) w_->aborted = why.empty() ? "the world was aborted" : why;
    w_->cv.notify_all();
  }

 private:
  void check_root(int root) const {
    if (root < 0 || root >= w_->size)
      throw Error(Status::Comm, "rank " + std::to_string(rank_) + ": root " + std::to_string(root) + " outside the world of " +
                                    std::to_string(w_->size));
  }

  // Rank r's post in this collective, which must be the same operation (and root).
  // NOTE: read without the lock: r wrote it before arriving (under the lock,
  // which this rank took after), and r cannot post again before this rank
  // arrives at the next phase.
  const Post& peer(int r, Op op, int root) {
    const Post& q = w_->posts[static_cast<size_t>(r)];
    if (q.op != op || q.root != root)
      fail("rank " + std::to_string(rank_) + " is in " + op_name(op) + (root >= 0 ? " (root " + std::to_string(root) + ")" : "") +
           " while rank " + std::to_string(r) + " is in " + op_name(q.op) +
           (q.root >= 0 ? " (root " + std::to_string(q.root) + ")" : "") + ": the ranks' collectives differ");
    return q;
  }

  // A mismatch between ranks: ends the world (the peers would wait for ever) and throws.
  [[noreturn]] void fail(const std::string& msg) {
    abort_world(msg);
    throw Error(Status::Comm, msg);
  }

  // Posts `p` (when given), arrives at this rank's next phase and waits until
  // every rank has arrived there. timeout_s 0: no deadline. `what` and `root`
  // only go into the timeout message.
  void arrive(const Post* p, const char* what, double timeout_s, int root) {
    using clock = std::chrono::steady_clock;
    World& w = *w_;
    std::unique_lock<std::mutex> lk(w.mu);
    if (!w.aborted.empty()) throw Error(Status::Comm, "rank " + std::to_string(rank_) + ": " + w.aborted);
    if (p) w.posts[static_cast<size_t>(rank_)] = *p;
    const uint64_t phase = ++w.arrived[static_cast<size_t>(rank_)];
    w.cv.notify_all();
    auto start = clock::now();
    bool interrupted = false;
    while (true) {
      if (!w.aborted.empty()) throw Error(Status::Comm, "rank " + std::to_string(rank_) + ": " + w.aborted);
      bool all = true;
      for (uint64_t a : w.arrived) all = all && a >= phase;
      if (all) return;
      // NOTE: woken by every arrival; the slice only bounds how late a deadline
      // or an interrupt is noticed.
      w.cv.wait_for(lk, std::chrono::milliseconds(20));
      if (!interrupted && interrupt_ && interrupt_->load() != 0) {
        // Stopping: wait at most the grace period from now on (the MPI backend's rule).
        interrupted = true;
        start = clock::now();
        timeout_s = timeout_s > 0 ? std::min(timeout_s, interrupt_grace_s_) : interrupt_grace_s_;
      }
      if (timeout_s > 0 && std::chrono::duration<double>(clock::now() - start).count() > timeout_s) {
        std::string names;
        for (int r = 0; r < w.size; ++r)
          if (w.arrived[static_cast<size_t>(r)] < phase) names += (names.empty() ? "" : ", ") + std::to_string(r);
        if (names.empty()) return;  // all arrived just at the deadline
        char secs[32];
        std::snprintf(secs, sizeof secs, "%g", timeout_s);
        throw Error(Status::Comm, "rank " + std::to_string(rank_) + ": timed out after " + secs + " s waiting for " + what +
                                      (root >= 0 ? " " + std::to_string(root) : std::string()) + "; no answer from rank(s) " +
                                      names + " (lost or stuck)");
      }
    }
  }

  std::shared_ptr<World> w_;
  int rank_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_thread_communicators(int size) {
  if (size < 1) throw Error(Status::InvalidArgument, "a thread world needs at least 1 rank, not " + std::to_string(size));
  auto w = std::make_shared<World>(size);
  std::vector<std::unique_ptr<Communicator>> v;
  for (int r = 0; r < size; ++r) v.push_back(std::make_unique<ThreadCommunicator>(w, r));
  return v;
}

void abort_thread_world(Communicator& rank, const std::string& why) {
  auto* t = dynamic_cast<ThreadCommunicator*>(&rank);
  if (!t) throw Error(Status::InvalidArgument, "abort_thread_world: not a thread communicator");
  t->abort_world(why);
}

}  // namespace colibri
