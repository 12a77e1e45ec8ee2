// expert_store.h: a worker's experts in two tiers. The host tier is the
// mmapped model file. Without a budget, experts are used straight from it and
// only materialised (checksum verified, pages read ahead) on first use. With a
// budget (bytes or experts), a fast tier of that many slots holds copies, and an
// ExpertCache policy decides what stays; misses copy the block in and may evict.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/colibri_file.h"
#include "worker/expert_cache.h"

namespace colibri {

struct ExpertStoreOptions {
  std::string policy = "lru";   // see ExpertCache::policy_names()
  uint64_t budget_bytes = 0;    // fast-tier bytes; 0 with budget_experts 0: no fast tier
  int64_t budget_experts = 0;   // or a number of experts
  double decay = 0.9;           // hybrid policy
  std::vector<uint64_t> pinned; // pinned policy: keys (layer * experts + expert)
  // Where the worker computes its experts: -1 the CPU (this store); >= 0 that
  // CUDA GPU (worker/gpu_experts.h): the budget, policy, decay and pinned keys
  // above then size and drive the GPU's fast tier instead of this store's.
  int device = -1;
  // The GPU's host tier: "auto", "pinned" or "staging" (gpu_host_tier_request);
  // "auto" defers to the environment variable COLIBRI_GPU_HOST_TIER.
  std::string gpu_host_tier = "auto";
};

class ExpertStore {
 public:
  // `owned`: the keys (layer * num_experts + expert) this rank serves.
  ExpertStore(std::shared_ptr<const ColibriFile> file, const ExpertStoreOptions& opts, const std::vector<uint64_t>& owned);
  ~ExpertStore();

  // The expert's weights, resident until the next get() of a miss. `now` is the
  // caller's logical clock. Throws Error(Checksum) on a corrupt block.
  const ExpertView& get(int layer, int expert, uint64_t now);
  // The experts the current batch needs (routing precedes the experts).
  void hint(const uint64_t* keys, size_t n);

  bool budgeted() const { return cache_ != nullptr; }
  size_t slots() const { return slots_; }
  uint64_t block_bytes() const { return block_; }
  const char* policy() const { return cache_ ? cache_->name() : "none"; }
  // Hits, misses, bytes loaded (copied into the fast tier, or verified on first
  // use without one) and evictions.
  CacheStats stats() const;

 private:
  // Copies a block into a free slot (checksum checked on its first load).
  const ExpertView& load(uint64_t key, const ExpertView& src);
  // The block's checksum: true if it matches; false (the block is served as it
  // is, unverified) when the model file changed under the run, which then ends
  // at the end of the forward pass; throws Error(Checksum) on a corrupt block.
  bool verify(const ExpertView& src) const;

  std::shared_ptr<const ColibriFile> file_;
  int64_t experts_;
  uint64_t block_;
  std::vector<uint8_t> verified_;          // [key] checksum checked once
  CacheStats direct_;                      // stats without a fast tier
  // Fast tier (budgeted mode).
  std::unique_ptr<ExpertCache> cache_;
  size_t slots_ = 0;
  uint8_t* arena_ = nullptr;               // [slots][block_] 4096-aligned
  std::vector<int32_t> slot_of_;           // [key] -> slot or -1
  std::vector<int64_t> key_in_;            // [slot] -> key or -1
  std::vector<int32_t> free_;              // free slots
  std::vector<ExpertView> views_;          // [slot] view into the arena
};

}  // namespace colibri
