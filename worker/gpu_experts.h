// gpu_experts.h: a worker's experts resident in one GPU's memory, computed
// there (kernels/cuda/ffn.h). Every expert the rank owns is packed (bf16) and
// uploaded once, at start; there is no GPU fast tier yet (a budget is refused).
// Rows come in and results go out through host memory, in Worker::compute's
// layout. Built only with CUDA; make_gpu_experts throws Error(Unsupported)
// otherwise, or when the GPU is missing.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "model/colibri_file.h"
#include "worker/expert_cache.h"
#include "worker/expert_ffn.h"

namespace colibri {

class GpuExperts {
 public:
  virtual ~GpuExperts() = default;
  // Uploads the whole [rows][hidden] input block (host) to the device.
  virtual void begin(const float* in, int64_t rows) = 0;
  // Runs expert (layer, e) on the rows of the device input block listed as
  // (first row, count) runs, writing the same rows of the device output block
  // (one run: in place; several: gathered, computed together, scattered back).
  virtual void run(int layer, int expert, const std::vector<std::pair<int64_t, int64_t>>& runs) = 0;
  // Downloads the output block to `out` (host) and waits for the device.
  virtual void end(float* out, int64_t rows) = 0;
  virtual CacheStats stats() const = 0;
  virtual int device() const = 0;
};

// `owned`: keys (layer * num_experts + expert). Throws Error(Unsupported) without
// CUDA or without that GPU, Error(OutOfMemory) when the experts do not fit.
std::unique_ptr<GpuExperts> make_gpu_experts(std::shared_ptr<const ColibriFile> file, const FfnSpec& spec,
                                             const std::vector<uint64_t>& owned, int64_t max_rows, int device, int rank);

}  // namespace colibri
