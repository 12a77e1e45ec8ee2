// expert_cache.h: which experts stay in a worker's fast tier. Pure policy and
// accounting over `capacity` equal-sized slots; the expert store owns the memory
// and cache-sim replays traces through this very code.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace colibri {

struct CacheStats {
  uint64_t hits = 0;
  uint64_t misses = 0;
  uint64_t bytes_loaded = 0;  // misses x bytes per slot
  uint64_t evictions = 0;
  double hit_rate() const { return hits + misses ? static_cast<double>(hits) / (hits + misses) : 0.0; }
};

struct CacheOptions {
  uint64_t bytes_per_slot = 0;     // for bytes_loaded
  double decay = 0.9;              // hybrid: score = count * decay^(now - last use)
  std::vector<uint64_t> pinned;    // pinned: keys never evicted (at most capacity of them)
  // Added for the dense per-key tables (access() allocates nothing once they cover
  // every key): keys are < max_keys. 0: the tables grow when a larger key first
  // appears (warm-up only). Set it (num_layers * num_experts) to preallocate.
  uint64_t max_keys = 0;
  // Experts per layer (key = layer * num_experts + expert), for the layer-aware
  // "predict" policy. 0: no layer structure (all keys form one layer).
  uint32_t num_experts = 0;
};

// Keys are layer * num_experts + expert. `now` is a logical clock the caller
// advances (one tick per access batch, e.g. per layer of a forward pass).
class ExpertCache {
 public:
  virtual ~ExpertCache() = default;
  // Names accepted by create(): "lru", "lfu", "hybrid", "pinned" and any
  // further policies the implementation offers (see policy_names()).
  static std::unique_ptr<ExpertCache> create(const std::string& policy, size_t capacity, const CacheOptions& opts);
  static std::vector<std::string> policy_names();

  // Uses `key` at time `now`. Returns true on a hit. On a miss the key becomes
  // resident; when the cache was full the evicted key is stored in *evicted
  // (else -1). Never evicts a key pinned or hinted as needed now.
  virtual bool access(uint64_t key, uint64_t now, int64_t* evicted) = 0;
  // The keys the current batch will use next (known before they run, because
  // routing precedes the experts). Policies may keep them resident.
  virtual void hint_upcoming(const uint64_t* keys, size_t n) { (void)keys; (void)n; }
  virtual bool resident(uint64_t key) const = 0;
  virtual const char* name() const = 0;
  size_t capacity() const { return capacity_; }
  const CacheStats& stats() const { return stats_; }

 protected:
  explicit ExpertCache(size_t capacity) : capacity_(capacity) {}
  size_t capacity_;
  CacheStats stats_;
};

// NOTE (added): when every slot holds a pinned key, a miss on another key is
// served without caching it: counted as a miss (and its bytes as loaded),
// nothing evicted, *evicted = -1, the key not resident afterwards. A hinted key
// stays protected until it is accessed (or the next hint_upcoming); only when a
// batch needs more distinct keys than there are unpinned slots, and every
// resident unpinned key is hinted and not yet used, is one of them evicted.

// Belady's MIN, the offline optimum (it needs the future, so it is a simulator,
// not a policy): replays `keys` in order, one access each, through `capacity`
// slots filled on demand; on a miss with the cache full it evicts the resident
// key whose next use is furthest away (keys never used again first; ties between
// those: the larger key). No demand-paging policy has more hits on the same
// sequence. Throws Error(InvalidArgument) for capacity 0.
CacheStats simulate_belady(const uint64_t* keys, size_t n, size_t capacity, uint64_t bytes_per_slot = 0);
inline CacheStats simulate_belady(const std::vector<uint64_t>& keys, size_t capacity, uint64_t bytes_per_slot = 0) {
  return simulate_belady(keys.data(), keys.size(), capacity, bytes_per_slot);
}

// A routing trace flattened for replay: batches of keys in time order, each
// batch going to one of `num_groups` caches (one per layer, or one in all).
struct AccessBatch {
  uint32_t group = 0;              // which cache replays it
  uint64_t begin = 0, end = 0;     // its keys: keys[begin, end)
};
struct AccessTrace {
  uint32_t num_groups = 1;
  std::vector<uint64_t> keys;
  std::vector<AccessBatch> batches;
};

// Replays `trace`: one cache per group from `make(group)`; each group has its
// own clock `now` (its batch count: the first batch it replays is now = 0).
// Per batch: when `hints`, hint_upcoming(the batch's keys) first; then
// access(key, now) for each key in order. Returns the stats summed over groups.
CacheStats replay(const AccessTrace& trace, const std::function<std::unique_ptr<ExpertCache>(uint32_t group)>& make,
                  bool hints);
// Belady's MIN on the same trace: simulate_belady on each group's key sequence, summed.
CacheStats replay_belady(const AccessTrace& trace, size_t capacity, uint64_t bytes_per_slot = 0);

}  // namespace colibri
