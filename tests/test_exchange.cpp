// test_exchange.cpp: the communicator's all-to-all exchange in the style of
// nccl-tests, run under mpirun with 1-4 ranks (or alone with the local
// backend). Every element encodes (source rank, expert, token, column); each
// receiver counts wrong elements and rank 0 sums the counts over all ranks.
// Counts are uneven and drawn from a seed all ranks share; some ranks receive
// nothing in some rounds. Exit 0 only when every rank saw #wrong = 0.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "model/error.h"

using namespace colibri;

namespace {

float encode(int src, int expert, int token, int col) {
  // Exactly representable in f32: all fields are small integers.
  return static_cast<float>(((src * 64 + expert) * 512 + token) * 8 + (col % 8));
}

}  // namespace

int main(int argc, char** argv) {
  const uint64_t seed = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 12345;
  std::unique_ptr<Communicator> comm;
  const bool mpi = mpi_runtime::launched_by_mpi();
  try {
    if (mpi) {
      mpi_runtime::init();
      comm = make_mpi_communicator();
    } else {
      comm = make_local_communicator();
    }
    comm->set_timeout(60);
    const int W = comm->size(), me = comm->rank();
    const int E = 6, H = 13;  // experts per rank's index space, row width (odd on purpose)
    uint64_t wrong = 0, checked = 0;
    for (int round = 0; round < 20; ++round) {
      // counts[s][d][e]: rows rank s sends to rank d for expert e; every rank draws the same table.
      std::mt19937_64 rng(seed * 1000003 + static_cast<uint64_t>(round));
      std::vector<uint32_t> counts(static_cast<size_t>(W * W * E));
      const int silent = static_cast<int>(rng() % static_cast<uint64_t>(W + 1));  // == W: nobody silent
      for (int s = 0; s < W; ++s)
        for (int d = 0; d < W; ++d)
          for (int e = 0; e < E; ++e) {
            uint32_t c = static_cast<uint32_t>(rng() % 5);
            if (d == silent || rng() % 4 == 0) c = 0;  // ranks that receive nothing, and empty experts
            counts[static_cast<size_t>((s * W + d) * E + e)] = c;
          }
      // Counts first: rank me sends its row of the table; it must receive the column.
      std::vector<uint32_t> send_counts(static_cast<size_t>(W * E)), recv_counts(static_cast<size_t>(W * E));
      for (int d = 0; d < W; ++d)
        for (int e = 0; e < E; ++e) send_counts[static_cast<size_t>(d * E + e)] = counts[static_cast<size_t>((me * W + d) * E + e)];
      comm->alltoall(send_counts.data(), recv_counts.data(), E * sizeof(uint32_t));
      for (int s = 0; s < W; ++s)
        for (int e = 0; e < E; ++e) {
          ++checked;
          wrong += recv_counts[static_cast<size_t>(s * E + e)] != counts[static_cast<size_t>((s * W + me) * E + e)];
        }
      // Then rows, rank-major and expert-ascending.
      std::vector<uint64_t> sb(W), so(W), rb(W), ro(W);
      std::vector<float> send, recv;
      for (int d = 0; d < W; ++d) {
        so[d] = send.size() * sizeof(float);
        for (int e = 0; e < E; ++e)
          for (uint32_t t = 0; t < send_counts[static_cast<size_t>(d * E + e)]; ++t)
            for (int c = 0; c < H; ++c) send.push_back(encode(me, e, static_cast<int>(t), c));
        sb[d] = send.size() * sizeof(float) - so[d];
      }
      size_t total = 0;
      for (int s = 0; s < W; ++s) {
        ro[s] = total * sizeof(float);
        size_t n = 0;
        for (int e = 0; e < E; ++e) n += recv_counts[static_cast<size_t>(s * E + e)];
        rb[s] = n * H * sizeof(float);
        total += n * H;
      }
      recv.assign(total + 1, -1.0f);  // one guard element past the end
      comm->alltoallv(send.data(), sb.data(), so.data(), recv.data(), rb.data(), ro.data());
      size_t at = 0;
      for (int s = 0; s < W; ++s)
        for (int e = 0; e < E; ++e)
          for (uint32_t t = 0; t < recv_counts[static_cast<size_t>(s * E + e)]; ++t)
            for (int c = 0; c < H; ++c) {
              ++checked;
              wrong += recv[at++] != encode(s, e, static_cast<int>(t), c);
            }
      ++checked;
      wrong += recv[total] != -1.0f;  // nothing written past the end
    }
    // Sum #wrong over ranks on rank 0.
    uint64_t mine[2] = {wrong, checked};
    std::vector<uint64_t> all(static_cast<size_t>(2 * W));
    comm->gather(mine, sizeof mine, all.data(), 0);
    int rc = 0;
    if (me == 0) {
      uint64_t w = 0, c = 0;
      for (int r = 0; r < W; ++r) w += all[static_cast<size_t>(2 * r)], c += all[static_cast<size_t>(2 * r + 1)];
      std::printf("exchange over %s: %d rank(s), seed %llu, %llu elements checked, #wrong = %llu\n", comm->backend(), W,
                  (unsigned long long)seed, (unsigned long long)c, (unsigned long long)w);
      if (w != 0 || c == 0) rc = 1;
    }
    comm->broadcast(&rc, sizeof rc, 0);
    comm.reset();
    if (mpi) mpi_runtime::finalize();
    return rc;
  } catch (const Error& e) {
    std::fprintf(stderr, "exchange test: %s\n", e.what());
    mpi_runtime::abort(1);
    return 1;
  }
}
