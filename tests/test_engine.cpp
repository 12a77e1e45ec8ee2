// test_engine.cpp: batching, chunking, threading and sampling invariants of the
// one-process engine, and its refusal of bad requests before any work.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>

#include "kernels/cpu/kernels.h"
#include "model/error.h"
#include "model/synth.h"
#include "tests/fixture.h"

using namespace colibri;
using namespace colibri::test;

namespace {

// A random tiny model shared by the tests in this file.
const std::string& tiny_model() {
  static TempDir* dir = new TempDir();  // NOTE: lives for the whole test binary
  static std::string path = [] {
    SynthOptions so;
    so.preset = "tiny";
    so.seed = 7;
    synthesize_model(dir->file("hf"), so);
    std::string out = dir->file("tiny.colibri");
    convert_checkpoint(dir->file("hf"), out, ConvertOptions{});
    return out;
  }();
  return path;
}

std::vector<Request> random_requests(std::mt19937_64& rng, int n, int64_t vocab, int max_len, int new_tokens) {
  std::uniform_int_distribution<int> len(1, max_len);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(vocab - 1));
  std::vector<Request> r(n);
  for (auto& q : r) {
    q.prompt.resize(len(rng));
    for (auto& t : q.prompt) t = tok(rng);
    q.max_new_tokens = new_tokens;
    q.ignore_eos = true;
  }
  return r;
}

void expect_same(const SequenceOutput& a, const SequenceOutput& b, const std::string& what) {
  ASSERT_EQ(a.tokens, b.tokens) << what;
  ASSERT_EQ(a.logits.size(), b.logits.size()) << what;
  for (size_t i = 0; i < a.logits.size(); ++i)
    ASSERT_EQ(a.logits[i], b.logits[i]) << what << ": logit " << i << " differs (bitwise)";
}

}  // namespace

TEST(Engine, BatchEqualsEachSequenceAloneBitwise) {
  uint64_t seed = test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  auto reqs = random_requests(rng, 5, 512, 23, 9);
  auto batch = run_engine(tiny_model(), reqs);
  for (size_t i = 0; i < reqs.size(); ++i) {
    auto alone = run_engine(tiny_model(), {reqs[i]});
    expect_same(batch[i], alone[0], "sequence " + std::to_string(i));
  }
}

TEST(Engine, PrefillChunkSizeDoesNotChangeResults) {
  uint64_t seed = test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  auto reqs = random_requests(rng, 3, 512, 30, 4);
  EngineOptions big;
  auto ref = run_engine(tiny_model(), reqs, big);
  for (int64_t chunk : {1, 3, 7, 16}) {
    EngineOptions eo;
    eo.prefill_chunk = chunk;
    auto out = run_engine(tiny_model(), reqs, eo);
    for (size_t i = 0; i < reqs.size(); ++i) expect_same(out[i], ref[i], "chunk " + std::to_string(chunk));
  }
}

TEST(Engine, ThreadCountDoesNotChangeResults) {
  uint64_t seed = test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  auto reqs = random_requests(rng, 2, 512, 40, 6);
  int before = kernels::set_threads(0);
  kernels::set_threads(1);
  auto one = run_engine(tiny_model(), reqs);
  kernels::set_threads(2);
  auto two = run_engine(tiny_model(), reqs);
  kernels::set_threads(before);
  for (size_t i = 0; i < reqs.size(); ++i) expect_same(one[i], two[i], "threads 1 vs 2");
}

TEST(Engine, SampledBatchEqualsSequencesAloneWithTheirSeeds) {
  uint64_t seed = test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  auto reqs = random_requests(rng, 4, 512, 12, 12);
  for (size_t i = 0; i < reqs.size(); ++i) reqs[i].sampling = {0.9f, 50, 0.95f, 1000 + i};
  auto batch = run_engine(tiny_model(), reqs);
  for (size_t i = 0; i < reqs.size(); ++i) expect_same(batch[i], run_engine(tiny_model(), {reqs[i]})[0], "sampled");
  // And sampling really samples: over four sequences of 12 tokens, some token
  // differs from greedy.
  auto greedy = reqs;
  for (auto& q : greedy) q.sampling = {};
  auto g = run_engine(tiny_model(), greedy);
  int differ = 0;
  for (size_t i = 0; i < reqs.size(); ++i) differ += batch[i].tokens != g[i].tokens;
  EXPECT_GT(differ, 0);
}

TEST(Engine, StopsAtEosUnlessIgnored) {
  // Find the greedy continuation, then declare its 3rd token the end-of-sequence token.
  uint64_t seed = test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  auto reqs = random_requests(rng, 1, 512, 8, 6);
  auto file = ColibriFile::open(tiny_model());
  auto comm = make_local_communicator();
  Engine engine(file, {}, *comm);
  auto full = engine.generate(reqs, {});
  ASSERT_EQ(full[0].tokens.size(), 6u);
  EXPECT_EQ(full[0].finish_reason, "length");
  // The synth model's eos is token 2; stop only happens when it is sampled.
  const int32_t eos = static_cast<int32_t>(file->config().eos_token_id);
  reqs[0].ignore_eos = false;
  auto out = engine.generate(reqs, {});
  auto it = std::find(full[0].tokens.begin(), full[0].tokens.end(), eos);
  if (it == full[0].tokens.end()) {
    EXPECT_EQ(out[0].tokens, full[0].tokens);
  } else {
    EXPECT_EQ(out[0].finish_reason, "eos");
    EXPECT_EQ(out[0].tokens.back(), eos);
  }
}

TEST(Engine, CallbackSeesEveryTokenAndCanCancel) {
  auto file = ColibriFile::open(tiny_model());
  auto comm = make_local_communicator();
  Engine engine(file, {}, *comm);
  std::vector<Request> reqs(2);
  reqs[0].prompt = {5, 6, 7};
  reqs[1].prompt = {8};
  for (auto& q : reqs) q.max_new_tokens = 5, q.ignore_eos = true;
  int calls = 0;
  GenerateOptions go;
  go.on_token = [&](int seq, int pos, int32_t tok) {
    EXPECT_GE(tok, 0);
    EXPECT_EQ(pos, static_cast<int>(reqs[seq].prompt.size()) + calls / 2);
    ++calls;
    return true;
  };
  auto out = engine.generate(reqs, go);
  EXPECT_EQ(calls, 10);
  go.on_token = [&](int, int, int32_t) { return --calls > 7; };
  GenerateStats st;
  out = engine.generate(reqs, go, &st);
  EXPECT_TRUE(st.cancelled);
  EXPECT_EQ(out[0].finish_reason, "cancelled");
  EXPECT_LT(out[0].tokens.size() + out[1].tokens.size(), 10u);
}

TEST(Engine, BadRequestsFailBeforeAnyWork) {
  auto file = ColibriFile::open(tiny_model());
  auto comm = make_local_communicator();
  EngineOptions eo;
  eo.max_batch = 2;
  eo.max_context = 32;
  Engine engine(file, eo, *comm);
  auto expect_bad = [&](std::vector<Request> reqs, const std::string& needle) {
    try {
      engine.generate(reqs, {});
      ADD_FAILURE() << "accepted a request that should fail with '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), Status::InvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    // Nothing ran: no expert was ever materialised.
    EXPECT_EQ(engine.local_worker()->store().stats().misses, 0u);
  };
  Request ok;
  ok.prompt = {1, 2, 3};
  ok.max_new_tokens = 4;
  Request r = ok;
  r.prompt[1] = 512;
  expect_bad({r}, "token id 512");
  r.prompt[1] = -1;
  expect_bad({ok, r}, "prompt 1: token id -1");
  r = ok;
  r.prompt.clear();
  expect_bad({r}, "empty");
  r = ok;
  r.prompt.assign(30, 1);
  expect_bad({r}, "exceed the context of 32");
  expect_bad({ok, ok, ok}, "maximum batch of 2");
  r = ok;
  r.sampling.top_p = 0;
  expect_bad({r}, "top-p");
  expect_bad({}, "no prompts");
  EXPECT_NO_THROW(engine.generate({ok}, {}));
}

TEST(Engine, RejectsContextBeyondTheModel) {
  auto file = ColibriFile::open(tiny_model());
  auto comm = make_local_communicator();
  EngineOptions eo;
  eo.max_context = file->config().max_position_embeddings + 1;
  try {
    Engine engine(file, eo, *comm);
    ADD_FAILURE() << "accepted a context beyond max_position_embeddings";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::InvalidArgument);
  }
}

namespace {
// Resident set size of this process in KiB (VmRSS).
long rss_kb() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  return -1;
}
}  // namespace

// Thousands of tokens keep memory flat: buffers are sized once, a decode step
// allocates nothing, and the expert fast tier never exceeds its budget.
TEST(Engine, LongRunsKeepMemoryFlatAndTheCacheWithinBudget) {
  auto file = ColibriFile::open(tiny_model());
  auto comm = make_local_communicator();
  EngineOptions eo;
  eo.max_batch = 4;
  eo.store.budget_experts = 3;  // of the 8 experts: forces evictions
  eo.store.policy = "lru";
  Engine engine(file, eo, *comm);
  std::vector<Request> reqs(4);
  for (size_t i = 0; i < reqs.size(); ++i) {
    reqs[i].prompt = {static_cast<int32_t>(10 + i), 20, 30};
    reqs[i].max_new_tokens = 500;  // up to the tiny model's 512 positions
    reqs[i].ignore_eos = true;
    reqs[i].sampling = {0.8f, 0, 1.0f, 100 + i};
  }
  std::vector<long> samples;
  GenerateOptions go;
  int64_t tokens = 0;
  go.on_token = [&](int, int, int32_t) {
    if (++tokens % 500 == 0) samples.push_back(rss_kb());
    return true;
  };
  for (int round = 0; round < 4; ++round) engine.generate(reqs, go);
  ASSERT_EQ(tokens, 4 * 4 * 500);
  ASSERT_GE(samples.size(), 8u);
  // After the first round everything is warm: the rest may not grow by more
  // than a few pages (allocator noise), whatever the number of tokens.
  const long warm = samples[3], last = samples.back();
  RecordProperty("rss_kb_warm", std::to_string(warm));
  RecordProperty("rss_kb_last", std::to_string(last));
  EXPECT_LE(last - warm, 512) << "RSS grew from " << warm << " KiB to " << last << " KiB over " << tokens << " tokens";
  const ExpertStore& store = engine.local_worker()->store();
  EXPECT_EQ(store.slots(), 3u);
  EXPECT_LE(store.slots() * store.block_bytes(), 3 * file->experts().front().size);
  EXPECT_GT(store.stats().evictions, 0u);
  EXPECT_EQ(store.stats().misses * store.block_bytes(), store.stats().bytes_loaded);
}

TEST(Engine, ExpertBudgetBelowOneExpertIsAClearError) {
  auto file = ColibriFile::open(tiny_model());
  auto comm = make_local_communicator();
  EngineOptions eo;
  eo.store.budget_bytes = file->experts().front().size - 1;
  try {
    Engine engine(file, eo, *comm);
    ADD_FAILURE() << "accepted a budget smaller than one expert";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::InvalidArgument);
    EXPECT_NE(std::string(e.what()).find("smaller than one expert"), std::string::npos) << e.what();
  }
}
