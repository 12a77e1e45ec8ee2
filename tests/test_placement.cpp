// test_placement.cpp: expert placements: the one-process map, the placement
// file (round trip, validation errors), every policy on hand-made loads with
// exact owner lists, replication, and predicted balancedness arithmetic.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "model/error.h"
#include "model/placement.h"
#include "model/routing_trace.h"
#include "test_util.h"

namespace colibri {
namespace {

using test::TempDir;
using Owners = std::vector<std::vector<int>>;  // one layer: [expert] -> owner list

using test::expect_error;

Owners layer_owners(const Placement& p, int layer) {
  Owners o;
  for (int e = 0; e < p.num_experts(); ++e) o.push_back(p.owners(layer, e));
  return o;
}

ExpertStats stats_of(std::vector<std::vector<uint64_t>> load) {
  ExpertStats s;
  s.source = "hand-made";
  s.num_layers = static_cast<int32_t>(load.size());
  s.num_experts = static_cast<int32_t>(load[0].size());
  s.load = std::move(load);
  return s;
}

ExpertStats random_stats(std::mt19937_64& rng, int L, int E) {
  std::vector<std::vector<uint64_t>> load(L, std::vector<uint64_t>(E));
  std::uniform_int_distribution<uint64_t> d(0, 1000);
  for (auto& row : load)
    for (auto& v : row) v = d(rng);
  return stats_of(std::move(load));
}

// ---- the one-process map (what engine and dispatcher use) --------------------

TEST(Placement, SingleIsUnchanged) {
  auto p = Placement::single(3, 4);
  EXPECT_EQ(p.num_layers(), 3);
  EXPECT_EQ(p.num_experts(), 4);
  for (int l = 0; l < 3; ++l)
    for (int e = 0; e < 4; ++e) {
      EXPECT_EQ(p.owners(l, e), std::vector<int>{0});
      for (int64_t row : {0, 1, 7, 1000003}) EXPECT_EQ(p.owner_for_row(l, e, row), 0);
      EXPECT_TRUE(p.owns(0, l, e));
      EXPECT_FALSE(p.owns(1, l, e));
    }
  EXPECT_NO_THROW(p.validate());
  auto q = Placement::single(2, 5, 2);
  for (int e = 0; e < 5; ++e) {
    EXPECT_EQ(q.owners(1, e), std::vector<int>{2});
    EXPECT_EQ(q.owner_for_row(1, e, 12345), 2);
    EXPECT_TRUE(q.owns(2, 1, e));
    EXPECT_FALSE(q.owns(0, 1, e));
  }
  EXPECT_EQ(q.local_experts(2, 0), (std::vector<int>{0, 1, 2, 3, 4}));
  EXPECT_NO_THROW(q.validate());
}

TEST(Placement, OwnerForRowCyclesOverReplicas) {
  auto p = Placement::from_owners(4, 1, 2, {{1, 3, 2}, {2}});
  EXPECT_EQ(p.owner_for_row(0, 0, 0), 1);
  EXPECT_EQ(p.owner_for_row(0, 0, 1), 3);
  EXPECT_EQ(p.owner_for_row(0, 0, 2), 2);
  EXPECT_EQ(p.owner_for_row(0, 0, 3), 1);
  EXPECT_EQ(p.owner_for_row(0, 1, 5), 2);
  EXPECT_EQ(p.redundant(0), 2);
  EXPECT_EQ(p.local_experts(2, 0), (std::vector<int>{0, 1}));
  EXPECT_EQ(p.local_experts(3, 0), (std::vector<int>{0}));
}

// ---- the file -------------------------------------------------------------------

TEST(Placement, JsonRoundTrip) {
  const uint64_t seed = test::test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  auto stats = random_stats(rng, 4, 8);
  TempDir dir;
  for (const auto& policy : placement_policies())
    for (bool coord : {false, true}) {
      SCOPED_TRACE(policy + (coord ? " (coordinator hosts)" : ""));
      auto p = make_placement(policy, 4, 8, 5, coord, &stats, policy == "replicated" ? 3 : 0);
      auto q = Placement::from_json(p.to_json());
      EXPECT_EQ(q.policy(), policy);
      EXPECT_EQ(q.world_size(), 5);
      EXPECT_EQ(q.coordinator_hosts_experts(), coord);
      ASSERT_EQ(q.num_layers(), 4);
      ASSERT_EQ(q.num_experts(), 8);
      for (int l = 0; l < 4; ++l) EXPECT_EQ(layer_owners(q, l), layer_owners(p, l));

      const std::string path = dir.file("p.json");
      p.save(path);
      EXPECT_FALSE(test::temp_left(path));
      auto r = Placement::load(path, 5, 4, 8);
      for (int l = 0; l < 4; ++l) EXPECT_EQ(layer_owners(r, l), layer_owners(p, l));
      expect_error([&] { Placement::load(path, 4, 4, 8); }, Status::InvalidArgument, {path, "made for 5 ranks", "has 4"});
      expect_error([&] { Placement::load(path, 5, 3, 8); }, Status::InvalidArgument, {"4 layers x 8 experts", "3 x 8"});
    }
  expect_error([] { Placement::load("/nonexistent/p.json"); }, Status::Io, {"/nonexistent/p.json"});
  expect_error([&] { Placement::single(1, 1).save(dir.file("no/dir/p.json")); }, Status::Io, {"no/dir/p.json"});
}

TEST(Placement, ValidationErrorsNameTheProblem) {
  // 2 layers x 3 experts, world 3, coordinator not hosting.
  auto doc = [](const std::string& layers, const std::string& extra = "", int version = 1, int world = 3,
                int num_layers = 2) {
    return "{\"format\":\"colibri-placement\",\"version\":" + std::to_string(version) +
           ",\"policy\":\"custom\",\"world_size\":" + std::to_string(world) +
           ",\"num_layers\":" + std::to_string(num_layers) + ",\"num_experts\":3" + extra + ",\"layers\":" + layers + "}";
  };
  const std::string good_layer = "[[1],[2],[1,2]]";
  EXPECT_NO_THROW(Placement::from_json(doc("[" + good_layer + "," + good_layer + "]", ",\"comment\":\"ignored\"")));
  struct Case {
    const char* name;
    std::string text;
    Status status;
    std::string fragment;
  };
  const std::vector<Case> cases = {
      {"malformed JSON", "{\"format\":", Status::Format, "malformed JSON"},
      {"wrong format", "{\"format\":\"colibri-expert-stats\",\"version\":1}", Status::Format, "\"format\" is not \"colibri-placement\""},
      {"bad version", doc("[" + good_layer + "," + good_layer + "]", "", 2), Status::Format, "unsupported version 2"},
      {"missing world_size",
       "{\"format\":\"colibri-placement\",\"version\":1,\"num_layers\":1,\"num_experts\":1,\"layers\":[[[1]]]}",
       Status::Format, "missing \"world_size\""},
      {"wrong layer count", doc("[" + good_layer + "]"), Status::Format, "\"layers\" has 1 entries, num_layers is 2"},
      {"missing expert", doc("[" + good_layer + ",[[1],[2]]]"), Status::Format,
       "layer 1 must list the owners of 3 experts (num_experts), found 2"},
      {"no owner", doc("[" + good_layer + ",[[1],[],[2]]]"), Status::InvalidArgument, "layer 1, expert 1 has no owner"},
      {"rank out of range", doc("[[[1],[3],[2]]," + good_layer + "]"), Status::InvalidArgument,
       "layer 0, expert 1: rank 3 is out of range [0, 3)"},
      {"negative rank", doc("[" + good_layer + ",[[1],[2],[-1]]]"), Status::InvalidArgument,
       "layer 1, expert 2: rank -1 is out of range"},
      {"duplicate owner", doc("[[[1],[2,1,2],[1]]," + good_layer + "]"), Status::InvalidArgument,
       "layer 0, expert 1: rank 2 is listed twice"},
      {"coordinator owns", doc("[[[0],[2],[1]]," + good_layer + "]"), Status::InvalidArgument,
       "layer 0, expert 0: rank 0 is the coordinator and coordinator_hosts_experts is false"},
      {"owner not an integer", doc("[[[1],[\"2\"],[1]]," + good_layer + "]"), Status::Format,
       "layer 0, expert 1: owner \"2\" is not an integer rank"},
      {"owners not an array", doc("[[[1],2,[1]]," + good_layer + "]"), Status::Format,
       "layer 0, expert 1: owners must be an array"},
      {"zero world", doc("[" + good_layer + "," + good_layer + "]", "", 1, 0), Status::Format, "\"world_size\" must be"},
      {"bad flag", doc("[" + good_layer + "," + good_layer + "]", ",\"coordinator_hosts_experts\":1"), Status::Format,
       "\"coordinator_hosts_experts\" is not true or false"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    expect_error([&] { Placement::from_json(c.text, "p.json"); }, c.status, {"p.json", c.fragment});
  }
  // The coordinator may own experts when the file says so, or in a world of one.
  EXPECT_NO_THROW(Placement::from_json(doc("[[[0],[2],[1]]," + good_layer + "]", ",\"coordinator_hosts_experts\":true")));
  EXPECT_NO_THROW(Placement::from_json(doc("[[[0],[0],[0]],[[0],[0],[0]]]", "", 1, 1)));
  expect_error([] { Placement::from_owners(2, 1, 2, {{1}}); }, Status::InvalidArgument, {"1 owner lists"});
}

// ---- policies ---------------------------------------------------------------------

TEST(Placement, HostRanks) {
  EXPECT_EQ(host_ranks(1, false), std::vector<int>{0});
  EXPECT_EQ(host_ranks(3, false), (std::vector<int>{1, 2}));
  EXPECT_EQ(host_ranks(3, true), (std::vector<int>{0, 1, 2}));
}

TEST(Placement, Contiguous) {
  // 8 experts over hosts 1..3: blocks of 3, 3, 2; the same in every layer.
  auto p = make_placement("contiguous", 2, 8, 4, false, nullptr, 0);
  const Owners want = {{1}, {1}, {1}, {2}, {2}, {2}, {3}, {3}};
  EXPECT_EQ(layer_owners(p, 0), want);
  EXPECT_EQ(layer_owners(p, 1), want);
  EXPECT_EQ(p.policy(), "contiguous");
  EXPECT_FALSE(p.coordinator_hosts_experts());
  // The coordinator hosting: hosts 0..3, two each.
  auto q = make_placement("contiguous", 1, 8, 4, true, nullptr, 0);
  EXPECT_EQ(layer_owners(q, 0), (Owners{{0}, {0}, {1}, {1}, {2}, {2}, {3}, {3}}));
  // More hosts than experts: the last hosts get none.
  auto r = make_placement("contiguous", 1, 3, 6, false, nullptr, 0);
  EXPECT_EQ(layer_owners(r, 0), (Owners{{1}, {2}, {3}}));
  // One rank: everything on rank 0, which therefore hosts experts.
  auto s = make_placement("contiguous", 2, 4, 1, false, nullptr, 0);
  EXPECT_EQ(layer_owners(s, 1), (Owners{{0}, {0}, {0}, {0}}));
  EXPECT_TRUE(s.coordinator_hosts_experts());
}

TEST(Placement, RoundRobin) {
  auto p = make_placement("round_robin", 2, 5, 3, false, nullptr, 0);
  EXPECT_EQ(layer_owners(p, 0), (Owners{{1}, {2}, {1}, {2}, {1}}));
  EXPECT_EQ(layer_owners(p, 1), (Owners{{1}, {2}, {1}, {2}, {1}}));
  auto q = make_placement("round_robin", 1, 5, 3, true, nullptr, 0);
  EXPECT_EQ(layer_owners(q, 0), (Owners{{0}, {1}, {2}, {0}, {1}}));
}

TEST(Placement, BalancedIsGreedyLongestProcessingTime) {
  auto stats = stats_of({
      {10, 9, 8, 1, 1, 1},  // 10->1, 9->2, 8->2 (9 < 10), then the 1s to host 1: 13 vs 17
      {5, 5, 5, 5, 0, 0},   // ties: equal loads keep id order, equal hosts go to the lower rank
      {1, 7, 3, 7, 0, 2},   // 1->1, 3->2, 2->1 (tie), 5->2, 0->2, 4->1 (tie at 10)
  });
  auto p = make_placement("balanced", 3, 6, 3, false, &stats, 0);
  EXPECT_EQ(layer_owners(p, 0), (Owners{{1}, {2}, {2}, {1}, {1}, {1}}));
  EXPECT_EQ(layer_owners(p, 1), (Owners{{1}, {2}, {1}, {2}, {1}, {1}}));
  EXPECT_EQ(layer_owners(p, 2), (Owners{{2}, {1}, {1}, {2}, {1}, {2}}));
  expect_error([] { make_placement("balanced", 3, 6, 3, false, nullptr, 0); }, Status::InvalidArgument,
               {"balanced policy needs expert stats"});
  expect_error([&] { make_placement("balanced", 3, 5, 3, false, &stats, 0); }, Status::InvalidArgument,
               {"3 layers x 6 experts", "3 x 5"});
}

TEST(Placement, ReplicatedAddsCopiesOfTheHeaviest) {
  // Hosts 1..3, loads 20, 2, 2, 2, 2, 2 and two extra copies: both go to expert
  // 0 (20/1, then 20/2 = 10 > 2), so it has 3 replicas of 20/3 each. Packing
  // largest first: the three replicas on hosts 1, 2, 3, then 2 -> 1, 2 -> 2,
  // 2 -> 3, 2 -> 1, 2 -> 2 (ties to the lower rank). Host loads 32/3, 32/3, 26/3.
  auto stats = stats_of({{20, 2, 2, 2, 2, 2}});
  auto p = make_placement("replicated", 1, 6, 4, false, &stats, 2);
  EXPECT_EQ(layer_owners(p, 0), (Owners{{1, 2, 3}, {1}, {2}, {3}, {1}, {2}}));
  EXPECT_EQ(p.redundant(0), 2);
  auto b = predicted_balancedness(p, stats);
  EXPECT_NEAR(b.per_layer[0], 10.0 / (32.0 / 3.0), 1e-12);  // 0.9375
  EXPECT_NEAR(b.rank_load[0][2], 26.0 / 3.0, 1e-12);
  // Balanced cannot split expert 0: host loads 20, 6, 4.
  auto bal = predicted_balancedness(make_placement("balanced", 1, 6, 4, false, &stats, 0), stats);
  EXPECT_NEAR(bal.per_layer[0], 0.5, 1e-12);

  // Without stats the loads are equal: copies to experts 0 and 1 (ties: lower
  // id), then units 1, 1, 1/2, 1/2, 1/2, 1/2 packed over hosts 1, 2.
  auto q = make_placement("replicated", 1, 4, 3, false, nullptr, 2);
  EXPECT_EQ(layer_owners(q, 0), (Owners{{1, 2}, {1, 2}, {1}, {2}}));

  // Room for at most E * (H - 1) copies.
  auto full = make_placement("replicated", 1, 2, 3, false, nullptr, 2);
  EXPECT_EQ(layer_owners(full, 0), (Owners{{1, 2}, {1, 2}}));
  expect_error([] { make_placement("replicated", 1, 2, 3, false, nullptr, 3); }, Status::InvalidArgument,
               {"3 redundant copies per layer do not fit"});
}

TEST(Placement, ReplicatedRandomLoads) {
  const uint64_t seed = test::test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  const int L = 6, E = 8, R = 3;
  auto stats = random_stats(rng, L, E);
  // R = 0 is balanced; with no stats and R = 0 it is round_robin.
  auto bal = make_placement("balanced", L, E, 5, false, &stats, 0);
  auto rep0 = make_placement("replicated", L, E, 5, false, &stats, 0);
  auto rr = make_placement("round_robin", L, E, 5, false, nullptr, 0);
  auto rep0_nostats = make_placement("replicated", L, E, 5, false, nullptr, 0);
  for (int l = 0; l < L; ++l) {
    EXPECT_EQ(layer_owners(rep0, l), layer_owners(bal, l)) << "layer " << l;
    EXPECT_EQ(layer_owners(rep0_nostats, l), layer_owners(rr, l)) << "layer " << l;
  }
  auto p = make_placement("replicated", L, E, 5, false, &stats, R);
  for (int l = 0; l < L; ++l) {
    SCOPED_TRACE("layer " + std::to_string(l));
    EXPECT_EQ(p.redundant(l), R);
    int heaviest = 0;
    for (int e = 1; e < E; ++e)
      if (stats.load[l][e] > stats.load[l][heaviest]) heaviest = e;
    EXPECT_GE(p.owners(l, heaviest).size(), 2u) << "the heaviest expert got no replica";
  }
  EXPECT_NO_THROW(p.validate());
  auto b = predicted_balancedness(p, stats);
  EXPECT_GT(b.worst, 0.0);
  EXPECT_LE(b.mean, 1.0);
}

TEST(Placement, BadArguments) {
  expect_error([] { make_placement("spread", 1, 4, 2, false, nullptr, 0); }, Status::InvalidArgument,
               {"unknown placement policy 'spread'"});
  expect_error([] { make_placement("contiguous", 0, 4, 2, false, nullptr, 0); }, Status::InvalidArgument, {"bad sizes"});
  expect_error([] { make_placement("contiguous", 1, 4, 0, false, nullptr, 0); }, Status::InvalidArgument, {"bad sizes"});
  expect_error([] { make_placement("round_robin", 1, 4, 2, false, nullptr, 1); }, Status::InvalidArgument,
               {"only to the replicated policy"});
  expect_error([] { make_placement("replicated", 1, 4, 2, false, nullptr, -1); }, Status::InvalidArgument, {">= 0"});
}

// ---- balancedness ----------------------------------------------------------------

TEST(Placement, BalancednessArithmetic) {
  // World 4, hosts 1..3; rank 3 owns nothing and counts with 0.
  auto p = Placement::from_owners(4, 3, 3,
                                  {{1}, {2}, {2},      // layer 0: loads 6 | 3 + 3 | 0 -> mean 4, max 6
                                   {1, 2}, {1}, {2},   // layer 1: 4 splits 2/2: 2+2 | 2+0 | 0 -> mean 2, max 4
                                   {1}, {2}, {3}});    // layer 2: no load -> 1.0
  auto s = stats_of({{6, 3, 3}, {4, 2, 0}, {0, 0, 0}});
  auto b = predicted_balancedness(p, s);
  EXPECT_EQ(b.hosts, (std::vector<int>{1, 2, 3}));
  ASSERT_EQ(b.per_layer.size(), 3u);
  EXPECT_DOUBLE_EQ(b.per_layer[0], 4.0 / 6.0);
  EXPECT_DOUBLE_EQ(b.per_layer[1], 2.0 / 4.0);
  EXPECT_DOUBLE_EQ(b.per_layer[2], 1.0);
  EXPECT_EQ(b.rank_load[0], (std::vector<double>{6, 6, 0}));
  EXPECT_EQ(b.rank_load[1], (std::vector<double>{4, 2, 0}));
  EXPECT_DOUBLE_EQ(b.mean, (4.0 / 6.0 + 0.5 + 1.0) / 3.0);
  EXPECT_DOUBLE_EQ(b.worst, 0.5);
  EXPECT_EQ(b.worst_layer, 1);

  // A perfect split is 1.0.
  auto even = Placement::from_owners(3, 1, 2, {{1}, {2}});
  EXPECT_DOUBLE_EQ(predicted_balancedness(even, stats_of({{5, 5}})).mean, 1.0);
  expect_error([&] { predicted_balancedness(even, s); }, Status::InvalidArgument, {"3 layers x 3 experts", "1 x 2"});
}

// The examples in configs/placements/ stay valid.
TEST(Placement, ExampleConfigsLoad) {
  const std::filesystem::path dir = std::string(COLIBRI_FIXTURES_DIR) + "/../../configs/placements";
  if (!std::filesystem::exists(dir)) {
    GTEST_SKIP() << "no " << dir;
  }
  int n = 0;
  for (const auto& f : std::filesystem::directory_iterator(dir)) {
    if (f.path().extension() != ".json") continue;
    SCOPED_TRACE(f.path().string());
    auto p = Placement::load(f.path().string());
    if (f.path().filename().string().rfind("tiny-", 0) == 0) {
      EXPECT_NO_THROW(p.check_fits(3, 2, 4));
    }
    ++n;
  }
  EXPECT_GE(n, 2);
}

}  // namespace
}  // namespace colibri
