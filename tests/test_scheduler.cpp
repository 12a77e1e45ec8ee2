// test_scheduler.cpp: continuous batching (coordinator/scheduler.h) and the
// paged KV cache (coordinator/kv_cache.h): requests arriving at random steps,
// preempted and recomputed, cancelled, get bitwise the tokens and logits of
// each request alone; the block pool's bookkeeping; the KV limits' errors.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>

#include "coordinator/kv_cache.h"
#include "coordinator/scheduler.h"
#include "model/error.h"
#include "tests/fixture.h"

using namespace colibri;
using namespace colibri::test;

namespace {

// The converted fixtures of one family of each attention kind: grouped
// (Mixtral), shared expert and q/k norms (Qwen2-MoE, Qwen3-MoE), latent
// (DeepSeek-V3), sinks and a sliding window (gpt-oss).
const std::vector<std::string>& sched_fixtures() {
  static const std::vector<std::string> v = {"mixtral_a", "qwen2_moe_a", "qwen3_moe_a", "deepseek_v3_a", "gpt_oss_a"};
  return v;
}

const std::string& converted(const std::string& name) {
  static TempDir* dir = new TempDir();  // NOTE: lives for the whole test binary
  static std::map<std::string, std::string> paths;
  auto it = paths.find(name);
  if (it == paths.end()) it = paths.emplace(name, Fixture(name).convert(*dir, DType::F32)).first;
  return it->second;
}

// Random requests: prompts of 1..max_len random ids, 1..max_new new tokens,
// half greedy and half sampled with their own seeds.
std::vector<Request> random_requests(std::mt19937_64& rng, int n, int64_t vocab, int max_len, int max_new) {
  std::vector<Request> r(static_cast<size_t>(n));
  for (auto& q : r) {
    q.prompt.resize(1 + rng() % static_cast<uint64_t>(max_len));
    for (auto& t : q.prompt) t = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab));
    q.max_new_tokens = static_cast<int32_t>(1 + rng() % static_cast<uint64_t>(max_new));
    q.ignore_eos = true;
    if (rng() % 2) {
      q.sampling.temperature = 0.8f;
      q.sampling.top_p = 0.9f;
      q.sampling.seed = rng();
    }
  }
  return r;
}

void expect_same(const SequenceOutput& got, const SequenceOutput& want, const std::string& what) {
  ASSERT_EQ(got.tokens, want.tokens) << what;
  ASSERT_EQ(got.finish_reason, want.finish_reason) << what;
  ASSERT_EQ(got.logits.size(), want.logits.size()) << what;
  ASSERT_EQ(std::memcmp(got.logits.data(), want.logits.data(), got.logits.size() * sizeof(float)), 0)
      << what << ": logits differ (bitwise)";
}

// Each request alone, through generate().
std::vector<SequenceOutput> alone(const std::string& path, const std::vector<Request>& reqs) {
  std::vector<SequenceOutput> out;
  for (const Request& r : reqs) out.push_back(run_engine(path, {r})[0]);
  return out;
}

// Runs `reqs` through a scheduler, submitting request i just before step
// arrive[i]; returns the outputs in request order.
std::vector<SequenceOutput> schedule(Engine& engine, const SchedulerOptions& so, const std::vector<Request>& reqs,
                                     const std::vector<int>& arrive, SchedulerStats* stats = nullptr) {
  Scheduler sched(engine, so);
  std::vector<int64_t> ids(reqs.size(), -1);
  int step = 0;
  size_t submitted = 0;
  while (submitted < reqs.size() || !sched.idle()) {
    for (size_t i = 0; i < reqs.size(); ++i)
      if (ids[i] < 0 && arrive[i] <= step) {
        ids[i] = sched.submit(reqs[i]);
        ++submitted;
      }
    sched.step();
    ++step;
    if (step > 100000) throw std::runtime_error("the scheduler does not finish");
  }
  std::vector<SequenceOutput> out;
  for (int64_t id : ids) out.push_back(sched.take(id));
  EXPECT_EQ(engine.kv_pool().free_blocks(), engine.kv_pool().num_blocks()) << "blocks leaked";
  if (stats) *stats = sched.stats();
  return out;
}

std::unique_ptr<Engine> make_engine(const std::string& path, EngineOptions eo, std::unique_ptr<Communicator>& comm) {
  comm = make_local_communicator();
  return std::make_unique<Engine>(ColibriFile::open(path), eo, *comm);
}

}  // namespace

TEST(KvBlockPool, ReservesLowestBlocksFirstAndReleasesThemAll) {
  KvBlockPool pool(10, 4, 3, 37);  // 10 blocks of 4 positions, 3 slots, 37 positions: 10 per slot
  EXPECT_EQ(pool.blocks_per_slot(), 10);
  EXPECT_EQ(pool.free_blocks(), 10);
  ASSERT_TRUE(pool.reserve(1, 9));  // 3 blocks
  EXPECT_EQ(pool.capacity(1), 12);
  EXPECT_EQ(std::vector<int32_t>(pool.table(1), pool.table(1) + 4), (std::vector<int32_t>{0, 1, 2, -1}));
  ASSERT_TRUE(pool.reserve(0, 1));
  EXPECT_EQ(pool.table(0)[0], 3);
  ASSERT_TRUE(pool.reserve(1, 12));  // already held: no change
  EXPECT_EQ(pool.free_blocks(), 6);
  const uint64_t v = pool.version();
  EXPECT_FALSE(pool.reserve(2, 28)) << "7 blocks with 6 free";
  EXPECT_EQ(pool.free_blocks(), 6) << "a failed reserve takes nothing";
  EXPECT_EQ(pool.table(2)[0], -1);
  EXPECT_EQ(pool.version(), v);
  pool.release(1);
  EXPECT_EQ(pool.free_blocks(), 9);
  EXPECT_EQ(pool.table(1)[0], -1);
  ASSERT_TRUE(pool.reserve(2, 5));
  EXPECT_EQ(pool.table(2)[0], 0) << "the lowest free block first";
  EXPECT_EQ(pool.table(2)[1], 1);
  EXPECT_THROW(pool.reserve(0, 41), Error) << "beyond the context";
  EXPECT_THROW(KvBlockPool(0, 4, 1, 8), Error);
}

// Requests arriving at random steps, with a random step budget and running
// set, get bitwise what each gets alone: every attention kind.
TEST(Scheduler, RandomArrivalsGiveEachRequestAloneBitwise) {
  uint64_t seed = test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  for (const std::string& name : sched_fixtures()) {
    SCOPED_TRACE(name);
    const std::string& path = converted(name);
    const int64_t vocab = ColibriFile::open(path)->config().vocab_size;
    auto reqs = random_requests(rng, 7, vocab, 20, 9);
    const auto want = alone(path, reqs);
    for (int trial = 0; trial < 2; ++trial) {
      EngineOptions eo;
      eo.max_batch = 2 + static_cast<int64_t>(rng() % 3);
      eo.prefill_chunk = 1 + static_cast<int64_t>(rng() % 12);
      eo.max_context = 64;
      eo.kv_block_tokens = 1 + static_cast<int64_t>(rng() % 8);
      std::unique_ptr<Communicator> comm;
      auto engine = make_engine(path, eo, comm);
      SchedulerOptions so;
      so.record_logits = true;
      std::vector<int> arrive(reqs.size());
      for (auto& a : arrive) a = static_cast<int>(rng() % 12);
      const auto got = schedule(*engine, so, reqs, arrive);
      for (size_t i = 0; i < reqs.size(); ++i)
        expect_same(got[i], want[i], "request " + std::to_string(i) + ", max running " + std::to_string(eo.max_batch) +
                                         ", step budget " + std::to_string(eo.prefill_chunk) + ", block " +
                                         std::to_string(eo.kv_block_tokens));
    }
  }
}

// A cache too small for every running sequence preempts (frees and later
// recomputes) the latest admitted; nothing changes bitwise, nothing is lost.
TEST(Scheduler, PreemptionRecomputesBitwise) {
  uint64_t seed = test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  for (const std::string& name : {std::string("mixtral_a"), std::string("deepseek_v3_a")}) {
    SCOPED_TRACE(name);
    const std::string& path = converted(name);
    auto file = ColibriFile::open(path);
    const int64_t vocab = file->config().vocab_size;
    auto reqs = random_requests(rng, 6, vocab, 12, 24);
    for (auto& r : reqs) r.max_new_tokens = 16 + static_cast<int32_t>(rng() % 9);  // long enough to need blocks
    const auto want = alone(path, reqs);
    // A cache that holds the longest request and two blocks more: 4 running
    // sequences cannot all grow.
    size_t longest = 0;
    for (const auto& r : reqs) longest = std::max(longest, r.prompt.size() + static_cast<size_t>(r.max_new_tokens));
    EngineOptions eo;
    eo.max_batch = 4;
    eo.prefill_chunk = 8;
    eo.max_context = 64;
    eo.kv_block_tokens = 4;
    eo.kv_cache_blocks = static_cast<int64_t>((longest + 3) / 4) + 2;
    std::unique_ptr<Communicator> comm;
    auto engine = make_engine(path, eo, comm);
    ASSERT_EQ(engine->kv_pool().num_blocks(), eo.kv_cache_blocks);
    SchedulerOptions so;
    so.record_logits = true;
    SchedulerStats st;
    const auto got = schedule(*engine, so, reqs, std::vector<int>(reqs.size(), 0), &st);
    for (size_t i = 0; i < reqs.size(); ++i) expect_same(got[i], want[i], "request " + std::to_string(i));
    EXPECT_LE(st.peak_blocks, eo.kv_cache_blocks);
    std::printf("%s: %lld preemptions, %lld prefill + %lld decode rows, peak %lld of %lld blocks\n", name.c_str(), (long long)st.preemptions, (long long)st.prefill_tokens, (long long)st.decode_tokens, (long long)st.peak_blocks, (long long)eo.kv_cache_blocks);
    EXPECT_GT(st.preemptions, 0) << "the cache was meant to be too small for every running sequence";
  }
}

TEST(Scheduler, CancelEndsOneRequestAndFreesItsBlocks) {
  uint64_t seed = test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  const std::string& path = converted("qwen2_moe_a");
  const int64_t vocab = ColibriFile::open(path)->config().vocab_size;
  auto reqs = random_requests(rng, 4, vocab, 10, 4);
  for (auto& r : reqs) r.max_new_tokens = 12;
  const auto want = alone(path, reqs);
  EngineOptions eo;
  eo.max_batch = 4;
  eo.max_context = 64;
  std::unique_ptr<Communicator> comm;
  auto engine = make_engine(path, eo, comm);
  SchedulerOptions so;
  so.record_logits = true;
  Scheduler sched(*engine, so);
  std::vector<int64_t> ids;
  int finished = 0;
  for (const auto& r : reqs) {
    RequestCallbacks cb;
    cb.on_finish = [&](int64_t, const SequenceOutput&) { ++finished; };
    ids.push_back(sched.submit(r, cb));
  }
  const int64_t free0 = engine->kv_pool().free_blocks();
  // Request 1 runs a few steps, then is cancelled; a waiting one is cancelled too.
  for (int s = 0; s < 3; ++s) sched.step();
  EXPECT_LT(engine->kv_pool().free_blocks(), free0);
  const int64_t extra = sched.submit(reqs[0]);
  sched.cancel(ids[1]);
  sched.cancel(extra);
  sched.cancel(12345);  // unknown: no-op
  while (!sched.idle()) sched.step();
  EXPECT_EQ(finished, 4);
  EXPECT_EQ(engine->kv_pool().free_blocks(), engine->kv_pool().num_blocks());
  for (size_t i = 0; i < reqs.size(); ++i) {
    SequenceOutput o = sched.take(ids[i]);
    if (i == 1) {
      EXPECT_EQ(o.finish_reason, "cancelled");
      ASSERT_LT(o.tokens.size(), want[1].tokens.size());
      // What it generated before the cancel is the prefix of what it would have.
      EXPECT_TRUE(std::equal(o.tokens.begin(), o.tokens.end(), want[1].tokens.begin()));
    } else {
      expect_same(o, want[i], "request " + std::to_string(i));
    }
  }
  SequenceOutput e = sched.take(extra);
  EXPECT_EQ(e.finish_reason, "cancelled");
  EXPECT_TRUE(e.tokens.empty());
  EXPECT_THROW(sched.take(ids[0]), Error) << "taken once";
}

// Decode first: a running sequence gets a token at every step while a long
// prompt that arrived later is prefilled in chunks beside it.
TEST(Scheduler, DecodeRunsBesideAChunkedPrefill) {
  const std::string& path = converted("mixtral_a");
  EngineOptions eo;
  eo.max_batch = 2;
  eo.prefill_chunk = 4;
  eo.max_context = 64;
  std::unique_ptr<Communicator> comm;
  auto engine = make_engine(path, eo, comm);
  Scheduler sched(*engine, SchedulerOptions{});
  Request a;
  a.prompt = {1, 2, 3};
  a.max_new_tokens = 10;
  a.ignore_eos = true;
  int a_tokens = 0;
  RequestCallbacks cb;
  cb.on_token = [&](int, int32_t) { return ++a_tokens, true; };
  sched.submit(a, cb);
  sched.step();  // a's prompt, its first token
  ASSERT_EQ(a_tokens, 1);
  Request b;
  b.prompt.assign(20, 5);  // 20 tokens: 5 chunks of 4 alone, 7 beside a's decode rows (3 prompt rows per step)
  b.max_new_tokens = 1;
  const int64_t bid = sched.submit(b);
  for (int s = 0; s < 5; ++s) {
    sched.step();
    EXPECT_EQ(a_tokens, 2 + s) << "a decodes at every step";
    EXPECT_FALSE(sched.finished(bid));
  }
  while (!sched.idle()) sched.step();
  EXPECT_EQ(sched.take(bid).tokens.size(), 1u);
  EXPECT_EQ(sched.stats().preemptions, 0);
}

// A 16-bit KV cache (--kv-dtype bf16 / f16): half the bytes per block; each
// request's tokens and logits stay bitwise those of generate() of it alone with
// the same cache type, whatever runs beside it and through preemption; the
// results differ from the f32 cache's (the option takes effect) but stay close:
// the median request's first-token logits. (Not every request's: the rounding can
// flip a near-tie in a layer's top-k expert choice, and then that request's logits
// move by tens of percent; a bf16 run of mixtral_a saw one at 0.48.)
TEST(Scheduler, SixteenBitKvCacheKeepsBatchInvarianceAndStaysClose) {
  uint64_t seed = test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  for (const std::string& name : {std::string("mixtral_a"), std::string("deepseek_v3_a"), std::string("gpt_oss_a")}) {
    const std::string& path = converted(name);
    const int64_t vocab = ColibriFile::open(path)->config().vocab_size;
    for (DType dt : {DType::BF16, DType::F16}) {
      SCOPED_TRACE(name + " " + dtype_name(dt));
      auto reqs = random_requests(rng, 5, vocab, 16, 10);
      EngineOptions one;
      one.kv_dtype = dt;
      std::vector<SequenceOutput> want, exact;
      for (const Request& r : reqs) {
        want.push_back(run_engine(path, {r}, one)[0]);
        exact.push_back(run_engine(path, {r})[0]);
      }
      EngineOptions eo;
      eo.kv_dtype = dt;
      eo.max_batch = 3;
      eo.prefill_chunk = 1 + static_cast<int64_t>(rng() % 10);
      eo.max_context = 64;
      eo.kv_block_tokens = 4;
      size_t longest = 0;
      for (const auto& r : reqs) longest = std::max(longest, r.prompt.size() + static_cast<size_t>(r.max_new_tokens));
      eo.kv_cache_blocks = static_cast<int64_t>((longest + 3) / 4) + 1;  // too small for 3 long sequences: preempts
      std::unique_ptr<Communicator> comm, comm32;
      auto engine = make_engine(path, eo, comm);
      EngineOptions eo32 = eo;
      eo32.kv_dtype = DType::F32;
      EXPECT_EQ(engine->kv_cache_bytes() * 2, make_engine(path, eo32, comm32)->kv_cache_bytes());
      SchedulerOptions so;
      so.record_logits = true;
      std::vector<int> arrive(reqs.size());
      for (auto& a : arrive) a = static_cast<int>(rng() % 8);
      const auto got = schedule(*engine, so, reqs, arrive);
      bool any_differs = false;
      std::vector<double> rel;
      for (size_t i = 0; i < reqs.size(); ++i) {
        expect_same(got[i], want[i], "request " + std::to_string(i));
        // The first generated token's logits come from the stored prompt.
        ASSERT_GE(exact[i].logits.size(), static_cast<size_t>(vocab));
        any_differs |= std::memcmp(want[i].logits.data(), exact[i].logits.data(), static_cast<size_t>(vocab) * 4) != 0;
        rel.push_back(rel_l2(want[i].logits.data(), exact[i].logits.data(), vocab));
      }
      std::sort(rel.begin(), rel.end());
      const double median = rel[rel.size() / 2];
      std::printf("%s, %s KV cache: first-token logits within %.2e (median) and %.2e (worst) relative L2 of the f32 "
                  "cache's\n", name.c_str(), dtype_name(dt), median, rel.back());
      EXPECT_TRUE(any_differs) << "a 16-bit cache gave bitwise the f32 cache's logits: it was not used";
      EXPECT_LT(median, dt == DType::BF16 ? 3e-2 : 5e-3);
    }
  }
}

TEST(Scheduler, KvLimitsAreClearErrors) {
  const std::string& path = converted("mixtral_a");
  std::unique_ptr<Communicator> comm;
  EngineOptions eo;
  eo.max_context = 64;
  eo.kv_block_tokens = 0;
  EXPECT_THROW(make_engine(path, eo, comm), Error);
  eo.kv_block_tokens = 16;
  eo.kv_cache_mb = -1;
  EXPECT_THROW(make_engine(path, eo, comm), Error);
  eo.kv_cache_mb = 0;
  eo.kv_dtype = static_cast<DType>(7);  // not a storage type
  EXPECT_THROW(make_engine(path, eo, comm), Error);
  eo.kv_dtype = DType::F32;
  eo.kv_cache_mb = 1;
  auto engine = make_engine(path, eo, comm);
  const int64_t positions = engine->kv_pool().num_blocks() * engine->kv_pool().block_tokens();
  Scheduler sched(*engine, SchedulerOptions{});
  if (positions < 64) {
    Request r;
    r.prompt.assign(static_cast<size_t>(positions), 1);
    r.max_new_tokens = 1;
    try {
      sched.submit(r);
      ADD_FAILURE() << "a request larger than the whole cache was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), Status::InvalidArgument);
      EXPECT_NE(std::string(e.what()).find("--kv-cache-mb"), std::string::npos) << e.what();
    }
  }
  Request bad;
  bad.prompt = {-1};
  EXPECT_THROW(sched.submit(bad), Error);
  SchedulerOptions too_many;
  too_many.max_running = engine->max_batch() + 1;
  EXPECT_THROW(Scheduler(*engine, too_many), Error);
  SchedulerOptions too_wide;
  too_wide.max_step_tokens = engine->rows_capacity() + 1;
  EXPECT_THROW(Scheduler(*engine, too_wide), Error);
}
