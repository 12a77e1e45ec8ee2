// expert_cache.h: which experts stay in a worker's fast tier. Pure policy and
// accounting over `capacity` equal-sized slots; the expert store owns the memory
// and cache-sim replays traces through this very code.
#pragma once
#include <cstdint>
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

}  // namespace colibri
