// dispatch.cpp: dispatch plan, all-to-all exchange and ordered combine.
#include "coordinator/dispatch.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/cpu/kernels.h"
#include "model/error.h"
#include "worker/worker.h"

namespace colibri {

DispatchStats& DispatchStats::operator+=(const DispatchStats& o) {
  rows_sent += o.rows_sent;
  rows_remote += o.rows_remote;
  rows_served += o.rows_served;
  layers += o.layers;
  token_ranks_remote += o.token_ranks_remote;
  distinct_experts += o.distinct_experts;
  return *this;
}

DispatchStats DispatchStats::minus(const DispatchStats& b) const {
  DispatchStats d;
  d.rows_sent = rows_sent - b.rows_sent;
  d.rows_remote = rows_remote - b.rows_remote;
  d.rows_served = rows_served - b.rows_served;
  d.layers = layers - b.layers;
  d.token_ranks_remote = token_ranks_remote - b.token_ranks_remote;
  d.distinct_experts = distinct_experts - b.distinct_experts;
  return d;
}

double LayerBalance::mean(int layer) const {
  const size_t l = static_cast<size_t>(layer);
  if (l >= passes.size() || passes[l] == 0) return std::numeric_limits<double>::quiet_NaN();
  return balancedness_sum[l] / static_cast<double>(passes[l]);
}

LayerBalance LayerBalance::minus(const LayerBalance& before) const {
  LayerBalance d = *this;
  for (size_t l = 0; l < d.passes.size() && l < before.passes.size(); ++l) {
    d.balancedness_sum[l] -= before.balancedness_sum[l];
    d.passes[l] -= before.passes[l];
  }
  return d;
}

DispatchStats MoeDispatcher::stats() const {
  DispatchStats s = stats_[0];
  s += stats_[1];
  return s;
}

MoeDispatcher::MoeDispatcher(const ModelConfig& cfg, const Placement& placement, Communicator& comm, Worker* local,
                             int64_t max_rows, StageClock& clock)
    : cfg_(cfg),
      placement_(placement),
      comm_(comm),
      local_(local),
      world_(comm.size()),
      hidden_(cfg.hidden_size),
      k_(cfg.experts_per_token),
      experts_(cfg.num_experts),
      max_rows_(max_rows),
      clock_(clock) {
  const size_t we = static_cast<size_t>(world_ * experts_);
  send_counts_.resize(we);
  recv_counts_.resize(we);
  next_.resize(we);
  slot_pos_.resize(static_cast<size_t>(max_rows * k_));
  pair_rank_.resize(static_cast<size_t>(max_rows * k_));
  rank_rows_.resize(static_cast<size_t>(world_));
  chosen_.resize(static_cast<size_t>(experts_));
  for (auto* v : {&sb_, &so_, &rb_, &ro_}) v->resize(static_cast<size_t>(world_));
  // Buffers by role: the coordinator (rank 0) packs and combines; a rank that
  // hosts experts receives and returns. NOTE: a rank receives at most the pairs
  // of the coordinator's batch.
  const size_t rows = static_cast<size_t>(max_rows * k_ * hidden_);
  if (comm_.rank() == 0) {
    send_.resize(rows);
    back_.resize(rows);
  }
  if (local_) {
    recv_.resize(rows);
    result_.resize(rows);
  }
  hosts_ = host_ranks(world_, placement_.coordinator_hosts_experts());
  for (auto& b : balance_) {
    b.balancedness_sum.assign(static_cast<size_t>(placement_.num_layers()), 0.0);
    b.passes.assign(static_cast<size_t>(placement_.num_layers()), 0);
  }
}

void MoeDispatcher::forward(int layer, const float* x, int64_t rows, const int32_t* experts, const float* weights,
                            float* out) {
  if (rows > max_rows_) throw Error(Status::Internal, "MoE dispatch of " + std::to_string(rows) + " rows, sized for " + std::to_string(max_rows_));
  const int64_t W = world_, E = experts_;
  // 1. Plan: count pairs per (rank, expert).
  std::fill(send_counts_.begin(), send_counts_.end(), 0u);
  std::fill(rank_rows_.begin(), rank_rows_.end(), 0);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t j = 0; j < k_; ++j) {
      const int e = experts[t * k_ + j];
      if (e < 0 || e >= E) throw Error(Status::Internal, "router chose expert " + std::to_string(e));
      const auto& owners = placement_.owners(layer, e);
      int r = owners[0];
      for (size_t i = 1; i < owners.size(); ++i)
        if (rank_rows_[static_cast<size_t>(owners[i])] < rank_rows_[static_cast<size_t>(r)] ||
            (rank_rows_[static_cast<size_t>(owners[i])] == rank_rows_[static_cast<size_t>(r)] && owners[i] < r))
          r = owners[i];
      ++rank_rows_[static_cast<size_t>(r)];
      pair_rank_[static_cast<size_t>(t * k_ + j)] = r;
      ++send_counts_[static_cast<size_t>(r * E + e)];
    }
  DispatchStats& st = stats_[static_cast<int>(clock_.phase())];
  std::fill(chosen_.begin(), chosen_.end(), uint8_t{0});
  for (int64_t i = 0; i < rows * k_; ++i) chosen_[static_cast<size_t>(experts[i])] = 1;
  for (uint8_t c : chosen_) st.distinct_experts += c;
  for (int64_t t = 0; t < rows; ++t) {
    const int32_t* pr = pair_rank_.data() + t * k_;
    for (int64_t j = 0; j < k_; ++j) {
      if (pr[j] == comm_.rank()) continue;
      bool first = true;  // count each other rank once per token
      for (int64_t i = 0; i < j && first; ++i) first = pr[i] != pr[j];
      st.token_ranks_remote += first;
    }
  }
  if (rows > 0) {
    LayerBalance& lb = balance_[static_cast<int>(clock_.phase())];
    lb.balancedness_sum[static_cast<size_t>(layer)] += host_balancedness(hosts_, rank_rows_);
    ++lb.passes[static_cast<size_t>(layer)];
  }
  // Send layout: rank-major, expert ascending, rows in token order.
  int64_t off = 0;
  for (int64_t r = 0; r < W; ++r) {
    so_[static_cast<size_t>(r)] = static_cast<uint64_t>(off) * hidden_ * sizeof(float);
    int64_t n = 0;
    for (int64_t e = 0; e < E; ++e) {
      next_[static_cast<size_t>(r * E + e)] = off + n;
      n += send_counts_[static_cast<size_t>(r * E + e)];
    }
    sb_[static_cast<size_t>(r)] = static_cast<uint64_t>(n) * hidden_ * sizeof(float);
    off += n;
  }
  // 2. Pack each token's row once per expert it selected there.
  const size_t row_bytes = static_cast<size_t>(hidden_) * sizeof(float);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t j = 0; j < k_; ++j) {
      const int e = experts[t * k_ + j];
      const int r = pair_rank_[static_cast<size_t>(t * k_ + j)];
      int64_t p = next_[static_cast<size_t>(r * E + e)]++;
      slot_pos_[static_cast<size_t>(t * k_ + j)] = p;
      std::memcpy(send_.data() + p * hidden_, x + t * hidden_, row_bytes);
      ++st.rows_sent;
      if (r != comm_.rank()) ++st.rows_remote;
    }
  clock_.lap(Stage::DispatchPlan);
  // 3. Counts first, then rows. NOTE: the counts are a few bytes; the time in
  // their all-to-all is waiting for the slowest rank to reach this layer.
  comm_.alltoall(send_counts_.data(), recv_counts_.data(), static_cast<size_t>(E) * sizeof(uint32_t));
  clock_.lap(Stage::Wait);
  int64_t roff = 0;
  for (int64_t r = 0; r < W; ++r) {
    int64_t n = 0;
    for (int64_t e = 0; e < E; ++e) n += recv_counts_[static_cast<size_t>(r * E + e)];
    ro_[static_cast<size_t>(r)] = static_cast<uint64_t>(roff) * row_bytes;
    rb_[static_cast<size_t>(r)] = static_cast<uint64_t>(n) * row_bytes;
    roff += n;
  }
  if (roff > max_rows_ * k_) throw Error(Status::Comm, "rank " + std::to_string(comm_.rank()) + ": received more MoE rows than sized for");
  clock_.lap(Stage::DispatchPlan);
  comm_.alltoallv(send_.data(), sb_.data(), so_.data(), recv_.data(), rb_.data(), ro_.data());
  // NOTE: MPI may complete a large send only when the receiver next enters the
  // library; without this barrier the coordinator's send would end after the
  // workers' experts and count their time as its exchange.
  if (stage_sync_ && W > 1) comm_.barrier();
  clock_.lap(Stage::Exchange);
  // 4. Experts on this rank.
  if (roff > 0) {
    if (!local_) throw Error(Status::Internal, "rank " + std::to_string(comm_.rank()) + " hosts no experts but was sent rows");
    local_->compute(layer, recv_counts_.data(), recv_.data(), result_.data());
    st.rows_served += static_cast<uint64_t>(roff);
    clock_.lap(Stage::ExpertFfn);
  }
  if (stage_sync_ && W > 1) {
    comm_.barrier();
    clock_.lap(Stage::Wait);
  }
  // 5. Results back, in the order each rank received them.
  comm_.alltoallv(result_.data(), rb_.data(), ro_.data(), back_.data(), sb_.data(), so_.data());
  clock_.lap(Stage::Exchange);
  // 6. Combine in slot order.
  const auto& kt = kernels::active();
  for (int64_t t = 0; t < rows; ++t) {
    float* o = out + t * hidden_;
    std::memset(o, 0, row_bytes);
    for (int64_t j = 0; j < k_; ++j)
      kt.axpy(o, weights[t * k_ + j], back_.data() + slot_pos_[static_cast<size_t>(t * k_ + j)] * hidden_, hidden_);
  }
  ++st.layers;
  clock_.lap(Stage::Combine);
}

}  // namespace colibri
