// test_gpu_tier.cpp: the GPU fast tier (worker/gpu_experts.h). Host side,
// without a GPU: the slots a budget buys and its refusals (the CPU store's),
// the host-tier request, and the planner: its hits, misses and evictions are
// those of the same ExpertCache policy replayed on the CPU, and its order of
// loads and computations never reads a slot being overwritten (checked against
// the stream/event rules the device side follows). With a GPU: a Worker on the
// GPU with a budget of 1-3 experts against the CPU Worker (bf16 tolerance) and
// the CPU store's cache figures; compiled only where a GPU (or the emulator's)
// can run them (COLIBRI_GPU_CASES, see test_cuda_engine.cpp), skipped without one.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "model/converter.h"
#include "model/error.h"
#include "model/placement.h"
#include "model/synth.h"
#include "tests/test_util.h"
#include "worker/expert_cache.h"
#include "worker/expert_store.h"
#include "worker/gpu_experts.h"
#include "worker/worker.h"

#ifdef COLIBRI_HAVE_CUDA
#include "kernels/cuda/ffn.h"
#include "kernels/cuda/ffn_pack.h"
#endif

using namespace colibri;
using namespace colibri::test;

namespace {


// A tiny model of `arch` (f32), made once per binary.
std::shared_ptr<const ColibriFile> tiny(const std::string& arch) {
  static TempDir* dir = new TempDir();  // NOTE: lives for the whole test binary
  static std::map<std::string, std::shared_ptr<const ColibriFile>> files;
  auto& f = files[arch];
  if (!f) {
    SynthOptions so;
    so.arch = arch;
    so.preset = "tiny";
    so.seed = 11;
    synthesize_model(dir->file(arch + "-hf"), so);
    const std::string out = dir->file(arch + ".colibri");
    convert_checkpoint(dir->file(arch + "-hf"), out, ConvertOptions{});
    f = ColibriFile::open(out);
  }
  return f;
}

ExpertStoreOptions budget(const std::string& policy, int64_t experts, uint64_t bytes = 0) {
  ExpertStoreOptions o;
  o.policy = policy;
  o.budget_experts = experts;
  o.budget_bytes = bytes;
  return o;
}

std::vector<uint64_t> iota_keys(uint64_t n) {
  std::vector<uint64_t> k(n);
  for (uint64_t i = 0; i < n; ++i) k[i] = i;
  return k;
}

using Op = GpuTierPlanner::Op;
std::string describe(const GpuTierPlanner& p) {
  std::string s;
  for (const Op& op : p.ops())
    s += std::string(s.empty() ? "" : " ") + (op.kind == Op::Load ? "L" : "C") +
         std::to_string(p.items()[op.item].key);
  return s;
}

// Checks one planned layer against the rules the device side relies on
// (worker/gpu_experts.cpp: a load waits for the last computation issued on its
// slot; a loaded expert's computation waits for the last load issued on its
// slot; both streams are idle at the end of the layer), simulating the slots'
// contents in `contents` ([slot] -> key, -1 unknown).
void check_layer(const GpuTierPlanner& p, const std::vector<uint64_t>& keys, std::vector<int64_t>& contents,
                 const std::string& where) {
  SCOPED_TRACE(where + ": " + describe(p));
  const auto& items = p.items();
  const auto& ops = p.ops();
  ASSERT_EQ(items.size(), keys.size());
  std::vector<int> loads(items.size(), 0), computes(items.size(), 0);
  std::vector<int64_t> last_load(contents.size(), -1);     // [slot] item of the last load issued this layer
  std::vector<int64_t> last_compute(contents.size(), -1);  // [slot] item of the last computation issued this layer
  bool loaded_any_computed = false;
  for (size_t i = 0; i < items.size(); ++i) {
    EXPECT_EQ(items[i].key, keys[i]);
    ASSERT_GE(items[i].slot, 0);
    ASSERT_LT(static_cast<size_t>(items[i].slot), contents.size());
  }
  for (const Op& op : ops) {
    ASSERT_LT(op.item, items.size());
    const auto& it = items[op.item];
    const size_t s = static_cast<size_t>(it.slot);
    if (op.kind == Op::Load) {
      ASSERT_TRUE(it.load) << "a hit is loaded";
      ASSERT_EQ(computes[op.item], 0) << "loaded after its computation";
      // The copy waits for the last computation issued on the slot: that must be
      // the previous occupant's (if this layer computed it at all).
      if (it.prev >= 0) {
        EXPECT_EQ(computes[static_cast<size_t>(it.prev)], 1) << "slot overwritten before its previous expert ran";
        EXPECT_EQ(last_compute[s], it.prev);
      } else {
        EXPECT_EQ(last_compute[s], -1) << "a first load into a slot this layer already computed from";
      }
      ++loads[op.item];
      last_load[s] = op.item;
      contents[s] = static_cast<int64_t>(it.key);
    } else {
      if (it.load) {
        EXPECT_EQ(loads[op.item], 1) << "computed before its load";
        EXPECT_EQ(last_load[s], op.item) << "the compute stream would wait for another load";
        loaded_any_computed = true;
      } else {
        EXPECT_EQ(last_load[s], -1) << "a hit computed from a slot being loaded this layer";
        EXPECT_FALSE(loaded_any_computed) << "a hit computed after a loaded expert";
      }
      EXPECT_EQ(contents[s], static_cast<int64_t>(it.key)) << "computed from a slot holding another expert";
      ++computes[op.item];
      last_compute[s] = op.item;
    }
  }
  for (size_t i = 0; i < items.size(); ++i) {
    EXPECT_EQ(computes[i], 1) << "item " << i;
    EXPECT_EQ(loads[i], items[i].load ? 1 : 0) << "item " << i;
    if (items[i].next >= 0) {
      EXPECT_EQ(items[static_cast<size_t>(items[i].next)].prev, static_cast<int32_t>(i));
    }
  }
}

}  // namespace

// ---- host side ---------------------------------------------------------------

TEST(GpuTier, SlotsFromABudgetAsTheCpuStoreCountsThem) {
  const uint64_t B = 1000;
  EXPECT_EQ(gpu_tier_slots(ExpertStoreOptions{}, B, 10), 10u);  // no budget: every owned expert
  EXPECT_EQ(gpu_tier_slots(ExpertStoreOptions{}, B, 0), 1u);
  EXPECT_EQ(gpu_tier_slots(budget("lru", 3), B, 10), 3u);
  EXPECT_EQ(gpu_tier_slots(budget("lru", 50), B, 10), 10u);       // a bigger budget holds them all
  EXPECT_EQ(gpu_tier_slots(budget("lru", 0, 3 * B + 999), B, 10), 3u);
  EXPECT_EQ(gpu_tier_slots(budget("lru", 0, B), B, 10), 1u);
  EXPECT_EQ(gpu_tier_slots(budget("lru", 2, 7 * B), B, 10), 2u);  // experts first, as the CPU store
  expect_error([&] { gpu_tier_slots(budget("lru", 0, B - 1), B, 10); }, Status::InvalidArgument,
               {"expert cache budget of 999 bytes is smaller than one expert (1000 bytes"});
}

TEST(GpuTier, RefusesWhatTheCpuStoreRefusesWithItsWords) {
  auto file = tiny("mixtral");
  const uint64_t keys = file->experts().size();
  const auto owned = iota_keys(keys);
  auto both = [&](const ExpertStoreOptions& o, Status st, const std::vector<std::string>& words) {
    expect_error([&] { ExpertStore s(file, o, owned); }, st, words);
    expect_error([&] { GpuTierPlanner p(o, 4096, owned, keys, static_cast<uint32_t>(file->config().num_experts)); },
                 st, words);
  };
  both(budget("lru", 0, 100), Status::InvalidArgument, {"expert cache budget of 100 bytes is smaller than one expert"});
  both(budget("mru", 2), Status::InvalidArgument, {"unknown expert-cache policy 'mru'", "lru", "predict"});
  ExpertStoreOptions bad = budget("hybrid", 2);
  bad.decay = 1.5;
  both(bad, Status::InvalidArgument, {"hybrid policy: decay must be in (0, 1]"});
}

TEST(GpuTier, HostTierRequest) {
  const char* saved = std::getenv("COLIBRI_GPU_HOST_TIER");
  const std::string keep = saved ? saved : "";
  ::unsetenv("COLIBRI_GPU_HOST_TIER");
  ExpertStoreOptions o;
  EXPECT_EQ(gpu_host_tier_request(o), "auto");
  for (const char* v : {"auto", "pinned", "staging"}) {
    o.gpu_host_tier = v;
    EXPECT_EQ(gpu_host_tier_request(o), v);
  }
  o.gpu_host_tier = "disk";
  expect_error([&] { gpu_host_tier_request(o); }, Status::InvalidArgument, {"'disk'", "auto, pinned or staging"});
  ::setenv("COLIBRI_GPU_HOST_TIER", "staging", 1);
  o.gpu_host_tier = "auto";
  EXPECT_EQ(gpu_host_tier_request(o), "staging");  // auto defers to the environment
  o.gpu_host_tier = "pinned";
  EXPECT_EQ(gpu_host_tier_request(o), "pinned");   // an explicit option wins
  ::setenv("COLIBRI_GPU_HOST_TIER", "ram", 1);
  o.gpu_host_tier = "auto";
  expect_error([&] { gpu_host_tier_request(o); }, Status::InvalidArgument, {"COLIBRI_GPU_HOST_TIER 'ram'"});
  if (saved)
    ::setenv("COLIBRI_GPU_HOST_TIER", keep.c_str(), 1);
  else
    ::unsetenv("COLIBRI_GPU_HOST_TIER");
}

TEST(GpuTier, LoadsFirstThenHitsThenTheLoadedExperts) {
  // One layer of 8 experts, 4 slots, LRU.
  GpuTierPlanner p(budget("lru", 4), 100, iota_keys(8), 8, 8);
  EXPECT_TRUE(p.budgeted());
  EXPECT_EQ(p.capacity(), 4u);
  EXPECT_EQ(p.device_slots(), 4u);
  EXPECT_TRUE(p.preload().empty());
  std::vector<uint64_t> a = {0, 1, 2};
  p.plan(a.data(), a.size(), 0, true);
  EXPECT_EQ(describe(p), "L0 L1 L2 C0 C1 C2");
  std::vector<uint64_t> b = {1, 3, 5};  // 1 hits; 3 takes the free slot; 5 evicts 0 (LRU, not needed now)
  p.plan(b.data(), b.size(), 1, true);
  EXPECT_EQ(describe(p), "L3 L5 C1 C3 C5");
  EXPECT_EQ(p.slot_of(0), -1);
  EXPECT_EQ(p.items()[2].slot, 0);  // 0's slot
  std::vector<uint64_t> c = {2, 3, 6};
  p.plan(c.data(), c.size(), 2, false);  // staging order: hits first, then the loads
  EXPECT_EQ(describe(p), "C2 C3 L6 C6");
  const CacheStats s = p.stats();
  EXPECT_EQ(s.hits, 3u);
  EXPECT_EQ(s.misses, 6u);
  EXPECT_EQ(s.evictions, 2u);
  EXPECT_EQ(s.bytes_loaded, 600u);
  EXPECT_STREQ(p.policy(), "lru");
}

TEST(GpuTier, ALayerWiderThanTheSlotsLoadsEachAfterThePreviousRan) {
  GpuTierPlanner one(budget("lru", 1), 100, iota_keys(4), 4, 4);
  std::vector<uint64_t> k = {0, 1, 2};
  one.plan(k.data(), k.size(), 0, true);
  EXPECT_EQ(describe(one), "L0 C0 L1 C1 L2 C2");
  GpuTierPlanner two(budget("lru", 2), 100, iota_keys(4), 4, 4);
  std::vector<uint64_t> k4 = {0, 1, 2, 3};
  two.plan(k4.data(), k4.size(), 0, true);
  EXPECT_EQ(describe(two), "L0 L1 C0 L2 C1 L3 C2 C3");
  std::vector<int64_t> contents(2, -1);
  check_layer(two, k4, contents, "two slots");
}

TEST(GpuTier, PinnedKeysFillingEverySlotGoThroughABypassSlot) {
  ExpertStoreOptions o = budget("pinned", 2);
  o.pinned = {5, 9, 1, 2};  // 9 is not owned; 1 and 5 are the two pinned
  GpuTierPlanner p(o, 100, iota_keys(8), 8, 8);
  EXPECT_EQ(p.capacity(), 2u);
  EXPECT_EQ(p.device_slots(), 3u);
  ASSERT_EQ(p.preload().size(), 2u);
  EXPECT_EQ(p.preload()[0].first, 5u);
  EXPECT_EQ(p.preload()[1].first, 1u);
  std::vector<int64_t> contents(3, -1);
  for (const auto& [key, slot] : p.preload()) contents[static_cast<size_t>(slot)] = static_cast<int64_t>(key);
  std::vector<uint64_t> k = {1, 3, 5, 6};
  p.plan(k.data(), k.size(), 0, true);
  EXPECT_EQ(describe(p), "L3 C1 C5 C3 L6 C6");
  check_layer(p, k, contents, "bypass");
  EXPECT_EQ(p.items()[1].slot, 2);
  EXPECT_EQ(p.items()[3].slot, 2);
  EXPECT_EQ(p.stats().misses, 2u);
  EXPECT_EQ(p.stats().evictions, 0u);
  // Fewer pinned keys than slots: no bypass slot.
  o.pinned = {5};
  EXPECT_EQ(GpuTierPlanner(o, 100, iota_keys(8), 8, 8).device_slots(), 2u);
}

TEST(GpuTier, WithoutABudgetEveryOwnedExpertIsLoadedOnceAndHits) {
  const std::vector<uint64_t> owned = {1, 4, 6, 7, 10};
  GpuTierPlanner p(ExpertStoreOptions{}, 64, owned, 12, 4);
  EXPECT_FALSE(p.budgeted());
  EXPECT_STREQ(p.policy(), "gpu");
  EXPECT_EQ(p.capacity(), owned.size());
  EXPECT_EQ(p.device_slots(), owned.size());
  ASSERT_EQ(p.preload().size(), owned.size());
  std::set<int32_t> slots;
  for (size_t i = 0; i < owned.size(); ++i) {
    EXPECT_EQ(p.preload()[i].first, owned[i]);
    slots.insert(p.preload()[i].second);
  }
  EXPECT_EQ(slots.size(), owned.size());
  for (uint64_t now = 0; now < 6; ++now) {
    std::vector<uint64_t> k = now % 2 ? std::vector<uint64_t>{4, 6, 7} : std::vector<uint64_t>{1, 10};
    p.plan(k.data(), k.size(), now, true);
    for (const Op& op : p.ops()) EXPECT_EQ(op.kind, Op::Compute);
  }
  const CacheStats s = p.stats();
  EXPECT_EQ(s.misses, owned.size());
  EXPECT_EQ(s.bytes_loaded, owned.size() * 64);
  EXPECT_EQ(s.hits, 15u);
  EXPECT_EQ(s.evictions, 0u);
}

// Random layers (token-major, several experts each) for every policy and
// capacity: the planner's figures equal the policy's replay on the CPU (as
// cache-sim and the CPU store run it), and every layer's order is safe.
TEST(GpuTier, RandomLayersMatchTheCpuReplayAndNeverReadAnOverwrittenSlot) {
  const uint64_t seed = test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  const uint32_t L = 3, E = 8;
  const uint64_t keys = L * E, B = 512;
  for (const std::string& policy : ExpertCache::policy_names())
    for (size_t cap : {1, 2, 3, 5, 8})
      for (bool loads_first : {true, false}) {
        // A random owned subset (at least one expert per layer).
        std::vector<uint64_t> owned;
        for (uint64_t k = 0; k < keys; ++k)
          if (k % E == 0 || rng() % 3) owned.push_back(k);
        ExpertStoreOptions o = budget(policy, static_cast<int64_t>(cap));
        o.decay = 0.8;
        std::vector<uint64_t> pins = owned;
        std::shuffle(pins.begin(), pins.end(), rng);
        pins.resize(std::min<size_t>(pins.size(), rng() % 2 ? cap : std::max<size_t>(cap / 2, 1)));
        o.pinned = pins;
        GpuTierPlanner p(o, B, owned, keys, E);
        const std::string where = policy + " capacity " + std::to_string(cap) + (loads_first ? " loads first" : "");
        std::vector<int64_t> contents(p.device_slots(), -1);
        for (const auto& [key, slot] : p.preload()) contents[static_cast<size_t>(slot)] = static_cast<int64_t>(key);
        // The same batches through the policy alone, as cache-sim replays them.
        AccessTrace trace;
        for (uint64_t step = 0; step < 40; ++step) {
          const uint64_t layer = step % L;
          std::vector<uint64_t> batch;
          for (uint64_t k : owned)
            if (k / E == layer && rng() % 2) batch.push_back(k);
          p.plan(batch.data(), batch.size(), step, loads_first);
          check_layer(p, batch, contents, where + " step " + std::to_string(step));
          if (HasFatalFailure()) return;
          AccessBatch b;
          b.begin = trace.keys.size();
          trace.keys.insert(trace.keys.end(), batch.begin(), batch.end());
          b.end = trace.keys.size();
          trace.batches.push_back(b);
          // The slot table agrees with the policy's residency.
          std::set<int32_t> used;
          for (uint64_t k : owned)
            if (p.slot_of(k) >= 0) {
              EXPECT_TRUE(used.insert(p.slot_of(k)).second) << where << ": two keys in a slot";
            }
        }
        CacheOptions co;
        co.bytes_per_slot = B;
        co.max_keys = keys;
        co.num_experts = E;
        co.decay = o.decay;
        co.pinned = pins;
        const CacheStats want =
            replay(trace, [&](uint32_t) { return ExpertCache::create(policy, std::min(cap, owned.size()), co); }, true);
        const CacheStats got = p.stats();
        EXPECT_EQ(got.hits, want.hits) << where;
        EXPECT_EQ(got.misses, want.misses) << where;
        EXPECT_EQ(got.evictions, want.evictions) << where;
        EXPECT_EQ(got.bytes_loaded, want.bytes_loaded) << where;
      }
}

TEST(GpuTier, PlanningReusesItsBuffers) {
  GpuTierPlanner p(budget("hybrid", 3), 100, iota_keys(16), 16, 16);
  std::vector<uint64_t> all = iota_keys(16);
  p.plan(all.data(), all.size(), 0, true);
  const auto* items = p.items().data();
  const auto* ops = p.ops().data();
  std::mt19937_64 rng(3);
  for (uint64_t now = 1; now < 50; ++now) {
    std::vector<uint64_t> k;
    for (uint64_t i = 0; i < 16; ++i)
      if (rng() % 2) k.push_back(i);
    p.plan(k.data(), k.size(), now, now % 2);
    EXPECT_EQ(p.items().data(), items);
    EXPECT_EQ(p.ops().data(), ops);
  }
}

// ---- the Worker --------------------------------------------------------------

// Without a GPU, a budget with --device cuda is no longer refused as such: the
// refusal is the missing GPU's (or CUDA's), as without a budget.
TEST(GpuTier, WorkerWithABudgetAndNoGpuRefusesForTheMissingGpu) {
  if (have_gpu()) GTEST_SKIP() << "a GPU is present";
  auto file = tiny("mixtral");
  const auto& c = file->config();
  const Placement pl = Placement::single(static_cast<int>(c.num_moe_layers()), static_cast<int>(c.num_experts));
  ExpertStoreOptions o = budget("lru", 2);
  o.device = 0;
  try {
    Worker w(file, pl, 0, 1, 16, o);
    ADD_FAILURE() << "a GPU worker was made without a GPU";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::Unsupported) << e.what();
    const std::string m = e.what();
    EXPECT_TRUE(m.find("no CUDA device is visible") != std::string::npos ||
                m.find("this build has no CUDA") != std::string::npos)
        << m;
  }
}

#if COLIBRI_GPU_CASES  // the cases below need a GPU: see test_cuda_engine.cpp
namespace {

struct LayerRun {
  int layer;
  std::vector<uint32_t> counts;  // [world][E]
  std::vector<float> in;
};

// Random layers for a worker of `world` ranks: each source sends 0-3 rows to
// each expert (about half of the experts chosen per layer), token-major.
std::vector<LayerRun> random_layers(std::mt19937_64& rng, const ModelConfig& c, int world, int steps, int64_t* max_rows) {
  std::vector<LayerRun> v;
  *max_rows = 1;
  for (int step = 0; step < steps; ++step)
    for (int l = 0; l < static_cast<int>(c.num_moe_layers()); ++l) {
      LayerRun r;
      r.layer = l;
      r.counts.assign(static_cast<size_t>(world * c.num_experts), 0);
      int64_t rows = 0;
      for (auto& n : r.counts) {
        n = rng() % 2 ? static_cast<uint32_t>(rng() % 4) : 0;
        rows += n;
      }
      r.in = random_floats(rng, static_cast<size_t>(rows * c.hidden_size));
      *max_rows = std::max(*max_rows, rows);
      v.push_back(std::move(r));
    }
  return v;
}

double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, n = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    d += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    n += static_cast<double>(b[i]) * b[i];
  }
  return n > 0 ? std::sqrt(d / n) : std::sqrt(d);
}

}  // namespace

// The GPU worker with small budgets (every policy, both host tiers) computes what
// the CPU worker computes (bf16 tolerance: the GPU holds weights and rounds the
// activations to bf16) and reports the CPU store's hits, misses and evictions.
TEST(GpuTier, WorkerWithABudgetMatchesTheCpuWorkerAndItsCache) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU";
#ifdef COLIBRI_HAVE_CUDA
  const uint64_t seed = test_seed();
  COLIBRI_SEED_TRACE(seed);
  for (const std::string arch : {"mixtral", "qwen3_moe"}) {
    auto file = tiny(arch);
    const ModelConfig& c = file->config();
    const int L = static_cast<int>(c.num_moe_layers()), E = static_cast<int>(c.num_experts);
    // Two ranks: rank 1 owns every expert and gets rows from both (gathered runs).
    std::vector<std::vector<int>> owners(static_cast<size_t>(L * E), std::vector<int>{1});
    const Placement pl = Placement::from_owners(2, L, E, owners);
    std::mt19937_64 rng(seed);
    int64_t max_rows = 0;
    const auto layers = random_layers(rng, c, 2, 6, &max_rows);
    const uint64_t packed =
        cuda::PackedFfnLayout::of(FfnShape::experts(c), c.expert_bias).bytes;
    struct Case {
      std::string policy;
      int64_t experts;
      std::string tier;
    };
    std::vector<Case> cases;
    for (const auto& p : ExpertCache::policy_names())
      for (int64_t b : {1, 2, 3})
        for (const char* t : {"pinned", "staging"}) cases.push_back({p, b, t});
    cases.push_back({"lru", 0, "auto"});  // no budget: every expert resident
    for (const Case& k : cases) {
      SCOPED_TRACE(arch + " " + k.policy + " budget " + std::to_string(k.experts) + " " + k.tier);
      ExpertStoreOptions o = budget(k.policy, k.experts);
      if (k.policy == "pinned") o.pinned = {static_cast<uint64_t>(E + 1), 0, 3};
      ExpertStoreOptions g = o;
      g.device = 0;
      g.gpu_host_tier = k.tier;
      Worker cpu(file, pl, 1, 2, max_rows, o);
      Worker gpu(file, pl, 1, 2, max_rows, g);
      ASSERT_NE(gpu.gpu(), nullptr);
      const bool evicts = k.experts > 0 && k.experts < L * E;
      EXPECT_STREQ(gpu.gpu()->host_tier(), evicts ? k.tier.c_str() : "staging");
      for (size_t i = 0; i < layers.size(); ++i) {
        const LayerRun& r = layers[i];
        std::vector<float> want(r.in.size()), got(r.in.size(), std::nanf(""));
        cpu.compute(r.layer, r.counts.data(), r.in.data(), want.data());
        gpu.compute(r.layer, r.counts.data(), r.in.data(), got.data());
        EXPECT_LT(rel_l2(got, want), 2e-2) << "layer run " << i;
        for (float x : got) {
          ASSERT_TRUE(std::isfinite(x)) << "layer run " << i << ": an unwritten or bad output";
        }
      }
      const CacheStats a = cpu.cache_stats(), b = gpu.cache_stats();
      if (k.experts > 0) {
        EXPECT_STREQ(gpu.cache_policy(), cpu.cache_policy());
        EXPECT_EQ(gpu.cache_slots(), cpu.cache_slots());
        EXPECT_EQ(b.hits, a.hits);
        EXPECT_EQ(b.misses, a.misses);
        EXPECT_EQ(b.evictions, a.evictions);
        EXPECT_EQ(b.bytes_loaded, b.misses * packed);
      } else {
        EXPECT_STREQ(gpu.cache_policy(), "gpu");
        EXPECT_EQ(gpu.cache_slots(), static_cast<size_t>(L * E));
        EXPECT_EQ(b.misses, static_cast<uint64_t>(L * E));
        EXPECT_EQ(b.hits, a.hits + a.misses);
        EXPECT_EQ(b.evictions, 0u);
      }
    }
  }
#endif
}

// A byte budget is counted in packed (bf16) experts, and below one it is refused.
TEST(GpuTier, WorkerByteBudgetCountsPackedExperts) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU";
#ifdef COLIBRI_HAVE_CUDA
  auto file = tiny("mixtral");
  const ModelConfig& c = file->config();
  const Placement pl = Placement::single(static_cast<int>(c.num_moe_layers()), static_cast<int>(c.num_experts));
  const uint64_t packed = cuda::PackedFfnLayout::of(FfnShape::experts(c), c.expert_bias).bytes;
  ExpertStoreOptions o = budget("lfu", 0, 3 * packed + 1);
  o.device = 0;
  Worker w(file, pl, 0, 1, 8, o);
  EXPECT_EQ(w.cache_slots(), 3u);
  EXPECT_STREQ(w.cache_policy(), "lfu");
  o.budget_bytes = packed - 1;
  expect_error([&] { Worker bad(file, pl, 0, 1, 8, o); }, Status::InvalidArgument, {"smaller than one expert"});
#endif
}
#endif  // COLIBRI_GPU_CASES
