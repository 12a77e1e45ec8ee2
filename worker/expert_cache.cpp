// expert_cache.cpp: the expert-cache policies (lru, lfu, hybrid, pinned, predict)
// over dense per-key tables, Belady's MIN simulator, and the trace replay that
// cache-sim and the tests share. Formulas and results: docs/caching.md.
#include "worker/expert_cache.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <unordered_map>
#include <utility>

#include "model/error.h"

namespace colibri {

namespace {

constexpr uint32_t kNoSlot = std::numeric_limits<uint32_t>::max();
constexpr size_t kNoVictim = std::numeric_limits<size_t>::max();

void check_capacity(size_t capacity, const char* what) {
  if (capacity == 0)
    throw Error(Status::InvalidArgument, std::string(what) +
                                             ": capacity 0 is invalid: the fast tier must hold at least one expert "
                                             "(a budget smaller than one expert block)");
}

// Machinery shared by every policy: dense per-key tables, residency, hint
// protection, and the victim scan. A policy only defines score() (lower is
// evicted first; ties: least recently used first) and may observe accesses.
// NOTE: all per-key state is indexed by key and survives eviction, so LFU and
// hybrid counts are "perfect" (a key's history is kept while it is out).
class DenseCache : public ExpertCache {
 public:
  DenseCache(size_t capacity, const CacheOptions& opts) : ExpertCache(capacity), opts_(opts) {
    check_capacity(capacity, "expert cache");
    slots_.reserve(capacity);
    if (opts_.max_keys) grow(opts_.max_keys);
  }

  bool access(uint64_t key, uint64_t now, int64_t* evicted) final {
    if (evicted) *evicted = -1;
    ensure(key);
    ++tick_;
    const bool hit = slot_[key] != kNoSlot;
    observe(key, now, hit);  // policy statistics first: the victim choice sees this access
    last_tick_[key] = tick_;
    done_epoch_[key] = epoch_;
    if (hit) {
      ++stats_.hits;
      return true;
    }
    ++stats_.misses;
    stats_.bytes_loaded += opts_.bytes_per_slot;
    if (slots_.size() < capacity_) {
      slot_[key] = static_cast<uint32_t>(slots_.size());
      slots_.push_back(key);  // within the reserved capacity: no allocation
      return false;
    }
    const size_t v = pick_victim(now);
    if (v == kNoVictim) return false;  // every slot pinned: served without caching (see the header)
    const uint64_t victim = slots_[v];
    slot_[victim] = kNoSlot;
    slots_[v] = key;
    slot_[key] = static_cast<uint32_t>(v);
    ++stats_.evictions;
    if (evicted) *evicted = static_cast<int64_t>(victim);
    return false;
  }

  void hint_upcoming(const uint64_t* keys, size_t n) final {
    ++epoch_;  // a new batch: the previous hint expires
    for (size_t i = 0; i < n; ++i) {
      ensure(keys[i]);
      hint_epoch_[keys[i]] = epoch_;
    }
  }

  bool resident(uint64_t key) const final { return key < slot_.size() && slot_[key] != kNoSlot; }

 protected:
  // Lower is evicted first. Called only for resident, unpinned keys.
  virtual double score(uint64_t key, uint64_t now) const = 0;
  virtual void observe(uint64_t key, uint64_t now, bool hit) { (void)key, (void)now, (void)hit; }
  virtual void grow_policy(size_t n) { (void)n; }

  void ensure(uint64_t key) {
    if (key < slot_.size()) return;
    if (opts_.max_keys && key >= opts_.max_keys)
      throw Error(Status::InvalidArgument, "expert cache: key " + std::to_string(key) + " is out of range (max_keys " +
                                               std::to_string(opts_.max_keys) + ")");
    grow(std::max<uint64_t>({key + 1, 2 * slot_.size(), 64}));  // warm-up only: amortised doubling
  }

  void pin(uint64_t key) {
    ensure(key);
    if (pinned_[key]) return;  // duplicates are one pin
    pinned_[key] = 1;
    ++num_pinned_;
    if (num_pinned_ > capacity_)
      throw Error(Status::InvalidArgument, "pinned policy: more pinned keys than the capacity of " +
                                               std::to_string(capacity_) + " slots");
    slot_[key] = static_cast<uint32_t>(slots_.size());
    slots_.push_back(key);
  }

  CacheOptions opts_;
  uint64_t tick_ = 0;                // one per access: the recency order
  std::vector<uint64_t> last_tick_;  // [key] tick of the last access (0: never)

 private:
  void grow(uint64_t n) {
    slot_.resize(n, kNoSlot);
    last_tick_.resize(n, 0);
    hint_epoch_.resize(n, 0);
    done_epoch_.resize(n, 0);
    pinned_.resize(n, 0);
    grow_policy(n);
  }

  // The resident key to evict: the lowest (score, last use) among keys neither
  // pinned nor still needed by the current batch (hinted and not yet accessed
  // since the hint). When none, a hinted key the batch has already used; when
  // none either, a hinted key not yet used (the batch needs more distinct keys
  // than there are free slots, so one must be reloaded). Pinned: never.
  size_t pick_victim(uint64_t now) const {
    size_t best[3] = {kNoVictim, kNoVictim, kNoVictim};
    double best_score[3] = {0, 0, 0};
    for (size_t i = 0; i < slots_.size(); ++i) {
      const uint64_t k = slots_[i];
      if (pinned_[k]) continue;
      int cls = 0;
      if (hint_epoch_[k] == epoch_) cls = done_epoch_[k] == epoch_ ? 1 : 2;
      const double s = score(k, now);
      const size_t b = best[cls];
      if (b == kNoVictim || s < best_score[cls] || (s == best_score[cls] && last_tick_[k] < last_tick_[slots_[b]])) {
        best[cls] = i;
        best_score[cls] = s;
      }
    }
    for (size_t b : best)
      if (b != kNoVictim) return b;
    return kNoVictim;
  }

  std::vector<uint64_t> slots_;       // [slot] resident key (size <= capacity)
  std::vector<uint32_t> slot_;        // [key] its slot or kNoSlot
  std::vector<uint64_t> hint_epoch_;  // [key] epoch of the last hint naming it
  std::vector<uint64_t> done_epoch_;  // [key] epoch of its last access
  std::vector<uint8_t> pinned_;       // [key]
  uint64_t epoch_ = 1;                // hint epochs start at 2, so 0-initialised keys are unhinted
  size_t num_pinned_ = 0;
};

// lru: evict the least recently used key.
class LruCache : public DenseCache {
 public:
  using DenseCache::DenseCache;
  const char* name() const override { return "lru"; }

 protected:
  double score(uint64_t, uint64_t) const override { return 0.0; }
};

// pinned: opts.pinned resident from the start and never evicted; LRU on the rest.
class PinnedCache : public LruCache {
 public:
  PinnedCache(size_t capacity, const CacheOptions& opts) : LruCache(capacity, opts) {
    for (uint64_t k : opts.pinned) pin(k);
  }
  const char* name() const override { return "pinned"; }
};

// lfu: evict the key with the fewest accesses (counted since the cache was made,
// also while out of the cache); ties: least recently used.
class LfuCache : public DenseCache {
 public:
  LfuCache(size_t capacity, const CacheOptions& opts) : DenseCache(capacity, opts) {
    if (opts_.max_keys) count_.resize(opts_.max_keys, 0);
  }
  const char* name() const override { return "lfu"; }

 protected:
  void grow_policy(size_t n) override { count_.resize(n, 0); }
  void observe(uint64_t key, uint64_t, bool) override { ++count_[key]; }
  double score(uint64_t key, uint64_t) const override { return static_cast<double>(count_[key]); }
  std::vector<uint64_t> count_;  // [key] accesses so far
};

// hybrid: score = count * decay^(now - last_now), count as in lfu, last_now the
// `now` of the key's last access; evict the lowest; ties: least recently used.
// Compared in the log domain (log count + (now - last_now) log decay): the same
// order, without underflow after long idle times.
class HybridCache : public LfuCache {
 public:
  HybridCache(size_t capacity, const CacheOptions& opts) : LfuCache(capacity, opts), log_decay_(std::log(opts.decay)) {
    if (!(opts.decay > 0.0 && opts.decay <= 1.0))
      throw Error(Status::InvalidArgument,
                  "hybrid policy: decay must be in (0, 1], got " + std::to_string(opts.decay));
    if (opts_.max_keys) last_now_.resize(opts_.max_keys, 0);
  }
  const char* name() const override { return "hybrid"; }

 protected:
  void grow_policy(size_t n) override {
    LfuCache::grow_policy(n);
    last_now_.resize(n, 0);
  }
  void observe(uint64_t key, uint64_t now, bool hit) override {
    LfuCache::observe(key, now, hit);
    last_now_[key] = now;
  }
  double score(uint64_t key, uint64_t now) const override {
    const double age = now >= last_now_[key] ? static_cast<double>(now - last_now_[key]) : 0.0;
    return std::log(static_cast<double>(count_[key])) + age * log_decay_;
  }

 private:
  double log_decay_;
  std::vector<uint64_t> last_now_;  // [key]
};

// predict: an online estimate of Belady's choice. MIN evicts the key whose next
// use is furthest away; this evicts the key with the largest *expected* distance
// to its next use, estimated from what is known when the batch runs:
//   p(k)  = probability that key k (layer l, expert e) is used by the next batch
//           of its layer
//         = kMix * m(k) + (1 - kMix) * f(k)
//   m(k)  = mean over the experts a of layer l's latest batch of
//           (T[l][a][e] + r_l) / (O[l][a] + 1): a first-order Markov chain over
//           consecutive batches of the layer, learned online (T counts a in a batch
//           followed by e in the next, O counts a followed by any batch, r_l is
//           the layer's mean fraction of experts per batch, the prior)
//   f(k)  = (1 - kDecay) * sum over past batches b' of layer l that used k of
//           kDecay^(b - b') (an exponential moving frequency: recency and
//           frequency together, as LRFU's combined recency-frequency value)
//   D(k)  = g(l) + L * (1 / p(k) - 1), evict the largest D (ties: LRU), where
//   g(l)  = ((l - l_now - 1) mod L) + 1 is how many layer batches until layer l
//           runs again (layers run in order, l_now the layer just accessed, L the
//           number of layers). In one cache per layer g is constant and the
//           policy evicts the lowest p; in one cache for all layers it also
//           prefers evicting the layer just used (needed last) over the next one.
// Plus what every policy does: never evict a key hinted for the current batch.
// Without num_experts all keys form one layer and m(k) is off (p = f).
class PredictCache : public DenseCache {
 public:
  static constexpr double kDecay = 0.9;  // f's decay per layer batch
  static constexpr double kMix = 0.5;    // weight of m (the Markov term) in p
  static constexpr uint32_t kMaxMarkovExperts = 512;  // T is E*E floats per layer

  PredictCache(size_t capacity, const CacheOptions& opts)
      : DenseCache(capacity, opts),
        experts_(opts.num_experts),
        markov_(opts.num_experts && opts.num_experts <= kMaxMarkovExperts) {
    if (opts_.max_keys) {
      grow_policy(opts_.max_keys);
    }
  }
  const char* name() const override { return "predict"; }

 protected:
  struct Layer {
    bool started = false;
    uint64_t now = 0;       // `now` of its current batch
    uint64_t batch = 0;     // index of its current batch
    uint64_t firsts = 0;    // first accesses of a key in a batch, summed over batches
    uint32_t cur_n = 0, prev_n = 0;
    int64_t block = -1;     // its Markov tables: trans_[block*E*E], out_[block*E]
  };

  uint64_t layer_of(uint64_t key) const { return experts_ ? key / experts_ : 0; }
  uint32_t expert_of(uint64_t key) const { return experts_ ? static_cast<uint32_t>(key % experts_) : 0; }

  void grow_policy(size_t n) override {
    crf_.resize(n, 0.0);
    crf_batch_.resize(n, 0);
    in_batch_.resize(n, 0);
    const size_t layers = experts_ ? (n + experts_ - 1) / experts_ : 1;
    if (layers_.size() < layers) {
      layers_.resize(layers);
      if (markov_) {
        cur_.resize(layers * experts_, 0);
        prev_.resize(layers * experts_, 0);
      }
    }
  }

  void observe(uint64_t key, uint64_t now, bool) override {
    const uint64_t l = layer_of(key);
    Layer& L = layers_[l];
    if (!L.started || now != L.now) {  // a new batch of this layer
      if (L.started) {
        ++L.batch;
        if (markov_) {
          float* out = &out_[L.block * experts_];
          const uint32_t* cur = &cur_[l * experts_];
          for (uint32_t i = 0; i < L.cur_n; ++i) out[cur[i]] += 1.0f;
          std::copy(cur, cur + L.cur_n, &prev_[l * experts_]);
        }
        L.prev_n = L.cur_n;
        L.cur_n = 0;
      } else if (markov_) {
        // NOTE: the first batch of a layer allocates its tables (warm-up only).
        L.block = static_cast<int64_t>(out_.size() / experts_);
        out_.resize(out_.size() + experts_, 0.0f);
        trans_.resize(trans_.size() + static_cast<size_t>(experts_) * experts_, 0.0f);
      }
      L.started = true;
      L.now = now;
      repeat_ = l == batch_layer_;  // two batches of one layer in a row: layer-major (a prefill token by token)
      batch_layer_ = l;
    }
    now_layer_ = l;
    if (in_batch_[key] == L.batch + 1) return;  // already counted in this batch
    in_batch_[key] = L.batch + 1;
    ++L.firsts;
    crf_[key] = 1.0 + crf_[key] * std::pow(kDecay, static_cast<double>(L.batch - crf_batch_[key]));
    crf_batch_[key] = L.batch;
    if (markov_) {
      const uint32_t e = expert_of(key);
      float* trans = &trans_[L.block * experts_ * experts_];
      const uint32_t* prev = &prev_[l * experts_];
      for (uint32_t i = 0; i < L.prev_n; ++i) trans[prev[i] * experts_ + e] += 1.0f;
      cur_[l * experts_ + L.cur_n++] = e;
    }
  }

  double probability(uint64_t key) const {
    const Layer& L = layers_[layer_of(key)];
    const double f = (1.0 - kDecay) * crf_[key] * std::pow(kDecay, static_cast<double>(L.batch - crf_batch_[key]));
    if (!markov_) return f;
    const double r = static_cast<double>(L.firsts) / (static_cast<double>(L.batch + 1) * experts_);
    double m = r;
    if (L.cur_n) {
      const uint32_t e = expert_of(key);
      const float* trans = &trans_[L.block * experts_ * experts_];
      const float* out = &out_[L.block * experts_];
      const uint32_t* cur = &cur_[layer_of(key) * experts_];
      double s = 0.0;
      for (uint32_t i = 0; i < L.cur_n; ++i) s += (trans[cur[i] * experts_ + e] + r) / (out[cur[i]] + 1.0);
      m = s / L.cur_n;
    }
    return kMix * m + (1.0 - kMix) * f;
  }

  double score(uint64_t key, uint64_t) const override {
    const double p = std::max(probability(key), 1e-9);
    const uint64_t nl = layers_.size();
    const uint64_t l = layer_of(key);
    // Layer batches until layer l runs again: the layers run in order (token-major),
    // unless the layer just used repeats (layer-major order): then it runs next.
    double g = static_cast<double>((l + nl - now_layer_ - 1) % nl + 1);
    if (repeat_) g = l == now_layer_ ? 1.0 : g + 1.0;
    return -(g + static_cast<double>(nl) * (1.0 / p - 1.0));  // lower is evicted first: the furthest expected use
  }

 private:
  uint32_t experts_;
  bool markov_;
  uint64_t now_layer_ = 0;    // layer of the latest access
  uint64_t batch_layer_ = std::numeric_limits<uint64_t>::max();  // layer of the latest batch start
  bool repeat_ = false;       // the latest batch start repeated the layer before it
  std::vector<Layer> layers_;
  std::vector<double> crf_;          // [key] combined recency-frequency value at crf_batch_
  std::vector<uint64_t> crf_batch_;  // [key] layer batch of its last use
  std::vector<uint64_t> in_batch_;   // [key] 1 + the layer batch it was last counted in
  std::vector<uint32_t> cur_, prev_; // [layer][E] experts of the layer's current / previous batch
  std::vector<float> trans_;         // [block][E from][E to] transitions between consecutive batches
  std::vector<float> out_;           // [block][E from] batches that followed one using `from`
};

const char* const kPolicyNames[] = {"lru", "lfu", "hybrid", "pinned", "predict"};

}  // namespace

std::unique_ptr<ExpertCache> ExpertCache::create(const std::string& policy, size_t capacity, const CacheOptions& opts) {
  check_capacity(capacity, ("expert cache (" + policy + ")").c_str());
  if (policy == "lru") return std::make_unique<LruCache>(capacity, opts);
  if (policy == "lfu") return std::make_unique<LfuCache>(capacity, opts);
  if (policy == "hybrid") return std::make_unique<HybridCache>(capacity, opts);
  if (policy == "pinned") return std::make_unique<PinnedCache>(capacity, opts);
  if (policy == "predict") return std::make_unique<PredictCache>(capacity, opts);
  std::string known;
  for (const char* n : kPolicyNames) known += std::string(known.empty() ? "" : ", ") + n;
  throw Error(Status::InvalidArgument, "unknown expert-cache policy '" + policy + "' (known: " + known + ")");
}

std::vector<std::string> ExpertCache::policy_names() {
  return std::vector<std::string>(std::begin(kPolicyNames), std::end(kPolicyNames));
}

CacheStats simulate_belady(const uint64_t* keys, size_t n, size_t capacity, uint64_t bytes_per_slot) {
  check_capacity(capacity, "belady");
  constexpr size_t kNever = std::numeric_limits<size_t>::max();
  std::vector<size_t> next(n);  // [i] index of the next access to keys[i], or kNever
  {
    std::unordered_map<uint64_t, size_t> seen;
    for (size_t i = n; i-- > 0;) {
      auto it = seen.find(keys[i]);
      next[i] = it == seen.end() ? kNever : it->second;
      seen[keys[i]] = i;
    }
  }
  CacheStats st;
  std::unordered_map<uint64_t, size_t> resident;  // key -> its next use
  std::set<std::pair<size_t, uint64_t>> by_next;  // (next use, key): the last is the victim
  for (size_t i = 0; i < n; ++i) {
    const uint64_t k = keys[i];
    auto it = resident.find(k);
    if (it != resident.end()) {
      ++st.hits;
      by_next.erase({it->second, k});
      it->second = next[i];
    } else {
      ++st.misses;
      st.bytes_loaded += bytes_per_slot;
      if (resident.size() >= capacity) {
        auto v = std::prev(by_next.end());
        resident.erase(v->second);
        by_next.erase(v);
        ++st.evictions;
      }
      resident.emplace(k, next[i]);
    }
    by_next.insert({next[i], k});
  }
  return st;
}

namespace {
void add(CacheStats& a, const CacheStats& b) {
  a.hits += b.hits;
  a.misses += b.misses;
  a.bytes_loaded += b.bytes_loaded;
  a.evictions += b.evictions;
}
void check_batch(const AccessTrace& t, const AccessBatch& b) {
  if (b.group >= t.num_groups || b.begin > b.end || b.end > t.keys.size())
    throw Error(Status::InvalidArgument,
                "replay: batch out of range (group " + std::to_string(b.group) + " of " + std::to_string(t.num_groups) +
                    ", keys [" + std::to_string(b.begin) + ", " + std::to_string(b.end) + ") of " +
                    std::to_string(t.keys.size()) + ")");
}
}  // namespace

CacheStats replay(const AccessTrace& trace, const std::function<std::unique_ptr<ExpertCache>(uint32_t group)>& make,
                  bool hints) {
  std::vector<std::unique_ptr<ExpertCache>> caches(trace.num_groups);
  std::vector<uint64_t> clock(trace.num_groups, 0);
  for (const AccessBatch& b : trace.batches) {
    check_batch(trace, b);
    auto& c = caches[b.group];
    if (!c) c = make(b.group);
    if (hints) c->hint_upcoming(trace.keys.data() + b.begin, b.end - b.begin);
    int64_t evicted;
    for (uint64_t i = b.begin; i < b.end; ++i) c->access(trace.keys[i], clock[b.group], &evicted);
    ++clock[b.group];
  }
  CacheStats total;
  for (const auto& c : caches)
    if (c) add(total, c->stats());
  return total;
}

CacheStats replay_belady(const AccessTrace& trace, size_t capacity, uint64_t bytes_per_slot) {
  check_capacity(capacity, "belady");
  std::vector<std::vector<uint64_t>> seqs(trace.num_groups);
  for (const AccessBatch& b : trace.batches) {
    check_batch(trace, b);
    seqs[b.group].insert(seqs[b.group].end(), trace.keys.begin() + b.begin, trace.keys.begin() + b.end);
  }
  CacheStats total;
  for (const auto& s : seqs)
    if (!s.empty()) add(total, simulate_belady(s, capacity, bytes_per_slot));
  return total;
}

}  // namespace colibri
