// worker.h: the expert side of an MoE layer: takes the rows it was sent,
// grouped by source rank and expert, runs each local expert's FFN on all of its
// rows at once, and returns results in the order received.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "model/colibri_file.h"
#include "model/placement.h"
#include "worker/expert_ffn.h"
#include "worker/expert_store.h"
#include "worker/gpu_experts.h"

namespace colibri {

class Worker {
 public:
  // max_rows: the most rows this worker can receive for one layer.
  Worker(std::shared_ptr<const ColibriFile> file, const Placement& placement, int rank, int world, int64_t max_rows,
         const ExpertStoreOptions& store = {});

  // counts: [world][num_experts] rows received from each source for each expert;
  // in, out: [sum(counts)][hidden] in that order (source-major, expert ascending);
  // host memory, or with device_io device memory of the worker's GPU (gpu()->device()).
  void compute(int layer, const uint32_t* counts, const float* in, float* out, bool device_io = false);

  ExpertStore& store() { return store_; }
  int rank() const { return rank_; }
  // The expert tier this worker computes from: the store's figures on the CPU;
  // on a GPU, its fast tier's (worker/gpu_experts.h): with a budget the
  // policy's hits, misses, bytes loaded, evictions and slots; without one,
  // policy "gpu", every owned expert loaded once (misses) and resident (hits).
  CacheStats cache_stats() const;
  const char* cache_policy() const;
  size_t cache_slots() const;
  const GpuExperts* gpu() const { return gpu_.get(); }  // null on the CPU

 private:
  std::shared_ptr<const ColibriFile> file_;
  const Placement& placement_;
  int rank_, world_;
  int64_t hidden_, inter_, experts_, max_rows_;
  FfnShape spec_;
  uint64_t tick_ = 0;  // the cache's logical clock: one tick per layer served
  ExpertStore store_;
  std::unique_ptr<GpuExperts> gpu_;                    // with ExpertStoreOptions::device >= 0
  std::vector<std::pair<int64_t, int64_t>> runs_;       // one expert's (first row, count) per source
  std::vector<uint64_t> batch_keys_;  // experts with rows in the current layer
  std::vector<GpuExpertRows> gpu_experts_;                  // GPU: the layer's experts with rows
  std::vector<std::pair<int64_t, int64_t>> gpu_runs_;       // GPU: their runs, reserved experts x world
  // Scratch sized once: gathered rows of one expert and its intermediates.
  std::vector<float> xg_, yg_, gate_, up_;
  std::vector<int64_t> seg_begin_;  // [world] first row of each source's block
  std::vector<int64_t> cursor_;     // [world] next row of each source's block
};

}  // namespace colibri
