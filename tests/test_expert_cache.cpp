// test_expert_cache.cpp: the expert-cache policies on hand-made traces (exact
// victims and counts), pinning, hints, capacity errors, Belady's MIN (textbook
// example, exhaustive search), every policy bounded by Belady on random traces,
// no allocation in steady state, and the README's hit rates on the real traces.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <new>
#include <random>
#include <set>

#include "model/error.h"
#include "model/routing_trace.h"
#include "test_util.h"
#include "worker/expert_cache.h"

// ---- allocation counter (for the no-allocation-in-steady-state test) --------
// NOTE: replaces the whole global operator new/delete family of the test binary
// (malloc/free based, so every pair matches); it only counts while
// g_count_allocs is set. Under AddressSanitizer or ThreadSanitizer the
// sanitizer's own operators stay and the allocation test is skipped.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define COLIBRI_COUNT_ALLOCS 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define COLIBRI_COUNT_ALLOCS 0
#endif
#endif
#ifndef COLIBRI_COUNT_ALLOCS
#define COLIBRI_COUNT_ALLOCS 1
#endif

namespace {
std::atomic<bool> g_count_allocs{false};
std::atomic<uint64_t> g_allocs{0};
}  // namespace

#if COLIBRI_COUNT_ALLOCS
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"  // the replacements below are malloc-based
#endif
namespace {
void* counted_alloc(std::size_t n) noexcept {
  if (g_count_allocs.load(std::memory_order_relaxed)) g_allocs.fetch_add(1, std::memory_order_relaxed);
  return std::malloc(n ? n : 1);
}
}  // namespace
void* operator new(std::size_t n) {
  if (void* p = counted_alloc(n)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) {
  if (void* p = counted_alloc(n)) return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t n, const std::nothrow_t&) noexcept { return counted_alloc(n); }
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept { return counted_alloc(n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
#endif

namespace colibri {
namespace {

using test::expect_error;

// One access; returns the victim (-1 when none) and checks the hit flag.
struct Step {
  uint64_t key;
  uint64_t now;
  bool hit;
  int64_t victim;
};

void run_steps(ExpertCache& c, const std::vector<Step>& steps) {
  for (size_t i = 0; i < steps.size(); ++i) {
    const Step& s = steps[i];
    int64_t ev = -2;
    const bool hit = c.access(s.key, s.now, &ev);
    EXPECT_EQ(hit, s.hit) << c.name() << " step " << i << " key " << s.key;
    EXPECT_EQ(ev, s.victim) << c.name() << " step " << i << " key " << s.key;
    EXPECT_TRUE(c.resident(s.key)) << c.name() << " step " << i;
    if (ev >= 0) {
      EXPECT_FALSE(c.resident(static_cast<uint64_t>(ev))) << c.name() << " step " << i;
    }
  }
}

CacheOptions opts_with(uint64_t bytes = 0, double decay = 0.9) {
  CacheOptions o;
  o.bytes_per_slot = bytes;
  o.decay = decay;
  return o;
}

// ---- construction and errors -------------------------------------------------

TEST(ExpertCache, PolicyNamesAllCreate) {
  const auto names = ExpertCache::policy_names();
  for (const char* need : {"lru", "lfu", "hybrid", "pinned", "predict"})
    EXPECT_NE(std::find(names.begin(), names.end(), need), names.end()) << need;
  for (const auto& n : names) {
    auto c = ExpertCache::create(n, 4, CacheOptions{});
    EXPECT_EQ(std::string(c->name()), n);
    EXPECT_EQ(c->capacity(), 4u);
    EXPECT_EQ(c->stats().hits + c->stats().misses, 0u);
    EXPECT_FALSE(c->resident(0));
    EXPECT_FALSE(c->resident(1u << 30));  // beyond the tables: simply not resident
  }
}

TEST(ExpertCache, CapacityZeroAndBadOptionsAreClearErrors) {
  for (const auto& n : ExpertCache::policy_names())
    expect_error([&] { ExpertCache::create(n, 0, CacheOptions{}); }, Status::InvalidArgument,
                 {"capacity 0", "at least one expert"});
  expect_error([] { simulate_belady(std::vector<uint64_t>{1, 2}, 0); }, Status::InvalidArgument, {"capacity 0"});
  expect_error([] { replay_belady(AccessTrace{}, 0); }, Status::InvalidArgument, {"capacity 0"});
  expect_error([] { ExpertCache::create("mru", 2, CacheOptions{}); }, Status::InvalidArgument,
               {"unknown expert-cache policy 'mru'", "lru", "predict"});
  for (double d : {0.0, -0.5, 1.5})
    expect_error([&] { ExpertCache::create("hybrid", 2, opts_with(0, d)); }, Status::InvalidArgument, {"decay"});
  CacheOptions p;
  p.pinned = {1, 2, 3};
  expect_error([&] { ExpertCache::create("pinned", 2, p); }, Status::InvalidArgument,
               {"more pinned keys than the capacity of 2"});
  CacheOptions m;
  m.max_keys = 16;
  auto c = ExpertCache::create("lru", 2, m);
  int64_t ev;
  expect_error([&] { c->access(16, 0, &ev); }, Status::InvalidArgument, {"key 16 is out of range", "max_keys 16"});
}

// ---- each policy's evictions on hand-made traces ----------------------------

TEST(ExpertCache, LruEvictsLeastRecentlyUsed) {
  auto c = ExpertCache::create("lru", 3, opts_with(100));
  run_steps(*c, {{1, 0, false, -1},
                 {2, 1, false, -1},
                 {3, 2, false, -1},
                 {1, 3, true, -1},   // order now 2 3 1
                 {4, 4, false, 2},
                 {5, 5, false, 3},
                 {1, 6, true, -1},   // order 4 5 1
                 {2, 7, false, 4},
                 {5, 8, true, -1},
                 {3, 9, false, 1}});
  EXPECT_EQ(c->stats().hits, 3u);
  EXPECT_EQ(c->stats().misses, 7u);
  EXPECT_EQ(c->stats().evictions, 4u);
  EXPECT_EQ(c->stats().bytes_loaded, 700u);
  EXPECT_DOUBLE_EQ(c->stats().hit_rate(), 0.3);
}

TEST(ExpertCache, LfuEvictsLeastFrequentTiesLeastRecent) {
  auto c = ExpertCache::create("lfu", 3, CacheOptions{});
  run_steps(*c, {{1, 0, false, -1},
                 {1, 1, true, -1},
                 {1, 2, true, -1},   // count 1:3
                 {2, 3, false, -1},
                 {2, 4, true, -1},   // 2:2
                 {3, 5, false, -1},  // 3:1
                 {4, 6, false, 3},   // fewest: 3 (count 1); 4:1
                 {3, 7, false, 4},   // 3's count survives its eviction: 3:2 > 4:1, so 4 goes
                 {4, 8, false, 2},   // 4:2; 2 and 3 tie at 2: 2 is the least recently used
                 {1, 9, true, -1}});
  EXPECT_EQ(c->stats().hits, 4u);
  EXPECT_EQ(c->stats().misses, 6u);
  EXPECT_EQ(c->stats().evictions, 3u);
}

TEST(ExpertCache, HybridDecaysFrequencyWithAge) {
  // score = count * decay^(now - last); decay 0.5.
  auto c = ExpertCache::create("hybrid", 2, opts_with(0, 0.5));
  run_steps(*c, {{1, 0, false, -1},
                 {1, 1, true, -1},
                 {1, 2, true, -1},   // 1: count 3, last 2
                 {2, 3, false, -1},  // 2: count 1, last 3
                 // now 4: 1 -> 3 * 0.5^2 = 0.75, 2 -> 1 * 0.5^1 = 0.5: evict 2 (LFU-like)
                 {3, 4, false, 2},
                 // now 10: 1 -> 3 * 0.5^8 = 0.0117, 3 -> 1 * 0.5^6 = 0.0156: the old
                 // frequent key loses (LFU would evict 3)
                 {4, 10, false, 1},
                 // now 10: 3 -> 0.0156, 4 -> 1 * 0.5^0 = 1: evict 3
                 {5, 10, false, 3}});
  // decay 1: exactly LFU (ties least recently used).
  auto lfu = ExpertCache::create("lfu", 2, CacheOptions{});
  auto hyb = ExpertCache::create("hybrid", 2, opts_with(0, 1.0));
  std::mt19937_64 rng(7);
  for (uint64_t t = 0; t < 500; ++t) {
    const uint64_t k = rng() % 5;
    int64_t a, b;
    EXPECT_EQ(lfu->access(k, t, &a), hyb->access(k, t, &b));
    EXPECT_EQ(a, b) << "t " << t;
  }
}

TEST(ExpertCache, HybridLongIdleDoesNotUnderflowToTies) {
  // After a very long idle time decay^age underflows a double; the log-domain
  // comparison still ranks the more frequent key higher.
  auto c = ExpertCache::create("hybrid", 2, opts_with(0, 0.5));
  run_steps(*c, {{1, 0, false, -1}, {1, 1, true, -1}, {1, 2, true, -1}, {2, 3, false, -1}});
  // now 100000: both scores are 0 in doubles; 1 (count 3, last 2) vs 2 (count 1,
  // last 3): log 3 - 99998 log 2 > log 1 - 99997 log 2, so 2 goes although 1 is older.
  run_steps(*c, {{3, 100000, false, 2}});
}

TEST(ExpertCache, PinnedKeysResidentFromStartAndNeverEvicted) {
  CacheOptions o;
  o.pinned = {7, 8, 7};  // a repeated pin is one pin
  o.bytes_per_slot = 10;
  auto c = ExpertCache::create("pinned", 3, o);
  EXPECT_TRUE(c->resident(7));
  EXPECT_TRUE(c->resident(8));
  EXPECT_EQ(c->stats().misses, 0u);  // preloaded, not counted as loads
  // Everything else shares the one remaining slot (LRU).
  run_steps(*c, {{7, 0, true, -1}, {1, 1, false, -1}, {2, 2, false, 1}, {8, 3, true, -1}, {3, 4, false, 2},
                 {7, 5, true, -1}, {1, 6, false, 3}});
  std::mt19937_64 rng(11);
  for (uint64_t t = 10; t < 1000; ++t) {
    int64_t ev;
    c->access(rng() % 20, t, &ev);
    EXPECT_NE(ev, 7);
    EXPECT_NE(ev, 8);
    ASSERT_TRUE(c->resident(7) && c->resident(8));
  }
  EXPECT_EQ(c->stats().bytes_loaded, c->stats().misses * 10);
}

TEST(ExpertCache, PinnedAtFullCapacityServesOthersWithoutCaching) {
  CacheOptions o;
  o.pinned = {1, 2};
  auto c = ExpertCache::create("pinned", 2, o);
  int64_t ev = -2;
  EXPECT_FALSE(c->access(5, 0, &ev));
  EXPECT_EQ(ev, -1);
  EXPECT_FALSE(c->resident(5));
  EXPECT_FALSE(c->access(5, 1, &ev));  // still a miss
  EXPECT_TRUE(c->access(1, 2, &ev));
  EXPECT_EQ(c->stats().misses, 2u);
  EXPECT_EQ(c->stats().evictions, 0u);
  EXPECT_TRUE(c->resident(1) && c->resident(2));
}

TEST(ExpertCache, PredictLearnsTheSuccessorOnALoop) {
  // A loop over 4 keys with 3 slots: LRU always evicts the key needed next and
  // never hits. predict learns "k is followed by k+1" (its Markov term) and keeps
  // the successor, so once it has seen a lap it never evicts the next key.
  auto lru = ExpertCache::create("lru", 3, CacheOptions{});
  CacheOptions o;
  o.num_experts = 4;
  auto pred = ExpertCache::create("predict", 3, o);
  std::vector<uint64_t> seq;
  for (int lap = 0; lap < 25; ++lap)
    for (uint64_t k = 0; k < 4; ++k) seq.push_back(k);
  for (uint64_t t = 0; t < seq.size(); ++t) {
    int64_t ev;
    lru->access(seq[t], t, &ev);
    pred->access(seq[t], t, &ev);
    if (t >= 8 && ev >= 0) {
      EXPECT_NE(static_cast<uint64_t>(ev), (seq[t] + 1) % 4) << "t " << t;
    }
  }
  EXPECT_EQ(lru->stats().hits, 0u);
  const CacheStats bel = simulate_belady(seq, 3);
  EXPECT_GE(pred->stats().hits, 45u) << "of 100 (Belady " << bel.hits << ")";
  EXPECT_LE(pred->stats().hits, bel.hits);
}

TEST(ExpertCache, PredictGlobalWeighsLayerOrder) {
  // 3 layers of 2 experts (key = 2 * layer + expert), one cache of 4 slots, one
  // batch per (token, layer), token-major. Token 0 and 1 use expert 0 of every
  // layer; token 2 uses expert 1 at layers 0 and 1. At key 3 (layer 1) the cache
  // is full of 0, 2, 4, 1 (LRU would evict 0). With decay 0.9 and mix 0.5,
  // D = g + 3 (1/p - 1), p = 0.5 m + 0.5 f:
  //   key 0: g 2, f 0.1*1.9*0.9 = 0.171, m = r = 0.5        -> D 7.94
  //   key 1: g 2, f 0.1,                 m = r = 0.5        -> D 9.00
  //   key 2: g 3, f 0.171,               m = r = 0.5        -> D 8.94
  //   key 4: g 1, f 0.19,  m = (1 + 0.5) / (1 + 1) = 0.75   -> D 4.38
  // so 1 goes: the layer just run (0) comes back last, and 1 is its least likely key.
  CacheOptions o;
  o.num_experts = 2;
  o.max_keys = 6;
  auto c = ExpertCache::create("predict", 4, o);
  run_steps(*c, {{0, 0, false, -1}, {2, 1, false, -1}, {4, 2, false, -1},  // token 0
                 {0, 3, true, -1},  {2, 4, true, -1},  {4, 5, true, -1},   // token 1
                 {1, 6, false, -1}, {3, 7, false, 1}});                    // token 2
}

// ---- hints: keys the current batch needs are not evicted ---------------------

TEST(ExpertCache, HintedKeysOfTheBatchAreNotEvicted) {
  auto c = ExpertCache::create("lru", 3, CacheOptions{});
  run_steps(*c, {{1, 0, false, -1}, {2, 0, false, -1}, {3, 0, false, -1}});  // LRU order 1 2 3
  const uint64_t batch[] = {1, 4, 5};
  c->hint_upcoming(batch, 3);
  // 4: plain LRU would evict 1, which this batch still needs: 2 goes.
  // 5: 1 is still needed, 4 is hinted but already served: 3 (unhinted) goes first.
  run_steps(*c, {{4, 1, false, 2}, {5, 1, false, 3}, {1, 1, true, -1}});
  // A new hint replaces the old one: 1 is now plain LRU.
  const uint64_t next[] = {6};
  c->hint_upcoming(next, 1);
  run_steps(*c, {{6, 2, false, 4}});
}

TEST(ExpertCache, BatchLargerThanCapacityReloadsRatherThanFails) {
  // The batch needs 3 distinct keys and there are 2 slots. 3: both residents are
  // still needed, so one must go (least recently used: 1). 1: 3 was already
  // served, so it goes rather than 2, which is then a hit.
  auto c = ExpertCache::create("lru", 2, CacheOptions{});
  run_steps(*c, {{1, 0, false, -1}, {2, 0, false, -1}});
  const uint64_t batch[] = {1, 2, 3};
  c->hint_upcoming(batch, 3);
  run_steps(*c, {{3, 1, false, 1}, {1, 1, false, 3}, {2, 1, true, -1}});
  c->hint_upcoming(batch, 3);
  run_steps(*c, {{1, 2, true, -1}, {2, 2, true, -1}, {3, 2, false, 1}});
}

// ---- Belady ------------------------------------------------------------------

TEST(Belady, TextbookExample) {
  // Silberschatz, Operating System Concepts, the optimal page replacement
  // example: 20 references, 3 frames, 9 page faults.
  const std::vector<uint64_t> refs = {7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1};
  const CacheStats s = simulate_belady(refs, 3, 4096);
  EXPECT_EQ(s.misses, 9u);
  EXPECT_EQ(s.hits, 11u);
  EXPECT_EQ(s.evictions, 6u);
  EXPECT_EQ(s.bytes_loaded, 9u * 4096);
  // The same with 4 frames: 8 faults; LRU needs 12 with 3 frames (same book).
  EXPECT_EQ(simulate_belady(refs, 4).misses, 8u);
  auto lru = ExpertCache::create("lru", 3, CacheOptions{});
  int64_t ev;
  for (size_t i = 0; i < refs.size(); ++i) lru->access(refs[i], i, &ev);
  EXPECT_EQ(lru->stats().misses, 12u);
}

// Fewest misses of any demand-paging schedule, by exhaustive search.
uint64_t brute_min_misses(const std::vector<uint64_t>& seq, size_t i, std::vector<uint64_t> cache, size_t cap) {
  for (; i < seq.size(); ++i) {
    if (std::find(cache.begin(), cache.end(), seq[i]) != cache.end()) continue;
    if (cache.size() < cap) {
      cache.push_back(seq[i]);
      continue;
    }
    uint64_t best = UINT64_MAX;
    for (size_t v = 0; v < cache.size(); ++v) {
      auto next = cache;
      next[v] = seq[i];
      best = std::min(best, 1 + brute_min_misses(seq, i + 1, next, cap));
    }
    return best;
  }
  return 0;
}

TEST(Belady, MatchesExhaustiveSearch) {
  const uint64_t seed = test::test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 200; ++trial) {
    const size_t n = 4 + rng() % 9, keys = 2 + rng() % 4, cap = 1 + rng() % 3;
    std::vector<uint64_t> seq(n);
    for (auto& k : seq) k = rng() % keys;
    std::set<uint64_t> distinct;
    uint64_t compulsory = 0;  // first uses that fill free slots are misses the search does not count
    for (uint64_t k : seq)
      if (distinct.insert(k).second && distinct.size() <= cap) ++compulsory;
    ASSERT_EQ(simulate_belady(seq, cap).misses, compulsory + brute_min_misses(seq, 0, {}, cap)) << "trial " << trial;
  }
}

// ---- every policy is bounded by Belady on random traces ---------------------

// A random trace with locality: L layers of E experts, top-k batches, each
// layer's experts drawn from a drifting skewed distribution.
AccessTrace random_trace(std::mt19937_64& rng, uint32_t L, uint32_t E, uint32_t k, size_t tokens, bool per_layer) {
  AccessTrace t;
  t.num_groups = per_layer ? L : 1;
  std::vector<std::vector<double>> w(L, std::vector<double>(E));
  for (auto& l : w)
    for (auto& x : l) x = std::uniform_real_distribution<double>(0.05, 1.0)(rng);
  for (size_t tok = 0; tok < tokens; ++tok) {
    for (uint32_t l = 0; l < L; ++l) {
      if (rng() % 8 == 0) w[l][rng() % E] = std::uniform_real_distribution<double>(0.05, 3.0)(rng);  // drift
      std::vector<double> p = w[l];
      AccessBatch b;
      b.group = per_layer ? l : 0;
      b.begin = t.keys.size();
      for (uint32_t j = 0; j < k; ++j) {
        std::discrete_distribution<uint32_t> d(p.begin(), p.end());
        const uint32_t e = d(rng);
        p[e] = 0;  // distinct experts per token
        t.keys.push_back(static_cast<uint64_t>(l) * E + e);
      }
      b.end = t.keys.size();
      t.batches.push_back(b);
    }
  }
  return t;
}

TEST(ExpertCache, EveryPolicyAtMostBeladyOnRandomTraces) {
  const uint64_t seed = test::test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 24; ++trial) {
    const uint32_t L = 1 + rng() % 4, E = 4 + rng() % 9, k = 1 + rng() % 3;
    const bool per_layer = rng() % 2;
    const size_t cap = per_layer ? k + rng() % (E - k + 1) : k + rng() % (L * E);
    const AccessTrace t = random_trace(rng, L, E, k, 50 + rng() % 150, per_layer);
    const CacheStats bel = replay_belady(t, cap, 8);
    ASSERT_EQ(bel.hits + bel.misses, t.keys.size());
    for (const auto& p : ExpertCache::policy_names())
      for (bool hints : {false, true}) {
        SCOPED_TRACE("trial " + std::to_string(trial) + " policy " + p + (hints ? " hinted" : "") + " L " +
                     std::to_string(L) + " E " + std::to_string(E) + " k " + std::to_string(k) + " cap " +
                     std::to_string(cap) + (per_layer ? " per-layer" : " global"));
        const CacheStats s = replay(
            t,
            [&](uint32_t g) {
              CacheOptions o;
              o.bytes_per_slot = 8;
              o.decay = 0.8;
              o.num_experts = E;
              o.max_keys = static_cast<uint64_t>(L) * E;
              // One pin, fewer than the capacity: no miss is served without caching.
              if (p == "pinned" && cap > 1) o.pinned = {static_cast<uint64_t>(g) * E + g % E};
              return ExpertCache::create(p, cap, o);
            },
            hints);
        EXPECT_EQ(s.hits + s.misses, t.keys.size());
        EXPECT_EQ(s.bytes_loaded, s.misses * 8);
        // NOTE: pinned keys are loaded before the first access, not counted as
        // misses; Belady starts empty. So the bound is on loads: misses plus
        // preloaded keys (one per cache here) are never fewer than Belady's.
        const uint64_t preloaded = p == "pinned" && cap > 1 ? t.num_groups : 0;
        EXPECT_GE(s.misses + preloaded, bel.misses);
        if (!preloaded) {
          EXPECT_LE(s.hits, bel.hits);
        }
      }
  }
}

// Invariants under random hinted batches: at most `capacity` keys resident, the
// accessed key resident after the access, the victim no longer resident, and no
// victim among the batch's keys not yet served (when the batch fits).
TEST(ExpertCache, RandomHintedBatchesKeepInvariants) {
  const uint64_t seed = test::test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  const uint32_t E = 8, L = 4;
  for (const auto& p : ExpertCache::policy_names()) {
    SCOPED_TRACE(p);
    const size_t cap = 3 + rng() % 6;
    CacheOptions o;
    o.num_experts = E;
    if (p == "pinned") o.pinned = {0, 9};
    auto c = ExpertCache::create(p, cap, o);
    std::set<uint64_t> shadow(o.pinned.begin(), o.pinned.end());
    for (uint64_t now = 0; now < 2000; ++now) {
      const uint64_t layer = now % L;
      std::vector<uint64_t> batch;
      const size_t n = 1 + rng() % (cap - o.pinned.size());
      while (batch.size() < n) {
        const uint64_t k = layer * E + rng() % E;
        if (std::find(batch.begin(), batch.end(), k) == batch.end()) batch.push_back(k);
      }
      c->hint_upcoming(batch.data(), batch.size());
      for (size_t i = 0; i < batch.size(); ++i) {
        int64_t ev = -2;
        const bool hit = c->access(batch[i], now, &ev);
        ASSERT_EQ(hit, shadow.count(batch[i]) == 1) << "now " << now;
        if (ev >= 0) {
          ASSERT_TRUE(shadow.erase(static_cast<uint64_t>(ev))) << "evicted a key that was not resident";
          ASSERT_EQ(std::find(batch.begin() + i + 1, batch.end(), static_cast<uint64_t>(ev)), batch.end())
              << "evicted " << ev << ", which this batch still needs (now " << now << ")";
          ASSERT_EQ(std::count(o.pinned.begin(), o.pinned.end(), static_cast<uint64_t>(ev)), 0);
        } else {
          ASSERT_EQ(ev, -1);
        }
        shadow.insert(batch[i]);
        ASSERT_LE(shadow.size(), cap);
        ASSERT_TRUE(c->resident(batch[i]));
      }
    }
    for (uint64_t k = 0; k < L * E; ++k) ASSERT_EQ(c->resident(k), shadow.count(k) == 1) << "key " << k;
  }
}

// ---- the hot path allocates nothing in steady state --------------------------

TEST(ExpertCache, AccessDoesNotAllocateInSteadyState) {
  if (!COLIBRI_COUNT_ALLOCS) GTEST_SKIP() << "operator new is the sanitizer's in this build: allocations not counted";
  const uint32_t L = 32, E = 8;
  std::mt19937_64 rng(3);
  std::vector<uint64_t> keys(20000);
  for (auto& k : keys) k = (rng() % L) * E + rng() % E;
  for (const auto& p : ExpertCache::policy_names()) {
    CacheOptions o;
    o.max_keys = L * E;
    o.num_experts = E;
    if (p == "pinned") o.pinned = {1, 2, 3};
    auto c = ExpertCache::create(p, 40, o);
    int64_t ev;
    // Warm-up: predict allocates its per-layer tables the first time a layer runs.
    for (size_t i = 0; i < 1000; ++i) c->access(keys[i], i / 2, &ev);
    g_allocs = 0;
    g_count_allocs = true;
    for (size_t i = 1000; i < keys.size(); i += 2) {
      c->hint_upcoming(&keys[i], 2);
      c->access(keys[i], i / 2, &ev);
      c->access(keys[i + 1], i / 2, &ev);
    }
    g_count_allocs = false;
    EXPECT_EQ(g_allocs.load(), 0u) << p;
  }
}

// ---- the real Mixtral-8x7B traces: the README's numbers ----------------------

std::string real_trace(const std::string& name) {
  if (const char* d = std::getenv("COLIBRI_TRACES_DIR")) return std::string(d) + "/" + name;
  return std::string(COLIBRI_FIXTURES_DIR) + "/../../../shared/traces/mixtral-8x7b/" + name;
}

// The replay the README measured: one cache per layer, token by token in time
// order, each token's experts one access each in slot order.
AccessTrace per_layer_token_trace(const RoutingTrace& rt) {
  AccessTrace t;
  t.num_groups = static_cast<uint32_t>(rt.num_layers);
  for (const RoutingRecord& r : rt.records) {
    AccessBatch b;
    b.group = static_cast<uint32_t>(r.layer);
    b.begin = t.keys.size();
    for (int32_t e : r.experts) t.keys.push_back(static_cast<uint64_t>(r.layer) * rt.num_experts + e);
    b.end = t.keys.size();
    t.batches.push_back(b);
  }
  return t;
}

double policy_rate(const AccessTrace& t, const RoutingTrace& rt, const std::string& p, size_t cap) {
  return replay(
             t,
             [&](uint32_t) {
               CacheOptions o;
               o.num_experts = static_cast<uint32_t>(rt.num_experts);
               o.max_keys = static_cast<uint64_t>(rt.num_layers) * rt.num_experts;
               return ExpertCache::create(p, cap, o);
             },
             false)
      .hit_rate();
}

TEST(ExpertCache, RealTracesReproduceTheReadme) {
  struct Row {
    const char* file;
    size_t cap;
    double lru, lfu, belady;  // README of ../shared/traces/mixtral-8x7b
  };
  const Row rows[] = {{"humaneval0_routing_raw.jsonl", 5, 0.728, 0.698, 0.851},
                      {"humaneval0_routing_raw.jsonl", 3, 0.468, 0.427, 0.648},
                      {"gsm8k_2_routing.jsonl", 5, 0.693, 0.703, 0.836}};
  for (const Row& row : rows) {
    const std::string path = real_trace(row.file);
    if (!std::filesystem::exists(path)) GTEST_SKIP() << "real trace not present: " << path;
    SCOPED_TRACE(std::string(row.file) + " C=" + std::to_string(row.cap));
    const RoutingTrace rt = read_routing_trace(path);
    ASSERT_EQ(rt.num_layers, 32);
    ASSERT_EQ(rt.num_experts, 8);
    const AccessTrace t = per_layer_token_trace(rt);
    // The README rounds to 0.1%: agree within 0.1%.
    EXPECT_NEAR(policy_rate(t, rt, "lru", row.cap), row.lru, 0.001);
    EXPECT_NEAR(policy_rate(t, rt, "lfu", row.cap), row.lfu, 0.001);
    const double bel = replay_belady(t, row.cap).hit_rate();
    EXPECT_NEAR(bel, row.belady, 0.001);
    for (const auto& p : ExpertCache::policy_names()) EXPECT_LE(policy_rate(t, rt, p, row.cap), bel) << p;
  }
}

}  // namespace
}  // namespace colibri
