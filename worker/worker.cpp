// worker.cpp: grouped execution of the experts a rank owns.
#include "worker/worker.h"

#include <cstring>

#include "model/error.h"
#include "worker/expert_ffn.h"

namespace colibri {

namespace {
std::vector<uint64_t> owned_keys(const Placement& p, int rank) {
  std::vector<uint64_t> k;
  for (int l = 0; l < p.num_layers(); ++l)
    for (int e = 0; e < p.num_experts(); ++e)
      if (p.owns(rank, l, e)) k.push_back(static_cast<uint64_t>(l) * p.num_experts() + e);
  return k;
}

// The CPU store's options: on a GPU worker the budget sizes the GPU's fast tier
// (worker/gpu_experts.h), so the CPU store gets none (no arena is allocated).
ExpertStoreOptions cpu_store_options(const ExpertStoreOptions& o) {
  if (o.device < 0) return o;
  ExpertStoreOptions c = o;
  c.budget_bytes = 0;
  c.budget_experts = 0;
  c.pinned.clear();
  return c;
}
}  // namespace

Worker::Worker(std::shared_ptr<const ColibriFile> file, const Placement& placement, int rank, int world,
               int64_t max_rows, const ExpertStoreOptions& store)
    : file_(std::move(file)),
      placement_(placement),
      rank_(rank),
      world_(world),
      hidden_(file_->config().hidden_size),
      inter_(file_->config().intermediate_size),
      experts_(file_->config().num_experts),
      max_rows_(max_rows),
      spec_(FfnShape::experts(file_->config())),
      store_(file_, cpu_store_options(store), owned_keys(placement, rank)) {
  batch_keys_.reserve(static_cast<size_t>(experts_));
  seg_begin_.resize(static_cast<size_t>(world));
  cursor_.resize(static_cast<size_t>(world));
  runs_.reserve(static_cast<size_t>(world));
  if (store.device >= 0) {
    gpu_ = make_gpu_experts(file_, spec_, store, owned_keys(placement, rank), max_rows, rank);
    gpu_experts_.reserve(static_cast<size_t>(experts_));
    gpu_runs_.reserve(static_cast<size_t>(experts_ * world));
    return;  // the GPU holds its own scratch
  }
  xg_.resize(static_cast<size_t>(max_rows * hidden_));
  yg_.resize(static_cast<size_t>(max_rows * hidden_));
  gate_.resize(static_cast<size_t>(max_rows * inter_));
  up_.resize(static_cast<size_t>(max_rows * inter_));
}

CacheStats Worker::cache_stats() const { return gpu_ ? gpu_->stats() : store_.stats(); }
const char* Worker::cache_policy() const { return gpu_ ? gpu_->policy() : store_.policy(); }
size_t Worker::cache_slots() const { return gpu_ ? gpu_->slots() : store_.slots(); }

void Worker::compute(int layer, const uint32_t* counts, const float* in, float* out, bool device_io) {
  if (device_io && !gpu_) throw Error(Status::Internal, "a CPU worker was given device rows");
  // Row offsets: source s's block starts after all rows of sources < s; inside
  // it, expert e's rows follow those of experts < e.
  int64_t total = 0;
  std::vector<int64_t>& src_base = seg_begin_;
  for (int s = 0; s < world_; ++s) {
    src_base[static_cast<size_t>(s)] = total;
    for (int64_t e = 0; e < experts_; ++e) total += counts[s * experts_ + e];
  }
  if (total > max_rows_)
    throw Error(Status::Internal, "rank " + std::to_string(rank_) + ": received " + std::to_string(total) +
                                      " rows, more than the " + std::to_string(max_rows_) + " sized for");
  // Tell the cache what this layer needs before anything is loaded or evicted.
  ++tick_;
  batch_keys_.clear();
  for (int64_t e = 0; e < experts_; ++e)
    for (int s = 0; s < world_; ++s)
      if (counts[s * experts_ + e]) {
        batch_keys_.push_back(static_cast<uint64_t>(layer) * experts_ + e);
        break;
      }
  if (!gpu_) store_.hint(batch_keys_.data(), batch_keys_.size());  // the GPU tier hints its own cache
  // Running offset of the next expert inside each source's block.
  std::vector<int64_t>& cursor = cursor_;
  cursor.assign(src_base.begin(), src_base.end());  // capacity reserved: no allocation
  const size_t row_bytes = static_cast<size_t>(hidden_) * sizeof(float);
  gpu_experts_.clear();
  gpu_runs_.clear();
  for (int64_t e = 0; e < experts_; ++e) {
    // This expert's rows: one run per source that sent it any.
    runs_.clear();
    int64_t n = 0;
    for (int s = 0; s < world_; ++s) {
      const uint32_t c = counts[s * experts_ + e];
      if (!c) continue;
      runs_.push_back({cursor[static_cast<size_t>(s)], c});
      cursor[static_cast<size_t>(s)] += c;
      n += c;
    }
    if (n == 0) continue;
    if (!placement_.owns(rank_, layer, static_cast<int>(e)))
      throw Error(Status::Internal, "rank " + std::to_string(rank_) + " was sent rows for expert " + std::to_string(e) +
                                        " of layer " + std::to_string(layer) + ", which it does not own");
    if (gpu_) {  // collected: the GPU tier plans the whole layer at once
      gpu_experts_.push_back({static_cast<int>(e), static_cast<uint32_t>(gpu_runs_.size()),
                              static_cast<uint32_t>(runs_.size())});
      gpu_runs_.insert(gpu_runs_.end(), runs_.begin(), runs_.end());
      continue;
    }
    const ExpertView& ev = store_.get(layer, static_cast<int>(e), tick_);
    if (runs_.size() == 1) {
      // NOTE: rows of one source are contiguous: compute in place, no gather.
      const int64_t at = runs_[0].first;
      expert_ffn(ev, spec_, in + at * hidden_, n, out + at * hidden_, gate_.data(), up_.data());
      continue;
    }
    int64_t g = 0;
    for (const auto& [at, c] : runs_) {
      std::memcpy(xg_.data() + g * hidden_, in + at * hidden_, static_cast<size_t>(c) * row_bytes);
      g += c;
    }
    expert_ffn(ev, spec_, xg_.data(), n, yg_.data(), gate_.data(), up_.data());
    g = 0;
    for (const auto& [at, c] : runs_) {
      std::memcpy(out + at * hidden_, yg_.data() + g * hidden_, static_cast<size_t>(c) * row_bytes);
      g += c;
    }
  }
  if (gpu_) gpu_->compute(layer, tick_, in, out, total, gpu_experts_, gpu_runs_, device_io);
}

}  // namespace colibri
