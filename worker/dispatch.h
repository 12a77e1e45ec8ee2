// dispatch.h: the coordinator's half of an MoE layer: plan which rank serves
// each (token, expert) pair, exchange counts then rows all-to-all, let the local
// worker (if this rank hosts experts) compute, exchange results back, and combine
// them in a fixed order.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "model/config.h"
#include "model/placement.h"
#include "model/stage_clock.h"

namespace colibri {

class Worker;

struct DispatchStats {
  uint64_t rows_sent = 0;      // (token, expert) rows sent to any rank
  uint64_t rows_remote = 0;    // of which to other ranks
  uint64_t rows_served = 0;    // rows this rank's worker computed
  uint64_t layers = 0;
  // Distinct (token, other rank) pairs per layer: the rows the routing needs
  // to move each way at the least (a token sent once to each rank that serves
  // any of its experts there, its results reduced there before returning).
  uint64_t token_ranks_remote = 0;
  uint64_t distinct_experts = 0;  // distinct experts chosen per layer, summed over layers and passes

  DispatchStats& operator+=(const DispatchStats& o);
  DispatchStats minus(const DispatchStats& before) const;  // counters over a window
};

// Load balance of the MoE layers, on the rank that plans the dispatch (rank 0).
// Balancedness of one layer in one forward pass: host_balancedness (placement.h)
// of the (token, expert) rows over the placement's host ranks, as `colibri place`
// predicts it and `colibri simulate` projects it; passes with no rows are not counted.
struct LayerBalance {
  std::vector<double> balancedness_sum;  // [layer] sum over passes
  std::vector<uint64_t> passes;          // [layer] passes counted

  double mean(int layer) const;  // NaN when no pass was counted
  LayerBalance minus(const LayerBalance& before) const;
};

class MoeDispatcher {
 public:
  // max_rows: most tokens per forward pass; local: this rank's worker or null;
  // clock: where each stage's time is charged (its phase says prefill/decode);
  // device: the GPU whose memory forward_device's rows live in (-1: none).
  MoeDispatcher(const ModelConfig& cfg, const Placement& placement, Communicator& comm, Worker* local,
                int64_t max_rows, StageClock& clock, int device = -1);
  ~MoeDispatcher();

  // x: [rows][hidden] (post-norm); experts, weights: [rows][k] from the router;
  // out: [rows][hidden], overwritten with sum_j weights[t][j] * expert_j(x[t]),
  // summed in slot order j = 0..k-1 whatever rank served each slot.
  // A replicated expert's pair goes to the replica with the fewest pairs so far
  // in this layer (ties to the lower rank). A worker that hosts no tokens calls
  // this with rows = 0 to serve its experts.
  void forward(int layer, const float* x, int64_t rows, const int32_t* experts, const float* weights, float* out);
  // The same with the rows in the memory of the GPU given at construction: x
  // and out device [rows][hidden], experts and weights host [rows][k]. Queued
  // on `stream` after its work so far (the stream is synchronised before the
  // exchange; the combine into out is queued on it). The rows are packed,
  // exchanged (device buffers: NCCL, or nothing to move with one rank),
  // computed by a local worker on that GPU in place (any other local worker
  // through host copies) and combined on the GPU, in the same slot order.
  void forward_device(int layer, const float* x, int64_t rows, const int32_t* experts, const float* weights, float* out,
                      void* stream);
  // A rank without tokens serves its experts for one layer: forward, or
  // forward_device when constructed with a device, with no rows.
  void serve(int layer);

  // Every rank must agree (a collective): with it, a barrier after the rows
  // arrive and one before the results return separate waiting for the slowest
  // rank's experts (Wait) from the transfers (Exchange), at the cost of two
  // barriers per layer.
  void set_stage_sync(bool on) { stage_sync_ = on; }
  bool stage_sync() const { return stage_sync_; }

  DispatchStats stats() const;  // both phases
  const DispatchStats& stats(Phase p) const { return stats_[static_cast<int>(p)]; }
  const LayerBalance& balance(Phase p) const { return balance_[static_cast<int>(p)]; }

 private:
  // Chooses each pair's rank, counts per (rank, expert), the send layout and
  // each pair's row in it (slot_pos_); the statistics.
  void plan(int layer, int64_t rows, const int32_t* experts);
  // Counts, then rows, to the ranks; the local experts; results back. The
  // buffers are host memory, or with `device` device memory.
  void exchange(int layer, const float* send, float* recv, float* result, float* back, bool device);

  const ModelConfig& cfg_;
  const Placement& placement_;
  Communicator& comm_;
  Worker* local_;
  int world_;
  int64_t hidden_, k_, experts_, max_rows_;
  // Buffers sized once (NOTE: no allocation per layer):
  std::vector<uint32_t> send_counts_, recv_counts_;  // [world][experts]
  std::vector<int64_t> slot_pos_;                    // [rows * k] row of each pair in send_
  std::vector<int64_t> next_;                        // [world][experts] fill cursor
  std::vector<int32_t> pair_rank_;                   // [rows * k] the rank serving each pair
  std::vector<int64_t> rank_rows_;                   // [world] pairs assigned per rank in this layer
  std::vector<uint8_t> chosen_;                      // [experts] chosen in this layer
  std::vector<uint64_t> sb_, so_, rb_, ro_;          // bytes and offsets per rank
  std::vector<float> send_, recv_, result_, back_;   // rows: [max_rows * k][hidden]
  std::vector<int> hosts_;                           // the placement's host ranks
  StageClock& clock_;
  bool stage_sync_ = false;
  int device_ = -1;
  struct DeviceRows;  // forward_device's buffers (with CUDA)
  std::unique_ptr<DeviceRows> dev_;
  DispatchStats stats_[kNumPhases];
  LayerBalance balance_[kNumPhases];
};

}  // namespace colibri
