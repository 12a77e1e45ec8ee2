// dispatch.cpp: dispatch plan, all-to-all exchange and ordered combine.
#include "worker/dispatch.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/cpu/kernels.h"
#include "model/error.h"
#include "worker/worker.h"

#ifdef COLIBRI_HAVE_CUDA
#include "kernels/cuda/dense.h"
#include "kernels/cuda/ffn.h"
#include "kernels/cuda/memory.h"
#endif

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

#ifdef COLIBRI_HAVE_CUDA
struct MoeDispatcher::DeviceRows {
  cuda::DeviceBuffer send, back, recv, result;  // rows, as the host buffers of the same names
  cuda::DeviceBuffer order, slot, weights;      // [max_rows * k]: source row of each send row, slot_pos_, weights
  std::vector<int32_t> order_h, slot_h;
};
#else
struct MoeDispatcher::DeviceRows {};
#endif

MoeDispatcher::~MoeDispatcher() = default;

MoeDispatcher::MoeDispatcher(const ModelConfig& cfg, const Placement& placement, Communicator& comm, Worker* local,
                             int64_t max_rows, StageClock& clock, int device)
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
  if (device >= 0) {
#ifdef COLIBRI_HAVE_CUDA
    device_ = device;
    cuda::set_device(device);
    dev_ = std::make_unique<DeviceRows>();
    const size_t bytes = rows * sizeof(float), pairs = static_cast<size_t>(max_rows * k_);
    if (comm_.rank() == 0) {
      dev_->send = cuda::DeviceBuffer(bytes);
      dev_->back = cuda::DeviceBuffer(bytes);
      dev_->order = cuda::DeviceBuffer(pairs * 4);
      dev_->slot = cuda::DeviceBuffer(pairs * 4);
      dev_->weights = cuda::DeviceBuffer(pairs * 4);
      dev_->order_h.resize(pairs);
      dev_->slot_h.resize(pairs);
    }
    if (local_) {
      dev_->recv = cuda::DeviceBuffer(bytes);
      dev_->result = cuda::DeviceBuffer(bytes);
    }
#else
    throw Error(Status::Unsupported, "MoE rows on a GPU, but this build has no CUDA");
#endif
  }
  for (auto& b : balance_) {
    b.balancedness_sum.assign(static_cast<size_t>(placement_.num_layers()), 0.0);
    b.passes.assign(static_cast<size_t>(placement_.num_layers()), 0);
  }
}

void MoeDispatcher::plan(int layer, int64_t rows, const int32_t* experts) {
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
  // 2. Each pair's row in the send layout: a token's row once per expert it selected there.
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t j = 0; j < k_; ++j) {
      const int e = experts[t * k_ + j];
      const int r = pair_rank_[static_cast<size_t>(t * k_ + j)];
      slot_pos_[static_cast<size_t>(t * k_ + j)] = next_[static_cast<size_t>(r * E + e)]++;
      ++st.rows_sent;
      if (r != comm_.rank()) ++st.rows_remote;
    }
}

void MoeDispatcher::exchange(int layer, const float* send, float* recv, float* result, float* back, bool device) {
  const int64_t W = world_, E = experts_;
  const size_t row_bytes = static_cast<size_t>(hidden_) * sizeof(float);
  DispatchStats& st = stats_[static_cast<int>(clock_.phase())];
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
  // NOTE: one rank on a GPU exchanges with itself: the rows stay where they are.
  const bool in_place = device && W == 1;
  if (in_place)
    recv = const_cast<float*>(send);
  else
    comm_.alltoallv(send, sb_.data(), so_.data(), recv, rb_.data(), ro_.data());
  // NOTE: MPI may complete a large send only when the receiver next enters the
  // library; without this barrier the coordinator's send would end after the
  // workers' experts and count their time as its exchange.
  if (stage_sync_ && W > 1) comm_.barrier();
  clock_.lap(Stage::Exchange);
  // 4. Experts on this rank.
  if (roff > 0) {
    if (!local_) throw Error(Status::Internal, "rank " + std::to_string(comm_.rank()) + " hosts no experts but was sent rows");
    if (!device) {
      local_->compute(layer, recv_counts_.data(), recv, result);
    } else if (local_->gpu() && local_->gpu()->device() == device_) {
      local_->compute(layer, recv_counts_.data(), recv, result, true);
    } else {
#ifdef COLIBRI_HAVE_CUDA
      // The local experts elsewhere (the CPU, another GPU): through host memory.
      const size_t bytes = static_cast<size_t>(roff) * row_bytes;
      cuda::copy_async(recv_.data(), recv, bytes, cuda::Copy::DeviceToHost, nullptr);
      cuda::synchronize(nullptr);
      local_->compute(layer, recv_counts_.data(), recv_.data(), result_.data());
      cuda::set_device(device_);
      cuda::copy_async(result, result_.data(), bytes, cuda::Copy::HostToDevice, nullptr);
      cuda::synchronize(nullptr);
#endif
    }
    st.rows_served += static_cast<uint64_t>(roff);
    clock_.lap(Stage::ExpertFfn);
  }
  if (stage_sync_ && W > 1) {
    comm_.barrier();
    clock_.lap(Stage::Wait);
  }
  // 5. Results back, in the order each rank received them (in place: they
  // stay in `result`, which the caller combines from).
  if (!in_place) comm_.alltoallv(result, rb_.data(), ro_.data(), back, sb_.data(), so_.data());
  clock_.lap(Stage::Exchange);
}

void MoeDispatcher::forward(int layer, const float* x, int64_t rows, const int32_t* experts, const float* weights,
                            float* out) {
  plan(layer, rows, experts);
  // Pack each token's row once per expert it selected there.
  const size_t row_bytes = static_cast<size_t>(hidden_) * sizeof(float);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t j = 0; j < k_; ++j)
      std::memcpy(send_.data() + slot_pos_[static_cast<size_t>(t * k_ + j)] * hidden_, x + t * hidden_, row_bytes);
  clock_.lap(Stage::DispatchPlan);
  exchange(layer, send_.data(), recv_.data(), result_.data(), back_.data(), false);
  // 6. Combine in slot order.
  const auto& kt = kernels::active();
  for (int64_t t = 0; t < rows; ++t) {
    float* o = out + t * hidden_;
    std::memset(o, 0, row_bytes);
    for (int64_t j = 0; j < k_; ++j)
      kt.axpy(o, weights[t * k_ + j], back_.data() + slot_pos_[static_cast<size_t>(t * k_ + j)] * hidden_, hidden_);
  }
  ++stats_[static_cast<int>(clock_.phase())].layers;
  clock_.lap(Stage::Combine);
}

void MoeDispatcher::forward_device(int layer, const float* x, int64_t rows, const int32_t* experts,
                                   const float* weights, float* out, void* stream) {
#ifdef COLIBRI_HAVE_CUDA
  if (!dev_) throw Error(Status::Internal, "MoE dispatch of device rows without device buffers");
  plan(layer, rows, experts);
  DeviceRows& d = *dev_;
  const int64_t pairs = rows * k_;
  if (pairs > 0) {
    // The source row of each send row, then the rows gathered on the GPU.
    for (int64_t i = 0; i < pairs; ++i) {
      const int32_t p = static_cast<int32_t>(slot_pos_[static_cast<size_t>(i)]);
      d.slot_h[static_cast<size_t>(i)] = p;
      d.order_h[static_cast<size_t>(p)] = static_cast<int32_t>(i);
    }
    const size_t ib = static_cast<size_t>(pairs) * 4;
    cuda::copy_async(d.order.get(), d.order_h.data(), ib, cuda::Copy::HostToDevice, stream);
    cuda::copy_async(d.slot.get(), d.slot_h.data(), ib, cuda::Copy::HostToDevice, stream);
    cuda::copy_async(d.weights.get(), weights, ib, cuda::Copy::HostToDevice, stream);
    cuda::permute_rows(x, hidden_, d.order.as<const int32_t>(), rows, k_, hidden_, d.send.as<float>(), stream);
  }
  cuda::synchronize(stream);  // the rows are packed before another stream (the exchange's, the worker's) reads them
  clock_.lap(Stage::DispatchPlan);
  exchange(layer, d.send.as<float>(), d.recv.as<float>(), d.result.as<float>(), d.back.as<float>(), true);
  // 6. Combine in slot order, on the GPU.
  cuda::set_device(device_);
  if (rows > 0) {
    // NOTE: with one rank the results never moved: they are where the local worker wrote them.
    const float* back = world_ == 1 ? d.result.as<const float>() : d.back.as<const float>();
    cuda::unpermute_combine(back, d.slot.as<const int32_t>(), d.weights.as<const float>(), rows, k_, hidden_, out,
                            false, stream);
  }
  ++stats_[static_cast<int>(clock_.phase())].layers;
  clock_.lap(Stage::Combine);
#else
  (void)layer, (void)x, (void)rows, (void)experts, (void)weights, (void)out, (void)stream;
  throw Error(Status::Unsupported, "MoE rows on a GPU, but this build has no CUDA");
#endif
}

void MoeDispatcher::serve(int layer) {
  if (dev_)
    forward_device(layer, nullptr, 0, nullptr, nullptr, nullptr, nullptr);
  else
    forward(layer, nullptr, 0, nullptr, nullptr, nullptr);
}

}  // namespace colibri
