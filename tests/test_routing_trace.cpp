// test_routing_trace.cpp: routing traces (writer -> reader round trip, import of
// the real Mixtral traces and their time order, malformed input named by line)
// and expert-load statistics (exact aggregation, save/load, validation).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <tuple>

#include "model/error.h"
#include "model/routing_trace.h"
#include "test_util.h"

namespace colibri {
namespace {

using test::TempDir;

void write_trace_text(const std::string& path, const std::string& text) {
  std::ofstream o(path, std::ios::binary);
  o << text;
}

std::string real_trace_path(const std::string& name) {
  return std::string(COLIBRI_FIXTURES_DIR) + "/../../../shared/traces/mixtral-8x7b/" + name;
}

#define SKIP_WITHOUT(path)                                       \
  do {                                                           \
    if (!std::filesystem::exists(path)) {                        \
      GTEST_SKIP() << "real trace not present: " << (path);      \
    }                                                            \
  } while (0)

using test::expect_error;

auto key(const RoutingRecord& r) { return std::make_tuple(r.step, r.layer, r.seq, r.pos); }

// ---- writer / reader --------------------------------------------------------

TEST(RoutingTrace, WriterReaderRoundTrip) {
  const uint64_t seed = test::test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  const int L = 3, E = 6, K = 2;
  TempDir dir;
  const std::string path = dir.file("trace.jsonl");
  std::vector<RoutingRecord> want;
  {
    RoutingTraceWriter w(path, L, E, K);
    std::uniform_real_distribution<float> u(0.f, 1.f);
    int pos0[2] = {0, 0};
    for (int64_t step = 0; step < 5; ++step) {
      const int tokens = step == 0 ? 4 : 1;  // a prefill of 4, then decode steps
      for (int layer = 0; layer < L; ++layer)
        for (int seq = 0; seq < 2; ++seq)
          for (int t = 0; t < tokens; ++t) {
            RoutingRecord r;
            r.step = step;
            r.layer = layer;
            r.seq = seq;
            r.pos = pos0[seq] + t;
            std::vector<int> ids(E);
            for (int i = 0; i < E; ++i) ids[i] = i;
            std::shuffle(ids.begin(), ids.end(), rng);
            r.experts = {ids[0], ids[1]};
            float a = u(rng);
            r.weights = {a, 1.f - a * 0.999f};  // arbitrary bits, must survive the text round trip
            w.write(r.step, r.layer, r.seq, r.pos, r.experts.data(), r.weights.data(), K);
            want.push_back(r);
          }
      for (int seq = 0; seq < 2; ++seq) pos0[seq] += tokens;
    }
    EXPECT_EQ(w.rows_written(), want.size());
    // NOTE: the trace appears at PATH only when closed.
    EXPECT_FALSE(std::filesystem::exists(path));
    EXPECT_EQ(test::temps_of(path).size(), 1u);
  }
  EXPECT_TRUE(std::filesystem::exists(path));
  EXPECT_FALSE(test::temp_left(path));

  auto t = read_routing_trace(path);
  EXPECT_EQ(t.format, "colibri");
  EXPECT_EQ(t.source, path);
  EXPECT_EQ(t.num_layers, L);
  EXPECT_EQ(t.num_experts, E);
  EXPECT_EQ(t.top_k, K);
  ASSERT_EQ(t.records.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE("record " + std::to_string(i));
    EXPECT_EQ(key(t.records[i]), key(want[i]));
    EXPECT_EQ(t.records[i].experts, want[i].experts);
    EXPECT_EQ(t.records[i].weights, want[i].weights);  // bitwise: shortest round-trip text
  }
}

TEST(RoutingTrace, WriterCloseIsExplicitAndIdempotent) {
  TempDir dir;
  const std::string path = dir.file("t.jsonl");
  RoutingTraceWriter w(path, 1, 2, 1);
  int32_t e = 1;
  float wt = 1.f;
  w.write(0, 0, 0, 0, &e, &wt, 1);
  w.flush();
  w.close();
  w.close();
  EXPECT_TRUE(std::filesystem::exists(path));
  expect_error([&] { w.write(1, 0, 0, 1, &e, &wt, 1); }, Status::InvalidArgument, {"closed"});
  EXPECT_EQ(read_routing_trace(path).records.size(), 1u);
}

TEST(RoutingTrace, WriterRemovesPartialTraceWhenRunFails) {
  TempDir dir;
  const std::string path = dir.file("t.jsonl");
  try {
    RoutingTraceWriter w(path, 2, 4, 2);
    int32_t e[2] = {0, 1};
    float wt[2] = {0.5f, 0.5f};
    w.write(0, 0, 0, 0, e, wt, 2);
    throw std::runtime_error("generation failed");
  } catch (const std::runtime_error&) {
  }
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_FALSE(test::temp_left(path));
}

TEST(RoutingTrace, WriterRejectsBadRows) {
  TempDir dir;
  expect_error([&] { RoutingTraceWriter(dir.file("a"), 0, 4, 2); }, Status::InvalidArgument, {"bad dimensions"});
  expect_error([&] { RoutingTraceWriter(dir.file("a"), 2, 4, 5); }, Status::InvalidArgument, {"bad dimensions"});
  expect_error([&] { RoutingTraceWriter(dir.file("no/such/dir/t.jsonl"), 2, 4, 2); }, Status::Io, {"no/such/dir"});
  RoutingTraceWriter w(dir.file("t.jsonl"), 2, 4, 2);
  float wt[2] = {0.6f, 0.4f};
  int32_t ok[2] = {0, 1}, out[2] = {0, 4}, dup[2] = {3, 3};
  expect_error([&] { w.write(0, 2, 0, 0, ok, wt, 2); }, Status::InvalidArgument, {"layer 2", "out of range"});
  expect_error([&] { w.write(0, 0, 0, 0, out, wt, 2); }, Status::InvalidArgument, {"expert 4 out of range"});
  expect_error([&] { w.write(0, 0, 0, 0, dup, wt, 2); }, Status::InvalidArgument, {"expert 3 twice"});
  expect_error([&] { w.write(0, 0, 0, 0, ok, wt, 1); }, Status::InvalidArgument, {"expected top_k 2"});
  float nan[2] = {std::numeric_limits<float>::quiet_NaN(), 0.f};
  expect_error([&] { w.write(0, 0, 0, 0, ok, nan, 2); }, Status::InvalidArgument, {"non-finite"});
  expect_error([&] { w.write(-1, 0, 0, 0, ok, wt, 2); }, Status::InvalidArgument, {"negative"});
}

TEST(RoutingTrace, ReaderPutsOurRowsInTimeOrder) {
  TempDir dir;
  const std::string path = dir.file("t.jsonl");
  write_trace_text(path,
             "{\"format\":\"colibri-routing\",\"version\":1,\"num_layers\":2,\"num_experts\":4,\"top_k\":1}\n"
             "{\"step\":1,\"layer\":0,\"seq\":0,\"pos\":2,\"experts\":[3],\"weights\":[1]}\n"
             "{\"step\":0,\"layer\":1,\"seq\":0,\"pos\":0,\"experts\":[2],\"weights\":[1]}\n"
             "\n"
             "{\"step\":0,\"layer\":0,\"seq\":0,\"pos\":1,\"experts\":[1],\"weights\":[1]}\n"
             "{\"step\":0,\"layer\":0,\"seq\":0,\"pos\":0,\"experts\":[0],\"weights\":[1.0]}\n");
  auto t = read_routing_trace(path);
  ASSERT_EQ(t.records.size(), 4u);
  std::vector<int32_t> first;
  for (const auto& r : t.records) first.push_back(r.experts[0]);
  EXPECT_EQ(first, (std::vector<int32_t>{0, 1, 2, 3}));
}

TEST(RoutingTrace, MissingFileIsIoError) {
  expect_error([] { read_routing_trace("/nonexistent/trace.jsonl"); }, Status::Io, {"/nonexistent/trace.jsonl"});
}

TEST(RoutingTrace, MalformedLinesNameFileAndLine) {
  const std::string H = "{\"format\":\"colibri-routing\",\"version\":1,\"num_layers\":2,\"num_experts\":4,\"top_k\":2}\n";
  const std::string ok = "{\"step\":0,\"layer\":0,\"seq\":0,\"pos\":0,\"experts\":[0,1],\"weights\":[0.5,0.5]}\n";
  const std::string M0 =
      "{\"dataset\":\"d\",\"problem_id\":0,\"layer\":0,\"token_pos\":0,\"experts\":[1,2],\"gating_probs\":[0.7,0.3]}\n";
  const std::string G0 =
      "{\"dataset\":\"d\",\"problem_id\":0,\"layer\":0,\"token_idx\":0,\"experts\":[1,2],\"gating_probs\":[0.7,0.3]}\n";
  struct Case {
    const char* name;
    std::string text;
    int line;
    std::string fragment;
  };
  const std::vector<Case> cases = {
      {"truncated JSON", H + ok + "{\"step\":1,\"layer\":0,\"seq\"", 3, "malformed JSON"},
      {"not an object", H + "[1,2]\n", 2, "not a JSON object"},
      {"missing experts", H + "{\"step\":0,\"layer\":0,\"seq\":0,\"pos\":0,\"weights\":[0.5,0.5]}\n", 2,
       "missing \"experts\""},
      {"expert out of range", H + "{\"step\":0,\"layer\":0,\"seq\":0,\"pos\":0,\"experts\":[0,4],\"weights\":[1,0]}\n", 2,
       "expert 4 is out of range [0, 4)"},
      {"layer out of range", H + ok + "{\"step\":0,\"layer\":2,\"seq\":0,\"pos\":1,\"experts\":[0,1],\"weights\":[1,0]}\n",
       3, "\"layer\" = 2 is out of range"},
      {"negative step", H + "{\"step\":-1,\"layer\":0,\"seq\":0,\"pos\":0,\"experts\":[0,1],\"weights\":[1,0]}\n", 2,
       "\"step\" = -1"},
      {"string step", H + "{\"step\":\"0\",\"layer\":0,\"seq\":0,\"pos\":0,\"experts\":[0,1],\"weights\":[1,0]}\n", 2,
       "\"step\" is not an integer"},
      {"length mismatch", H + "{\"step\":0,\"layer\":0,\"seq\":0,\"pos\":0,\"experts\":[0,1],\"weights\":[1]}\n", 2,
       "has 2 entries but \"weights\" has 1"},
      {"wrong k", H + "{\"step\":0,\"layer\":0,\"seq\":0,\"pos\":0,\"experts\":[0],\"weights\":[1]}\n", 2, "top_k 2"},
      {"repeated expert", H + "{\"step\":0,\"layer\":0,\"seq\":0,\"pos\":0,\"experts\":[1,1],\"weights\":[1,0]}\n", 2,
       "appears twice"},
      {"repeated row", H + ok + "\n" + ok, 4, "repeats the (step, layer, seq, pos) of line 2"},
      {"blank lines still count", H + "\n\n" + "{oops}\n", 4, "malformed JSON"},
      {"unknown format", "{\"format\":\"other\",\"version\":1}\n", 1, "unknown trace format"},
      {"bad version", "{\"format\":\"colibri-routing\",\"version\":2,\"num_layers\":2,\"num_experts\":4,\"top_k\":2}\n", 1,
       "unsupported colibri-routing version 2"},
      {"bad header dims", "{\"format\":\"colibri-routing\",\"version\":1,\"num_layers\":0,\"num_experts\":4,\"top_k\":2}\n",
       1, "\"num_layers\" = 0"},
      {"neither format", "{\"hello\":1}\n", 1, "neither a colibri-routing header nor a Mixtral routing row"},
      {"mixtral: mixed position keys", M0 + M0 + G0, 3, "expected \"token_pos\""},
      {"mixtral: bad probs", M0 + "{\"problem_id\":0,\"layer\":1,\"token_pos\":0,\"experts\":[1,2],\"gating_probs\":\"x\"}\n",
       2, "\"gating_probs\" is not an array"},
      {"mixtral: negative layer", G0 + "{\"problem_id\":0,\"layer\":-3,\"token_idx\":0,\"experts\":[1,2],\"gating_probs\":[1,0]}\n",
       2, "\"layer\" = -3"},
      {"mixtral: repeated row", G0 + "\n" + G0, 3, "repeats problem_id 0, token_idx 0, layer 0 of line 1"},
  };
  TempDir dir;
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string path = dir.file("bad.jsonl");
    write_trace_text(path, c.text);
    expect_error([&] { read_routing_trace(path); }, Status::Format, {path + ":" + std::to_string(c.line) + ": ", c.fragment});
  }
  write_trace_text(dir.file("empty.jsonl"), "\n\n");
  expect_error([&] { read_routing_trace(dir.file("empty.jsonl")); }, Status::Format, {"is empty"});
}

// ---- Mixtral import on hand-made rows ---------------------------------------

std::string mrow(int problem, int layer, const char* pos_key, int pos, int e1, int e2) {
  return "{\"dataset\":\"t\",\"problem_id\":" + std::to_string(problem) + ",\"layer\":" + std::to_string(layer) + ",\"" +
         pos_key + "\":" + std::to_string(pos) + ",\"experts\":[" + std::to_string(e1) + "," + std::to_string(e2) +
         "],\"gating_probs\":[0.75,0.25]}\n";
}

TEST(RoutingTrace, ImportTimeOrderedSteps) {
  // A prefill of 3 tokens over 2 layers, then 3 decode tokens (token_pos 0 each);
  // the second decode step lost its layer-0 row, the third its layer-1 row.
  std::string s;
  for (int l = 0; l < 2; ++l)
    for (int p = 0; p < 3; ++p) s += mrow(7, l, "token_pos", p, p, 5);
  s += mrow(7, 0, "token_pos", 0, 1, 2) + mrow(7, 1, "token_pos", 0, 1, 2);
  s += mrow(7, 1, "token_pos", 0, 3, 4);
  s += mrow(7, 0, "token_pos", 0, 0, 6);
  TempDir dir;
  write_trace_text(dir.file("m.jsonl"), s);
  auto t = read_routing_trace(dir.file("m.jsonl"));
  EXPECT_EQ(t.format, "mixtral-jsonl");
  EXPECT_EQ(t.num_layers, 2);
  EXPECT_EQ(t.num_experts, 7);
  EXPECT_EQ(t.top_k, 2);
  ASSERT_EQ(t.records.size(), 10u);
  std::vector<std::tuple<int64_t, int32_t, int32_t, int32_t>> want = {
      {0, 0, 7, 0}, {0, 0, 7, 1}, {0, 0, 7, 2}, {0, 1, 7, 0}, {0, 1, 7, 1}, {0, 1, 7, 2},
      {1, 0, 7, 3}, {1, 1, 7, 3}, {2, 1, 7, 4}, {3, 0, 7, 5}};
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(key(t.records[i]), want[i]) << "record " << i;
  EXPECT_EQ(t.records[0].experts, (std::vector<int32_t>{0, 5}));
  EXPECT_FLOAT_EQ(t.records[0].weights[0], 0.75f);
}

TEST(RoutingTrace, ImportGroupedIsSortedTokenByToken) {
  // Grouped by problem then layer (problem 1 first, to show the sort).
  std::string s;
  for (int prob : {1, 0})
    for (int l = 0; l < 2; ++l)
      for (int p = 0; p < 2; ++p) s += mrow(prob, l, "token_idx", p, l, 2 + p);
  TempDir dir;
  write_trace_text(dir.file("g.jsonl"), s);
  auto t = read_routing_trace(dir.file("g.jsonl"));
  ASSERT_EQ(t.records.size(), 8u);
  std::vector<std::tuple<int64_t, int32_t, int32_t, int32_t>> want = {
      {0, 0, 0, 0}, {0, 1, 0, 0}, {1, 0, 0, 1}, {1, 1, 0, 1}, {2, 0, 1, 0}, {2, 1, 1, 0}, {3, 0, 1, 1}, {3, 1, 1, 1}};
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(key(t.records[i]), want[i]) << "record " << i;
  EXPECT_EQ(t.records[3].experts, (std::vector<int32_t>{1, 3}));
}

// ---- the real Mixtral-8x7B traces -------------------------------------------

TEST(RoutingTrace, RealHumanEval0IsPrefillThenDecodeSteps) {
  const std::string path = real_trace_path("humaneval0_routing_raw.jsonl");
  SKIP_WITHOUT(path);
  auto t = read_routing_trace(path);
  EXPECT_EQ(t.format, "mixtral-jsonl");
  EXPECT_EQ(t.records.size(), 6777u);  // README
  EXPECT_EQ(t.num_layers, 32);
  EXPECT_EQ(t.num_experts, 8);
  EXPECT_EQ(t.top_k, 2);
  std::map<int64_t, std::set<int32_t>> pos_of_step;
  std::map<int64_t, size_t> rows_of_step;
  for (size_t i = 0; i < t.records.size(); ++i) {
    const auto& r = t.records[i];
    ASSERT_EQ(r.seq, 0);
    if (i > 0) {
      ASSERT_LT(key(t.records[i - 1]), key(r)) << "record " << i << " is not in time order";
    }
    pos_of_step[r.step].insert(r.pos);
    ++rows_of_step[r.step];
  }
  // One prefill step of 135 prompt tokens over 32 layers (a few rows dropped),
  // then one step per decode token at positions 135, 136, ...
  ASSERT_EQ(pos_of_step.size(), 84u);
  EXPECT_EQ(pos_of_step[0].size(), 135u);
  EXPECT_EQ(*pos_of_step[0].rbegin(), 134);
  EXPECT_EQ(rows_of_step[0], 4198u);
  for (int64_t s = 1; s < 84; ++s) {
    ASSERT_EQ(pos_of_step[s].size(), 1u) << "step " << s;
    EXPECT_EQ(*pos_of_step[s].begin(), 134 + s) << "step " << s;
    EXPECT_LE(rows_of_step[s], 32u);
    EXPECT_GE(rows_of_step[s], 26u);
  }
  auto st = aggregate_stats(t);
  EXPECT_EQ(st.tokens, 218u);  // 135 prompt + 83 decode tokens at layer 0
  uint64_t sum = 0;
  for (const auto& row : st.load)
    for (uint64_t v : row) sum += v;
  EXPECT_EQ(sum, 2u * 6777u);
}

void check_grouped(const std::string& name, size_t rows, size_t tokens, size_t layer0) {
  const std::string path = real_trace_path(name);
  SKIP_WITHOUT(path);
  auto t = read_routing_trace(path);
  EXPECT_EQ(t.records.size(), rows);  // README
  EXPECT_EQ(t.num_layers, 32);
  EXPECT_EQ(t.num_experts, 8);
  EXPECT_EQ(t.top_k, 2);
  std::set<std::pair<int32_t, int32_t>> seen;
  for (size_t i = 0; i < t.records.size(); ++i) {
    const auto& r = t.records[i];
    if (i > 0) {
      const auto& p = t.records[i - 1];
      ASSERT_LT(std::make_tuple(p.seq, p.pos, p.layer), std::make_tuple(r.seq, r.pos, r.layer)) << "record " << i;
      const bool same_token = p.seq == r.seq && p.pos == r.pos;
      ASSERT_EQ(r.step, p.step + (same_token ? 0 : 1)) << "record " << i;
    } else {
      ASSERT_EQ(r.step, 0);
    }
    seen.emplace(r.seq, r.pos);
  }
  EXPECT_EQ(seen.size(), tokens);
  EXPECT_EQ(static_cast<size_t>(t.records.back().step) + 1, tokens);
  EXPECT_EQ(aggregate_stats(t).tokens, layer0);
}

TEST(RoutingTrace, RealHumanEval2IsSortedTokenByToken) { check_grouped("humaneval_2_routing.jsonl", 10779, 338, 337); }
TEST(RoutingTrace, RealGsm8k2IsSortedTokenByToken) { check_grouped("gsm8k_2_routing.jsonl", 7889, 247, 246); }

// ---- expert stats -------------------------------------------------------------

RoutingRecord rec(int64_t step, int layer, int seq, int pos, std::vector<int32_t> experts) {
  RoutingRecord r;
  r.step = step;
  r.layer = layer;
  r.seq = seq;
  r.pos = pos;
  r.experts = std::move(experts);
  r.weights.assign(r.experts.size(), 0.5f);
  return r;
}

TEST(ExpertStats, AggregateCountsExactly) {
  RoutingTrace t;
  t.source = "hand-made";
  t.num_layers = 2;
  t.num_experts = 4;
  t.records = {rec(0, 0, 0, 0, {0, 1}), rec(0, 0, 0, 1, {0, 2}), rec(0, 0, 1, 0, {3, 0}), rec(0, 1, 0, 0, {1, 2}),
               rec(0, 1, 0, 1, {1, 3}),
               // token (0, 1, 2) lost its layer-0 row: counted in load, not in tokens
               rec(1, 1, 0, 2, {1, 0})};
  auto s = aggregate_stats(t);
  EXPECT_EQ(s.source, "hand-made");
  EXPECT_EQ(s.num_layers, 2);
  EXPECT_EQ(s.num_experts, 4);
  EXPECT_EQ(s.tokens, 3u);
  EXPECT_EQ(s.load, (std::vector<std::vector<uint64_t>>{{3, 1, 1, 1}, {1, 3, 1, 1}}));

  // Dimensions from the records when the trace has none.
  t.num_layers = t.num_experts = 0;
  auto s2 = aggregate_stats(t);
  EXPECT_EQ(s2.num_layers, 2);
  EXPECT_EQ(s2.num_experts, 4);
  EXPECT_EQ(s2.load, s.load);

  t.num_experts = 3;
  expect_error([&] { aggregate_stats(t); }, Status::InvalidArgument, {"expert 3", "outside [0, 3)"});
  expect_error([] { aggregate_stats(RoutingTrace{}); }, Status::InvalidArgument, {"no routing"});
}

TEST(ExpertStats, SaveLoadRoundTrip) {
  const uint64_t seed = test::test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  ExpertStats s;
  s.source = "some \"quoted\" path.jsonl";
  s.num_layers = 3;
  s.num_experts = 5;
  s.tokens = rng() >> 20;
  s.load.assign(3, std::vector<uint64_t>(5));
  for (auto& row : s.load)
    for (auto& v : row) v = rng() >> 12;  // large values survive too
  TempDir dir;
  save_expert_stats(s, dir.file("s.json"));
  EXPECT_FALSE(test::temp_left(dir.file("s.json")));
  auto r = load_expert_stats(dir.file("s.json"));
  EXPECT_EQ(r.source, s.source);
  EXPECT_EQ(r.num_layers, 3);
  EXPECT_EQ(r.num_experts, 5);
  EXPECT_EQ(r.tokens, s.tokens);
  EXPECT_EQ(r.load, s.load);

  ExpertStats bad = s;
  bad.load.pop_back();
  expect_error([&] { save_expert_stats(bad, dir.file("b.json")); }, Status::InvalidArgument, {"3 layers"});
  expect_error([&] { save_expert_stats(s, dir.file("no/dir/s.json")); }, Status::Io, {"no/dir/s.json"});
}

TEST(ExpertStats, LoadValidates) {
  auto doc = [](const std::string& fmt, const std::string& ver, const std::string& L, const std::string& E,
                const std::string& tokens, const std::string& load) {
    return "{\"format\":" + fmt + ",\"version\":" + ver + ",\"num_layers\":" + L + ",\"num_experts\":" + E +
           ",\"tokens\":" + tokens + ",\"load\":" + load + "}";
  };
  const std::string F = "\"colibri-expert-stats\"";
  struct Case {
    const char* name;
    std::string text;
    std::string fragment;
  };
  const std::vector<Case> cases = {
      {"malformed", "{\"format\":", "malformed JSON"},
      {"not an object", "[]", "not a JSON object"},
      {"wrong format", doc("\"colibri-placement\"", "1", "1", "2", "3", "[[1,2]]"), "\"format\" is not \"colibri-expert-stats\""},
      {"wrong version", doc(F, "2", "1", "2", "3", "[[1,2]]"), "unsupported version 2"},
      {"zero layers", doc(F, "1", "0", "2", "3", "[]"), "\"num_layers\" must be an integer in [1"},
      {"zero experts", doc(F, "1", "1", "0", "3", "[[]]"), "\"num_experts\" must be"},
      {"negative tokens", doc(F, "1", "1", "2", "-3", "[[1,2]]"), "\"tokens\" must be a non-negative integer"},
      {"too few layers", doc(F, "1", "2", "2", "3", "[[1,2]]"), "\"load\" has 1 layers, num_layers is 2"},
      {"short row", doc(F, "1", "2", "2", "3", "[[1,2],[1]]"), "load of layer 1 must be an array of 2 counts"},
      {"negative count", doc(F, "1", "1", "2", "3", "[[1,-2]]"), "layer 0, expert 1 is not a non-negative integer"},
      {"fractional count", doc(F, "1", "1", "2", "3", "[[1.5,2]]"), "layer 0, expert 0 is not a non-negative integer"},
      {"load not array", doc(F, "1", "1", "2", "3", "{}"), "\"load\" must be an array"},
  };
  TempDir dir;
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    write_trace_text(dir.file("s.json"), c.text);
    expect_error([&] { load_expert_stats(dir.file("s.json")); }, Status::Format, {dir.file("s.json"), c.fragment});
  }
  expect_error([] { load_expert_stats("/nonexistent/stats.json"); }, Status::Io, {"/nonexistent/stats.json"});
}

}  // namespace
}  // namespace colibri
