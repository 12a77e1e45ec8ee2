// test_families.cpp: what the families beyond Mixtral add, beyond the parity
// tests: refusing what the engine does not implement (naming the field), the
// routing variants' rules, MLA's compressed cache, dense layers outside the
// expert index, and MXFP4 checkpoints that do not fit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <numeric>
#include <random>

#include "coordinator/router.h"
#include "tests/cli_runner.h"
#include "tests/fixture.h"

using namespace colibri;
using namespace colibri::test;
using nlohmann::json;

namespace {

// A copy of a fixture's hf/ directory whose config.json was edited by `edit`.
std::string edited_checkpoint(const TempDir& tmp, const std::string& fixture, const std::function<void(json&)>& edit) {
  const std::string src = fixtures_dir() + "/" + fixture + "/hf", dst = tmp.file(fixture + "-edited");
  std::filesystem::create_directories(dst);
  std::filesystem::copy_file(src + "/model.safetensors", dst + "/model.safetensors");
  std::ifstream in(src + "/config.json");
  json j = json::parse(in);
  edit(j);
  std::ofstream(dst + "/config.json") << j.dump(2);
  return dst;
}

}  // namespace

// Configurations the engine does not implement are refused at conversion,
// with a message naming the field, exit code Unsupported (or Format for a
// malformed value), and no output file.
TEST(Families, UnsupportedConfigurationsAreRefusedNamingTheField) {
  struct Case {
    const char* what;
    const char* fixture;
    std::function<void(json&)> edit;
    Status status;
    std::vector<std::string> needles;
  };
  const std::vector<Case> cases = {
      {"unknown architecture", "qwen3_moe_a", [](json& j) { j["architectures"] = {"Qwen3NextForCausalLM"}; },
       Status::Unsupported, {"'architectures'", "Qwen3NextForCausalLM", "DeepseekV3ForCausalLM", "GptOssForCausalLM"}},
      {"rope type dynamic", "deepseek_v3_a", [](json& j) { j["rope_parameters"]["rope_type"] = "dynamic"; },
       Status::Unsupported, {"rope_type", "'dynamic'", "supported: default, yarn"}},
      {"rope scaling longrope (old key)", "mixtral_a",
       [](json& j) { j["rope_scaling"] = {{"type", "longrope"}, {"factor", 2.0}}; }, Status::Unsupported,
       {"rope_scaling.type", "'longrope'"}},
      {"V2 topk_method noaux_tc", "deepseek_v2_a", [](json& j) { j["topk_method"] = "noaux_tc"; }, Status::Unsupported,
       {"'topk_method'", "'noaux_tc'", "greedy, group_limited_greedy"}},
      {"V3 softmax scoring", "deepseek_v3_a", [](json& j) { j["scoring_func"] = "softmax"; }, Status::Unsupported,
       {"'scoring_func'", "'softmax'"}},
      {"fp8 checkpoint", "deepseek_v3_a",
       [](json& j) { j["quantization_config"] = {{"quant_method", "fp8"}, {"weight_block_size", {128, 128}}}; },
       Status::Unsupported, {"quantization_config.quant_method", "'fp8'"}},
      {"MLA with attention bias", "deepseek_v2_b", [](json& j) { j["attention_bias"] = true; }, Status::Unsupported,
       {"'attention_bias'"}},
      {"MoE every other layer", "deepseek_v3_b", [](json& j) { j["moe_layer_freq"] = 2; }, Status::Unsupported,
       {"'moe_layer_freq'"}},
      {"gelu experts", "olmoe_a", [](json& j) { j["hidden_act"] = "gelu"; }, Status::Unsupported, {"'hidden_act'", "gelu"}},
      {"chunked attention layer", "gpt_oss_a", [](json& j) { j["layer_types"][0] = "chunked_attention"; },
       Status::Unsupported, {"'layer_types'", "chunked_attention"}},
      {"layer_types of the wrong length", "gpt_oss_b", [](json& j) { j["layer_types"].erase(0); }, Status::Format,
       {"'layer_types' has"}},
      {"sliding window on GLM", "glm4_moe_a",
       [](json& j) {
         j["sliding_window"] = 4;
         j["use_sliding_window"] = true;
       },
       Status::Unsupported, {"'sliding_window'"}},
      {"groups that do not divide the experts", "deepseek_v3_a", [](json& j) { j["n_group"] = 3; }, Status::Format,
       {"num_experts is not a multiple of routing.n_group"}},
      {"bad partial rotary factor", "glm4_moe_b", [](json& j) { j["rope_parameters"]["partial_rotary_factor"] = 1.5; },
       Status::Format, {"'partial_rotary_factor'"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    TempDir tmp;
    const std::string dir = edited_checkpoint(tmp, c.fixture, c.edit);
    auto r = run_cli(tmp, {"convert", dir, tmp.file("out.colibri")});
    EXPECT_TRUE(r.exited);
    EXPECT_EQ(r.code, exit_code(c.status)) << r.err;
    for (const auto& n : c.needles) EXPECT_NE(r.err.find(n), std::string::npos) << "'" << n << "' not in: " << r.err;
    EXPECT_FALSE(std::filesystem::exists(tmp.file("out.colibri")));
    EXPECT_FALSE(std::filesystem::exists(tmp.file("out.colibri.tmp")));
  }
}

// Sigmoid routing with a correction bias and groups (DeepSeek-V3 / GLM-4.5),
// checked rule by rule on random scores.
TEST(Families, GroupedSigmoidRoutingFollowsItsRules) {
  const uint64_t seed = test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  RoutingConfig cfg;
  cfg.scoring = "sigmoid";
  cfg.group_select = "top2_sum";
  cfg.n_group = 4;
  cfg.topk_group = 2;
  cfg.score_bias = true;
  cfg.norm_topk_prob = true;
  cfg.routed_scaling_factor = 2.5f;
  const int64_t E = 16, K = 4, rows = 200, per = E / cfg.n_group;
  auto logits = random_floats(rng, rows * E, -3.f, 3.f);
  auto bias = random_floats(rng, E, -0.3f, 0.3f);
  std::vector<int32_t> ex(rows * K);
  std::vector<float> w(rows * K);
  route(cfg, logits.data(), rows, E, K, bias.data(), ex.data(), w.data());
  int bias_changed = 0;
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<float> p(E), choice(E);
    for (int64_t e = 0; e < E; ++e) {
      p[e] = 1.0f / (1.0f + std::exp(-logits[r * E + e]));
      choice[e] = p[e] + bias[e];
    }
    // The kept groups: the two with the largest sum of their two best choices.
    std::vector<float> gs(cfg.n_group);
    for (int64_t g = 0; g < cfg.n_group; ++g) {
      std::vector<float> v(choice.begin() + g * per, choice.begin() + (g + 1) * per);
      std::sort(v.rbegin(), v.rend());
      gs[g] = v[0] + v[1];
    }
    std::vector<int> order(cfg.n_group);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int a, int b) { return gs[a] > gs[b]; });
    float sum = 0;
    for (int64_t j = 0; j < K; ++j) {
      const int32_t e = ex[r * K + j];
      const int g = e / per;
      EXPECT_TRUE(g == order[0] || g == order[1]) << "row " << r << ": expert " << e << " outside the kept groups";
      if (j > 0) EXPECT_GE(choice[ex[r * K + j - 1]], choice[e]) << "slots not in descending order";
      sum += p[e];
    }
    // Every allowed expert not chosen scores no higher than the k-th choice.
    for (int64_t e = 0; e < E; ++e) {
      const int g = static_cast<int>(e / per);
      if ((g != order[0] && g != order[1]) || std::count(ex.begin() + r * K, ex.begin() + (r + 1) * K, e)) continue;
      EXPECT_LE(choice[e], choice[ex[r * K + K - 1]]);
    }
    // Weights from the unbiased scores, renormalised, then scaled.
    for (int64_t j = 0; j < K; ++j)
      EXPECT_NEAR(w[r * K + j], p[ex[r * K + j]] / (sum + 1e-20f) * 2.5f, 1e-6f);
    // The bias matters for selection: without it some rows choose differently.
    std::vector<int32_t> ex0(K);
    std::vector<float> w0(K);
    route(cfg, logits.data() + r * E, 1, E, K, nullptr, ex0.data(), w0.data());
    bias_changed += !std::equal(ex0.begin(), ex0.end(), ex.begin() + r * K);
  }
  EXPECT_GT(bias_changed, 0);
}

// gpt-oss: top-k of the raw logits, softmax over those k only.
TEST(Families, TopkThenSoftmaxRouting) {
  RoutingConfig cfg;
  cfg.scoring = "topk_softmax";
  cfg.norm_topk_prob = false;
  const float logits[6] = {0.5f, 2.0f, -1.0f, 1.0f, 3.0f, 0.0f};
  int32_t ex[3];
  float w[3];
  route(cfg, logits, 1, 6, 3, nullptr, ex, w);
  EXPECT_EQ(ex[0], 4);
  EXPECT_EQ(ex[1], 1);
  EXPECT_EQ(ex[2], 3);
  const float z = std::exp(3.f) + std::exp(2.f) + std::exp(1.f);
  EXPECT_NEAR(w[0], std::exp(3.f) / z, 1e-6f);
  EXPECT_NEAR(w[1], std::exp(2.f) / z, 1e-6f);
  EXPECT_NEAR(w[2], std::exp(1.f) / z, 1e-6f);
}

// DeepSeek-V2 group-limited greedy: groups ranked by their best expert.
TEST(Families, GroupMaxRoutingKeepsTheBestGroups) {
  RoutingConfig cfg;
  cfg.scoring = "softmax";
  cfg.group_select = "max";
  cfg.n_group = 3;
  cfg.topk_group = 1;
  cfg.norm_topk_prob = false;
  cfg.routed_scaling_factor = 2.0f;
  // Group 0 = {0,1}: best 1.0; group 1 = {2,3}: 0.9, 0.8 (the best sum); group 2 = {4,5}: 2.0 (the best max).
  const float logits[6] = {1.0f, -5.0f, 0.9f, 0.8f, 2.0f, -5.0f};
  int32_t ex[2];
  float w[2];
  route(cfg, logits, 1, 6, 2, nullptr, ex, w);
  EXPECT_EQ(ex[0], 4);
  EXPECT_EQ(ex[1], 5);  // the only other expert of the kept group, however low
  float z = 0;
  for (float l : logits) z += std::exp(l);
  EXPECT_NEAR(w[0], 2.0f * std::exp(2.0f) / z, 1e-6f);
  EXPECT_NEAR(w[1], 2.0f * std::exp(-5.0f) / z, 1e-7f);
}

// Multi-head latent attention caches the normalised latent and the rotary key
// (kv_lora_rank + qk_rope_head_dim floats per position and layer), not every
// head's K and V; dense layers have no experts in the file or the placement.
TEST(Families, MlaCachesTheLatentAndDenseLayersHaveNoExperts) {
  Fixture fx("deepseek_v3_a");
  TempDir tmp;
  auto file = ColibriFile::open(fx.convert(tmp, DType::F32));
  const ModelConfig& c = file->config();
  ASSERT_EQ(c.attention, "mla");
  EngineOptions eo;
  eo.max_batch = 2;
  eo.max_context = 64;
  auto comm = make_local_communicator();
  Engine engine(file, eo, *comm);
  const uint64_t latent = static_cast<uint64_t>(c.num_layers * 2 * 64 * (c.kv_lora_rank + c.qk_rope_head_dim)) * 4;
  const uint64_t full = static_cast<uint64_t>(c.num_layers * 2 * 64 * c.num_heads * (c.head_dim + c.v_head_dim)) * 4;
  EXPECT_EQ(engine.kv_cache_bytes(), latent);
  EXPECT_LT(engine.kv_cache_bytes() * 3, full);
  ASSERT_LT(c.num_moe_layers(), c.num_layers);  // this fixture starts with a dense layer
  EXPECT_EQ(c.moe_index(0), -1);
  EXPECT_EQ(file->experts().size(), static_cast<size_t>(c.num_moe_layers() * c.num_experts));
  EXPECT_EQ(engine.placement().num_layers(), c.num_moe_layers());
  EXPECT_TRUE(file->find("blk.0.ffn_gate") && !file->find("blk.0.ffn_gate_inp"));
  EXPECT_TRUE(file->find("blk.1.ffn_gate_inp") && file->find("blk.1.exp_probs_b") && file->find("blk.1.ffn_gate_shexp"));
}

// A gpt-oss MXFP4 checkpoint whose packed tensors do not match the config is
// refused naming the tensor; nothing is written.
TEST(Families, MalformedMxfp4TensorsAreRefused) {
  TempDir tmp;
  const std::string dir = edited_checkpoint(tmp, "gpt_oss_mxfp4", [](json& j) {
    j["intermediate_size"] = j["intermediate_size"].get<int64_t>() * 2;  // the stored blocks are now too small
  });
  auto r = run_cli(tmp, {"convert", dir, tmp.file("out.colibri")});
  EXPECT_TRUE(r.exited);
  EXPECT_EQ(r.code, exit_code(Status::Format)) << r.err;
  EXPECT_NE(r.err.find("gate_up_proj_blocks' has shape"), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(tmp.file("out.colibri")));
}
