// test_router_sampling.cpp: Mixtral routing semantics and the sampler.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "coordinator/router.h"
#include "coordinator/sampling.h"
#include "model/error.h"
#include "tests/test_util.h"

using namespace colibri;

TEST(Router, SoftmaxTopKRenormalisedMatchesReference) {
  uint64_t seed = test::test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  RoutingConfig cfg;
  for (int E : {2, 5, 8, 64}) {
    for (int K : {1, 2, std::min(E, 6)}) {
      const int rows = 13;
      auto logits = test::random_floats(rng, rows * E, -4.f, 4.f);
      std::vector<int32_t> ex(rows * K, -1);
      std::vector<float> w(rows * K, NAN);
      route(cfg, logits.data(), rows, E, K, nullptr, ex.data(), w.data());
      for (int r = 0; r < rows; ++r) {
        std::vector<double> p(E);
        double mx = *std::max_element(&logits[r * E], &logits[r * E] + E), s = 0;
        for (int e = 0; e < E; ++e) s += (p[e] = std::exp(logits[r * E + e] - mx));
        std::vector<int> order(E);
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b]; });
        double ksum = 0;
        for (int j = 0; j < K; ++j) ksum += p[order[j]];
        for (int j = 0; j < K; ++j) {
          ASSERT_EQ(ex[r * K + j], order[j]) << "row " << r << " slot " << j;
          ASSERT_NEAR(w[r * K + j], p[order[j]] / ksum, 1e-6);
        }
      }
    }
  }
}

TEST(Router, TopOneWeightIsExactlyOneAndTiesGoToLowerIndex) {
  RoutingConfig cfg;
  const float logits[4] = {0.5f, 2.0f, 2.0f, -1.0f};
  int32_t ex[2];
  float w[2];
  route(cfg, logits, 1, 4, 1, nullptr, ex, w);
  EXPECT_EQ(ex[0], 1);
  EXPECT_EQ(w[0], 1.0f);
  route(cfg, logits, 1, 4, 2, nullptr, ex, w);
  EXPECT_EQ(ex[0], 1);
  EXPECT_EQ(ex[1], 2);
  EXPECT_FLOAT_EQ(w[0], 0.5f);
}

TEST(Sampling, GreedyIsArgmax) {
  uint64_t seed = test::test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 g(seed);
  auto logits = test::random_floats(g, 1000, -5.f, 5.f);
  Sampler s(1000);
  Rng rng(1);
  int32_t best = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  EXPECT_EQ(s.sample(logits.data(), SamplingParams{}, rng), best);
  // top-k 1 and a tiny top-p are greedy too, at any temperature.
  EXPECT_EQ(s.sample(logits.data(), SamplingParams{1.5f, 1, 1.0f, 0}, rng), best);
  EXPECT_EQ(s.sample(logits.data(), SamplingParams{1.5f, 0, 1e-6f, 0}, rng), best);
}

TEST(Sampling, FrequenciesFollowTheDistributionAndTheFilters) {
  const float logits[4] = {std::log(0.5f), std::log(0.3f), std::log(0.15f), std::log(0.05f)};
  Sampler s(4);
  Rng rng(12345);
  const int N = 40000;
  auto freq = [&](SamplingParams p) {
    std::vector<double> c(4, 0);
    for (int i = 0; i < N; ++i) c[s.sample(logits, p, rng)] += 1.0 / N;
    return c;
  };
  auto f = freq({1.0f, 0, 1.0f, 0});
  EXPECT_NEAR(f[0], 0.5, 0.015);
  EXPECT_NEAR(f[1], 0.3, 0.015);
  EXPECT_NEAR(f[2], 0.15, 0.015);
  EXPECT_NEAR(f[3], 0.05, 0.01);
  auto k2 = freq({1.0f, 2, 1.0f, 0});  // renormalised over {0, 1}
  EXPECT_NEAR(k2[0], 0.625, 0.015);
  EXPECT_EQ(k2[2] + k2[3], 0.0);
  auto p = freq({1.0f, 0, 0.75f, 0});  // 0.5 + 0.3 >= 0.75: keeps {0, 1}
  EXPECT_NEAR(p[0], 0.625, 0.015);
  EXPECT_EQ(p[2] + p[3], 0.0);
  auto cold = freq({0.25f, 0, 1.0f, 0});  // sharper: p^4 normalised
  double z = std::pow(0.5, 4) + std::pow(0.3, 4) + std::pow(0.15, 4) + std::pow(0.05, 4);
  EXPECT_NEAR(cold[0], std::pow(0.5, 4) / z, 0.015);
}

TEST(Sampling, SeededStreamsAreReproducible) {
  uint64_t seed = test::test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 g(seed);
  auto logits = test::random_floats(g, 500, -2.f, 2.f);
  Sampler s(500);
  auto draw = [&](uint64_t sd) {
    Rng rng(sd);
    std::vector<int32_t> v;
    for (int i = 0; i < 64; ++i) v.push_back(s.sample(logits.data(), {0.9f, 50, 0.95f, sd}, rng));
    return v;
  };
  EXPECT_EQ(draw(7), draw(7));
  EXPECT_NE(draw(7), draw(8));
}

TEST(Sampling, RejectsNonsensicalParameters) {
  auto bad = [](SamplingParams p, const char* needle) {
    try {
      validate_sampling(p, 100);
      ADD_FAILURE() << "accepted " << needle;
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), Status::InvalidArgument);
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  bad({-1.f, 0, 1.f, 0}, "temperature");
  bad({NAN, 0, 1.f, 0}, "temperature");
  bad({1.f, -2, 1.f, 0}, "top-k");
  bad({1.f, 101, 1.f, 0}, "top-k");
  bad({1.f, 0, 0.f, 0}, "top-p");
  bad({1.f, 0, 1.5f, 0}, "top-p");
  EXPECT_NO_THROW(validate_sampling({0.7f, 40, 0.9f, 3}, 100));
}
