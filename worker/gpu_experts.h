// gpu_experts.h: a worker's experts computed on one GPU (kernels/cuda/ffn.h),
// held in a GPU fast tier of `capacity` device slots managed by an ExpertCache
// policy (the same policies as the CPU store, worker/expert_store.h):
//   - no budget: capacity = the experts the rank owns, every one packed and
//     uploaded once at start and never evicted (policy reported "gpu");
//   - a budget (--expert-cache-bytes / --expert-cache-experts): that many slots
//     of one packed expert (kernels/cuda/ffn.h's PackedFfnLayout) each; misses
//     are loaded from the host tier on a copy stream while the experts already
//     resident are computed (see GpuTierPlanner for the order).
// The host tier is either pinned (every owned expert packed once into page-locked
// host memory at start) or staging (packed on demand from the mmapped model file
// into a small ring of pinned staging buffers); see gpu_host_tier_request().
// Rows come in and results go out through host memory, in Worker::compute's
// layout. The device part is built only with CUDA; make_gpu_experts throws
// Error(Unsupported) without it, or when the GPU is missing.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "model/colibri_file.h"
#include "worker/expert_cache.h"
#include "worker/expert_ffn.h"
#include "worker/expert_store.h"

namespace colibri {

// ---- Host-side logic of the GPU fast tier (no CUDA: tested without a GPU) ----

// Device slots of the GPU fast tier for experts of `slot_bytes` bytes each
// (PackedFfnLayout::bytes), as the CPU store counts its slots: budget_experts,
// else budget_bytes / slot_bytes, at most `owned` (a bigger budget holds them
// all); no budget: `owned` (every expert resident). At least 1. Throws
// Error(InvalidArgument) for a byte budget smaller than one expert.
size_t gpu_tier_slots(const ExpertStoreOptions& o, uint64_t slot_bytes, size_t owned);

// The host tier asked for: o.gpu_host_tier unless "auto", else the environment
// variable COLIBRI_GPU_HOST_TIER when set, else "auto". One of "auto" (pinned,
// falling back to staging when the page-locked allocation fails or would take
// more than half of the machine's physical memory), "pinned" (fail with
// Error(OutOfMemory) instead) or "staging". Throws Error(InvalidArgument) for
// another value.
std::string gpu_host_tier_request(const ExpertStoreOptions& o);

// The bookkeeping of the device slots: which key each slot holds, the policy's
// decisions, and the order of one layer's loads and computations. Pure host code.
class GpuTierPlanner {
 public:
  // One expert of the current layer.
  struct Item {
    uint64_t key = 0;
    int32_t slot = -1;   // device slot it is computed from
    bool load = false;   // a miss: loaded into `slot` during this layer
    int32_t prev = -1;   // the item computed from the same slot before this one is loaded, or -1
    int32_t next = -1;   // the item loaded into the same slot after this one is computed, or -1
  };
  struct Op {
    enum Kind : uint8_t { Load, Compute } kind;
    uint32_t item;  // index into items()
  };

  // opts: policy, budget, decay, pinned keys (as the CPU store reads them);
  // slot_bytes: one packed expert; owned: the keys this rank serves; max_keys:
  // num_moe_layers * num_experts. Throws the CPU store's errors (a budget below
  // one expert, an unknown policy, a bad decay).
  GpuTierPlanner(const ExpertStoreOptions& opts, uint64_t slot_bytes, const std::vector<uint64_t>& owned,
                 uint64_t max_keys, uint32_t num_experts);

  bool budgeted() const { return budgeted_; }
  size_t capacity() const { return capacity_; }          // slots the policy manages
  // Slots to allocate: capacity, plus one "bypass" slot when the pinned keys fill
  // every slot (the policy then serves other keys without caching them; the
  // bypass slot holds each such key while it is computed).
  size_t device_slots() const { return capacity_ + (bypass_ >= 0 ? 1 : 0); }
  // (key, slot) loaded at start, before any layer: every owned key without a
  // budget, the pinned keys (this rank's, at most capacity) with one.
  const std::vector<std::pair<uint64_t, int32_t>>& preload() const { return preload_; }

  // Plans one layer that computes `keys` (distinct, in the order the CPU store
  // would access them: expert ascending) at logical time `now`: hints the policy
  // with all of them first (nothing needed now is evicted while another slot
  // will do), then accesses each in order, exactly as ExpertStore does, so the
  // hits, misses and evictions are the CPU store's. Then orders the work:
  //   1. the loads of the missing experts whose slot nothing else in this layer
  //      uses first (loads_first; else after step 2),
  //   2. the computations of the hits,
  //   3. the computations of the loaded experts, in order;
  // after the computation of an item whose slot is loaded again in this layer
  // (more distinct experts than free slots), that load follows at once. So every
  // load precedes its computation, and a slot is overwritten only after the
  // computation reading its previous content was issued. Allocates nothing once
  // the first layers have been planned (vectors reserved for num_experts).
  void plan(const uint64_t* keys, size_t n, uint64_t now, bool loads_first);
  const std::vector<Item>& items() const { return items_; }
  const std::vector<Op>& ops() const { return ops_; }

  int32_t slot_of(uint64_t key) const { return key < slot_of_.size() ? slot_of_[key] : -1; }
  // With a budget, the policy's figures (as the CPU store reports them: the
  // pinned keys loaded at start are not counted); without, every owned expert
  // loaded once (misses) and every use a hit.
  CacheStats stats() const;
  const char* policy() const { return budgeted_ ? cache_->name() : "gpu"; }

 private:
  bool budgeted_ = false;
  uint64_t slot_bytes_ = 0;
  size_t capacity_ = 0;
  int32_t bypass_ = -1;                                  // the bypass slot or -1
  std::unique_ptr<ExpertCache> cache_;
  std::vector<std::pair<uint64_t, int32_t>> preload_;
  std::vector<int32_t> slot_of_;                         // [key] -> slot or -1
  std::vector<int64_t> key_in_;                          // [slot] -> key or -1
  std::vector<int32_t> free_;                            // free slots
  std::vector<uint64_t> slot_epoch_;                     // [slot] layer that last used it
  std::vector<int32_t> slot_last_;                       // [slot] its last item in that layer
  uint64_t epoch_ = 0;
  std::vector<Item> items_;
  std::vector<Op> ops_;
};

// ---- The device side ----

// One expert of a layer: its rows are runs[first_run, first_run + num_runs),
// each (first row, count) in the layer's input block.
struct GpuExpertRows {
  int expert = 0;
  uint32_t first_run = 0, num_runs = 0;
};

class GpuExperts {
 public:
  virtual ~GpuExperts() = default;
  // One layer: uploads in[rows][hidden] (host), computes every expert listed
  // (distinct, expert ascending) on its rows (one run: in place; several:
  // gathered, computed together, scattered back), downloads out[rows][hidden]
  // (host) and waits for the device. `now`: the cache's logical clock. With
  // device_io, in and out are device memory of this GPU (in ready: the caller
  // synchronised what wrote it) and nothing crosses PCIe.
  virtual void compute(int layer, uint64_t now, const float* in, float* out, int64_t rows,
                       const std::vector<GpuExpertRows>& experts, const std::vector<std::pair<int64_t, int64_t>>& runs,
                       bool device_io = false) = 0;
  virtual CacheStats stats() const = 0;
  virtual const char* policy() const = 0;
  virtual size_t slots() const = 0;           // the policy's capacity
  virtual const char* host_tier() const = 0;  // "pinned" or "staging"
  virtual int device() const = 0;
};

// Checks that GPU `device` can be used by rank `rank` (for --device cuda):
// throws Error(Unsupported) without CUDA in the build or without a GPU,
// Error(InvalidArgument) for a GPU that does not exist.
void require_gpu(int device, int rank);

// `owned`: keys (layer * num_experts + expert); the GPU is opts.device. Throws
// Error(Unsupported) without CUDA or without a GPU, Error(InvalidArgument) for a
// GPU that does not exist or a bad budget, Error(OutOfMemory) when the slots do
// not fit (or a pinned host tier asked for cannot be allocated).
std::unique_ptr<GpuExperts> make_gpu_experts(std::shared_ptr<const ColibriFile> file, const FfnShape& spec,
                                             const ExpertStoreOptions& opts, const std::vector<uint64_t>& owned,
                                             int64_t max_rows, int rank);

}  // namespace colibri
