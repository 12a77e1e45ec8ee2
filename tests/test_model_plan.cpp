// test_model_plan.cpp: the per-layer plan (coordinator/model_plan.h) that the
// one model definition runs on both backends: each family's features resolved
// to the right enums from its config and tensors, and a file whose tensors
// contradict its config refused.
#include <gtest/gtest.h>

#include <fstream>
#include <iterator>

#include "coordinator/model_plan.h"
#include "tests/file_edit.h"
#include "tests/fixture.h"

using namespace colibri;
using namespace colibri::test;

namespace {

ModelPlan plan_of(const std::string& name, const TempDir& tmp) {
  Fixture fx(name);
  return ModelPlan::of(*ColibriFile::open(fx.convert(tmp, DType::F32)));
}

}  // namespace

TEST(ModelPlan, EachFamilyResolvesToItsFeatures) {
  TempDir tmp;
  {
    const ModelPlan p = plan_of("mixtral_a", tmp);
    ASSERT_EQ(p.layer.size(), 2u);
    for (const LayerPlan& L : p.layer) {
      EXPECT_EQ(L.attention, AttentionKind::Grouped);
      EXPECT_EQ(L.qk_norm, QkNorm::None);
      EXPECT_FALSE(L.bias_q || L.bias_o || L.sinks);
      EXPECT_EQ(L.ffn, FeedForwardKind::Moe);
      EXPECT_EQ(L.shared, SharedExpert::None);
    }
    EXPECT_EQ(p.route.scoring, RouteScoring::Softmax);
    EXPECT_EQ(p.route.groups, RouteGroups::None);
    EXPECT_EQ(p.v_width, p.kv_width);
  }
  {
    // Qwen2-MoE: q/k/v biases, a gated shared expert, layer 1 a dense MLP (mlp_only_layers).
    const ModelPlan p = plan_of("qwen2_moe_a", tmp);
    ASSERT_EQ(p.layer.size(), 3u);
    EXPECT_TRUE(p.layer[0].bias_q && p.layer[0].bias_k && p.layer[0].bias_v);
    EXPECT_EQ(p.layer[0].shared, SharedExpert::Gated);
    EXPECT_EQ(p.layer[1].ffn, FeedForwardKind::Dense);
    EXPECT_EQ(p.layer[1].moe, -1);
    EXPECT_EQ(p.layer[2].moe, 1);
    EXPECT_TRUE(p.any_dense);
  }
  EXPECT_EQ(plan_of("qwen3_moe_a", tmp).layer[0].qk_norm, QkNorm::PerHead);
  EXPECT_EQ(plan_of("olmoe_a", tmp).layer[0].qk_norm, QkNorm::Full);
  {
    // DeepSeek-V3: latent attention with low-rank queries, layer 0 dense, a plain
    // shared expert, sigmoid scoring with a score bias and groups.
    const ModelPlan p = plan_of("deepseek_v3_a", tmp);
    EXPECT_EQ(p.layer[0].attention, AttentionKind::Latent);
    EXPECT_TRUE(p.layer[0].q_lora);
    EXPECT_EQ(p.layer[0].ffn, FeedForwardKind::Dense);
    EXPECT_EQ(p.layer[1].shared, SharedExpert::Plain);
    EXPECT_TRUE(p.layer[1].score_bias);
    EXPECT_EQ(p.route.scoring, RouteScoring::Sigmoid);
    EXPECT_NE(p.route.groups, RouteGroups::None);
    EXPECT_EQ(p.v_width, 0);
    EXPECT_EQ(p.kv_width, p.kv_lora_rank + p.rope_dim);
  }
  EXPECT_FALSE(plan_of("deepseek_v2_a", tmp).layer[1].q_lora);
  {
    // gpt-oss: sinks, a sliding window on layer 0 only, biases, the router's bias.
    const ModelPlan p = plan_of("gpt_oss_a", tmp);
    EXPECT_TRUE(p.layer[0].sinks && p.layer[1].sinks);
    EXPECT_EQ(p.layer[0].window, 4);
    EXPECT_EQ(p.layer[1].window, 0);
    EXPECT_TRUE(p.layer[0].bias_q && p.layer[0].bias_o);
    EXPECT_TRUE(p.layer[0].router_bias);
    EXPECT_EQ(p.route.scoring, RouteScoring::TopkSoftmax);
  }
}

// A file whose tensors contradict each other (a per-head q norm without its k
// norm: the name of blk.0.attn_k_norm changed, the checksum resealed) is refused
// with a Format error naming what is missing, whether the file's own checks or
// the plan find it first.
TEST(ModelPlan, AQNormWithoutItsKNormIsRefused) {
  Fixture fx("qwen3_moe_a");
  TempDir tmp;
  const std::string path = fx.convert(tmp, DType::F32);
  std::string b;
  {
    std::ifstream in(path, std::ios::binary);
    b.assign(std::istreambuf_iterator<char>(in), {});
  }
  const size_t p = b.find("blk.0.attn_k_norm");
  ASSERT_NE(p, std::string::npos);
  b.replace(p, 17, "blk.0.attn_k_nrm_");
  reseal(b);
  const std::string bad = tmp.file("bad.colibri");
  {
    std::ofstream out(bad, std::ios::binary);
    out.write(b.data(), static_cast<std::streamsize>(b.size()));
  }
  try {
    auto f = ColibriFile::open(bad);
    (void)ModelPlan::of(*f);
    FAIL() << "a q norm without its k norm was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::Format) << e.what();
    const std::string m = e.what();
    EXPECT_TRUE(m.find("k_norm") != std::string::npos || m.find("k norm") != std::string::npos) << m;
    std::printf("refused: %s\n", e.what());
  }
}
