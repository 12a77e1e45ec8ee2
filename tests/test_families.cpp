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
    EXPECT_FALSE(temp_left(tmp.file("out.colibri")));
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
      if (j > 0) {
        EXPECT_GE(choice[ex[r * K + j - 1]], choice[e]) << "slots not in descending order";
      }
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

// Configs shaped like the published checkpoints' config.json files (written
// from their model cards; older key spellings such as rope_scaling.type, a
// top-level partial_rotary_factor, eos lists, null rope_scaling) parse into
// the structure each model has.
TEST(Families, PublishedConfigsParse) {
  {
    SCOPED_TRACE("DeepSeek-V3 (bf16 conversion)");
    json j = json::parse(R"({"architectures":["DeepseekV3ForCausalLM"],"model_type":"deepseek_v3","vocab_size":129280,
      "hidden_size":7168,"intermediate_size":18432,"moe_intermediate_size":2048,"num_hidden_layers":61,
      "num_attention_heads":128,"num_key_value_heads":128,"n_shared_experts":1,"n_routed_experts":256,
      "routed_scaling_factor":2.5,"kv_lora_rank":512,"q_lora_rank":1536,"qk_rope_head_dim":64,"v_head_dim":128,
      "qk_nope_head_dim":128,"topk_method":"noaux_tc","n_group":8,"topk_group":4,"num_experts_per_tok":8,
      "moe_layer_freq":1,"first_k_dense_replace":3,"norm_topk_prob":true,"scoring_func":"sigmoid",
      "hidden_act":"silu","max_position_embeddings":163840,"rms_norm_eps":1e-6,"tie_word_embeddings":false,
      "rope_theta":10000,"rope_scaling":{"beta_fast":32,"beta_slow":1,"factor":40,"mscale":1.0,
      "mscale_all_dim":1.0,"original_max_position_embeddings":4096,"type":"yarn"},"bos_token_id":0,"eos_token_id":1})");
    ModelConfig c = ModelConfig::from_hf(j);
    EXPECT_EQ(c.architecture, "deepseek_v3");
    EXPECT_EQ(c.num_moe_layers(), 58);
    EXPECT_EQ(c.moe_index(3), 0);
    EXPECT_EQ(c.routing.group_select, "top2_sum");
    EXPECT_EQ(c.routing.n_group, 8);
    EXPECT_EQ(c.shared_intermediate_size, 2048);
    EXPECT_EQ(c.rope_dim, 64);
    EXPECT_TRUE(c.rope_interleaved);
    EXPECT_EQ(c.rope_scaling.type, "yarn");
    EXPECT_DOUBLE_EQ(c.rope_scaling.attention_factor, 1.0);  // mscale == mscale_all_dim
    const double m = 0.1 * std::log(40.0) + 1.0;
    EXPECT_NEAR(c.attn_scale, m * m / std::sqrt(192.0), 1e-12);
    j["quantization_config"] = {{"quant_method", "fp8"}, {"fmt", "e4m3"}};
    expect_error([&] { ModelConfig::from_hf(j); }, Status::Unsupported, {"quantization_config.quant_method", "fp8"});
    // A layer count far past any model is refused at once (found by fuzz_config_json:
    // 666666666666666664 layers made the layer-pattern loop spin), so is a negative one.
    j.erase("quantization_config");
    for (int64_t n : {int64_t{666666666666666664}, int64_t{4097}, int64_t{0}, int64_t{-3}}) {
      j["num_hidden_layers"] = n;
      expect_error([&] { ModelConfig::from_hf(j); }, Status::Format, {"num_hidden_layers", "[1, 4096]"});
    }
  }
  {
    SCOPED_TRACE("DeepSeek-V2-Lite");
    ModelConfig c = ModelConfig::from_hf(json::parse(R"({"architectures":["DeepseekV2ForCausalLM"],
      "attention_bias":false,"bos_token_id":100000,"eos_token_id":100001,"first_k_dense_replace":1,"hidden_act":"silu",
      "hidden_size":2048,"intermediate_size":10944,"kv_lora_rank":512,"max_position_embeddings":163840,
      "model_type":"deepseek_v2","moe_intermediate_size":1408,"moe_layer_freq":1,"n_group":1,"n_routed_experts":64,
      "n_shared_experts":2,"norm_topk_prob":false,"num_attention_heads":16,"num_experts_per_tok":6,
      "num_hidden_layers":27,"num_key_value_heads":16,"q_lora_rank":null,"qk_nope_head_dim":128,"qk_rope_head_dim":64,
      "rms_norm_eps":1e-06,"rope_scaling":{"beta_fast":32,"beta_slow":1,"factor":40,"mscale":0.707,
      "mscale_all_dim":0.707,"original_max_position_embeddings":4096,"type":"yarn"},"rope_theta":10000,
      "routed_scaling_factor":1.0,"scoring_func":"softmax","tie_word_embeddings":false,"topk_group":1,
      "topk_method":"greedy","v_head_dim":128,"vocab_size":102400})"));
    EXPECT_EQ(c.attention, "mla");
    EXPECT_EQ(c.q_lora_rank, 0);
    EXPECT_EQ(c.num_moe_layers(), 26);
    EXPECT_EQ(c.shared_intermediate_size, 2816);
    EXPECT_EQ(c.routing.group_select, "none");
    EXPECT_FALSE(c.routing.norm_topk_prob);
  }
  {
    SCOPED_TRACE("gpt-oss-20b");
    json j = json::parse(R"({"architectures":["GptOssForCausalLM"],"attention_bias":true,"eos_token_id":200002,
      "head_dim":64,"hidden_act":"silu","hidden_size":2880,"initial_context_length":4096,"intermediate_size":2880,
      "max_position_embeddings":131072,"model_type":"gpt_oss","num_attention_heads":64,"num_experts_per_tok":4,
      "num_hidden_layers":24,"num_key_value_heads":8,"num_local_experts":32,"pad_token_id":199999,
      "quantization_config":{"modules_to_not_convert":["model.layers.*.self_attn","model.layers.*.mlp.router",
      "model.embed_tokens","lm_head"],"quant_method":"mxfp4"},"rms_norm_eps":1e-05,"rope_scaling":{"beta_fast":32.0,
      "beta_slow":1.0,"factor":32.0,"original_max_position_embeddings":4096,"rope_type":"yarn","truncate":false},
      "rope_theta":150000,"sliding_window":128,"swiglu_limit":7.0,"tie_word_embeddings":false,"vocab_size":201088})");
    j["layer_types"] = json::array();
    for (int l = 0; l < 24; ++l) j["layer_types"].push_back(l % 2 ? "full_attention" : "sliding_attention");
    ModelConfig c = ModelConfig::from_hf(j);
    EXPECT_EQ(c.window(0), 128);
    EXPECT_EQ(c.window(1), 0);
    EXPECT_TRUE(c.attn_sinks && c.expert_bias && c.routing.router_bias);
    EXPECT_EQ(c.expert_act, "swiglu_oai");
    EXPECT_FALSE(c.rope_scaling.truncate);
    EXPECT_NEAR(c.rope_scaling.attention_factor, 0.1 * std::log(32.0) + 1.0, 1e-12);
    EXPECT_EQ(c.eos_token_id, 200002);
  }
  {
    SCOPED_TRACE("Qwen3-30B-A3B");
    ModelConfig c = ModelConfig::from_hf(json::parse(R"({"architectures":["Qwen3MoeForCausalLM"],"attention_bias":false,
      "bos_token_id":151643,"decoder_sparse_step":1,"eos_token_id":151645,"head_dim":128,"hidden_act":"silu",
      "hidden_size":2048,"intermediate_size":6144,"max_position_embeddings":40960,"max_window_layers":48,
      "mlp_only_layers":[],"model_type":"qwen3_moe","moe_intermediate_size":768,"norm_topk_prob":true,
      "num_attention_heads":32,"num_experts":128,"num_experts_per_tok":8,"num_hidden_layers":48,
      "num_key_value_heads":4,"rms_norm_eps":1e-06,"rope_scaling":null,"rope_theta":1000000.0,"sliding_window":null,
      "tie_word_embeddings":false,"use_sliding_window":false,"vocab_size":151936})"));
    EXPECT_EQ(c.num_experts, 128);
    EXPECT_EQ(c.num_moe_layers(), 48);
    EXPECT_EQ(c.qk_norm, "head");
    EXPECT_EQ(c.head_dim, 128);
    EXPECT_EQ(c.window(7), 0);
  }
  {
    SCOPED_TRACE("Qwen1.5-MoE-A2.7B");
    ModelConfig c = ModelConfig::from_hf(json::parse(R"({"architectures":["Qwen2MoeForCausalLM"],"decoder_sparse_step":1,
      "hidden_size":2048,"intermediate_size":5632,"max_position_embeddings":8192,"max_window_layers":21,
      "model_type":"qwen2_moe","moe_intermediate_size":1408,"norm_topk_prob":false,"num_attention_heads":16,
      "num_experts":60,"num_experts_per_tok":4,"num_hidden_layers":24,"num_key_value_heads":16,"rms_norm_eps":1e-06,
      "rope_theta":1000000.0,"shared_expert_intermediate_size":5632,"sliding_window":32768,"use_sliding_window":false,
      "tie_word_embeddings":false,"vocab_size":151936})"));
    EXPECT_TRUE(c.qkv_bias);  // Qwen2 attention has q/k/v biases unless qkv_bias says otherwise
    EXPECT_TRUE(c.shared_expert_gate);
    EXPECT_EQ(c.shared_intermediate_size, 5632);
    for (int64_t l = 0; l < 24; ++l) EXPECT_EQ(c.window(l), 0);
  }
  {
    SCOPED_TRACE("OLMoE-1B-7B and GLM-4.5-Air");
    ModelConfig o = ModelConfig::from_hf(json::parse(R"({"architectures":["OlmoeForCausalLM"],"attention_bias":false,
      "clip_qkv":null,"eos_token_id":50279,"hidden_act":"silu","hidden_size":2048,"intermediate_size":1024,
      "max_position_embeddings":4096,"model_type":"olmoe","norm_topk_prob":false,"num_attention_heads":16,
      "num_experts":64,"num_experts_per_tok":8,"num_hidden_layers":16,"num_key_value_heads":16,"pad_token_id":1,
      "rms_norm_eps":1e-05,"rope_scaling":null,"rope_theta":10000.0,"tie_word_embeddings":false,"vocab_size":50304})"));
    EXPECT_EQ(o.qk_norm, "full");
    EXPECT_EQ(o.clip_qkv, 0);
    ModelConfig g = ModelConfig::from_hf(json::parse(R"({"architectures":["Glm4MoeForCausalLM"],"attention_bias":true,
      "eos_token_id":[151329,151336,151338],"first_k_dense_replace":1,"head_dim":128,"hidden_act":"silu",
      "hidden_size":4096,"intermediate_size":10944,"max_position_embeddings":131072,"model_type":"glm4_moe",
      "moe_intermediate_size":1408,"n_group":1,"n_routed_experts":128,"n_shared_experts":1,"norm_topk_prob":true,
      "num_attention_heads":96,"num_experts_per_tok":8,"num_hidden_layers":46,"num_key_value_heads":8,
      "num_nextn_predict_layers":1,"partial_rotary_factor":0.5,"rms_norm_eps":1e-05,"rope_scaling":null,
      "rope_theta":1000000,"routed_scaling_factor":1.0,"tie_word_embeddings":false,"topk_group":1,
      "use_qk_norm":false,"vocab_size":151552})"));
    EXPECT_EQ(g.rope_dim, 64);
    EXPECT_TRUE(g.qkv_bias && !g.o_bias);
    EXPECT_EQ(g.routing.scoring, "sigmoid");
    EXPECT_EQ(g.eos_token_id, 151329);
    EXPECT_EQ(g.num_moe_layers(), 45);
  }
}
