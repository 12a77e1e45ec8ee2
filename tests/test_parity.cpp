// test_parity.cpp: the engine against Hugging Face transformers on the stored
// fixtures (tiny random Mixtral models saved by scripts/make_fixtures.py).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "kernels/cpu/kernels.h"
#include "tests/fixture.h"

using namespace colibri;
using namespace colibri::test;

namespace {

struct ParityResult {
  double max_prompt_rel = 0, max_decode_rel = 0;
  int token_mismatches = 0, top1_mismatches = 0, positions = 0;
};

ParityResult check_fixture(const Fixture& fx, const std::string& path) {
  auto out = run_engine(path, fx.requests());
  ParityResult r;
  const int64_t V = fx.vocab;
  for (size_t i = 0; i < fx.prompts.size(); ++i) {
    const size_t L = fx.prompts[i].size();
    EXPECT_EQ(out[i].tokens.size(), static_cast<size_t>(fx.new_tokens));
    // Logits rows: L prompt positions, then one per generated token but the last.
    EXPECT_EQ(out[i].logits.size(), (L + fx.new_tokens - 1) * V);
    for (size_t p = 0; p < L; ++p) {
      const float* ours = out[i].logits.data() + p * V;
      const float* ref = fx.prompt_logits[i].data() + p * V;
      r.max_prompt_rel = std::max(r.max_prompt_rel, rel_l2(ours, ref, V));
      r.top1_mismatches += argmax(ours, V) != argmax(ref, V);
      ++r.positions;
    }
    for (int s = 0; s < fx.new_tokens; ++s) {
      // greedy_logits[s] is the reference's last-position logits after s new tokens.
      const float* ours = out[i].logits.data() + (L - 1 + s) * V;
      const float* ref = fx.greedy_logits[i].data() + s * V;
      r.max_decode_rel = std::max(r.max_decode_rel, rel_l2(ours, ref, V));
      if (s < static_cast<int>(out[i].tokens.size())) r.token_mismatches += out[i].tokens[s] != fx.greedy[i][s];
    }
  }
  return r;
}

class Parity : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {
 protected:
  void SetUp() override {
    // "default": the kernels this CPU runs by default (kernels::default_kernels).
    const std::string isa = std::get<1>(GetParam()) == "default" ? std::string(kernels::default_kernels().name)
                                                                 : std::get<1>(GetParam());
    if (isa == "avx2" && !kernels::cpu_has_avx2()) GTEST_SKIP() << "CPU lacks AVX2/FMA/F16C";
    if (isa == "avx512" && !kernels::cpu_has_avx512()) GTEST_SKIP() << "CPU lacks AVX-512 F/BW/VL/DQ";
    ASSERT_TRUE(kernels::select(isa.c_str()));
  }
  void TearDown() override { kernels::select(kernels::default_kernels().name); }
};
// The bf16 and f16 storage variants run on the default kernels only: every ISA's
// kernels are checked against transformers by the f32 test above (and against
// the scalar reference for every dtype by test_kernels.cpp).
class ParityStorage : public Parity {};

}  // namespace

// f32 storage: logits within 1e-5 relative L2 of transformers at every prompt
// position and every decode step, and the 16 greedy tokens identical.
TEST_P(Parity, F32MatchesTransformers) {
  Fixture fx(std::get<0>(GetParam()));
  TempDir tmp;
  auto r = check_fixture(fx, fx.convert(tmp, DType::F32));
  RecordProperty("max_prompt_rel_l2", std::to_string(r.max_prompt_rel));
  std::printf("%s: max relative L2, prompt %.2e, decode %.2e over %d positions\n", fx.name.c_str(), r.max_prompt_rel,
              r.max_decode_rel, r.positions);
  EXPECT_LT(r.max_prompt_rel, 1e-5);
  EXPECT_LT(r.max_decode_rel, 1e-5);
  EXPECT_EQ(r.token_mismatches, 0);
  EXPECT_EQ(r.top1_mismatches, 0);
}

// bf16 storage, against transformers' f32 logits. Rounding every weight to
// 8 significant bits (relative error up to 2^-9) moves the logits by about 1%
// (measured: 3e-3 to 2e-2 per position). Where the router's top-k gap is smaller
// than that perturbation (these fixtures have gaps down to 1e-4) the selected
// expert changes and that position's output changes wholesale (measured once:
// 0.86 at the last position of mixtral_b prompt 2, top-1 routing). So: the median
// position within 2e-2, at least 95% of positions within 4e-2. A wrong layout or
// a dropped term gives errors of order 1 at every position.
TEST_P(ParityStorage, Bf16WithinStatedTolerance) {
  Fixture fx(std::get<0>(GetParam()));
  TempDir tmp;
  const auto rel = sorted_prompt_errors(fx, run_engine(fx.convert(tmp, DType::BF16), fx.requests()));
  EXPECT_LT(rel[rel.size() / 2], 2e-2);
  EXPECT_LT(rel[static_cast<size_t>(0.95 * (rel.size() - 1))], 4e-2);
}

// The bf16 path computes exactly what it should: the engine on a bf16 file
// equals the engine on an f32 file holding the same bf16-rounded weights (to f32
// accumulation-order noise), at every position, with identical greedy tokens.
// (Not for gpt_oss_mxfp4: its experts are U8 MXFP4 blocks, with no f32 copy
// to round; they are exact in bf16 once dequantised.)
class ParityRounded : public Parity {};
TEST_P(ParityRounded, Bf16EqualsF32OnRoundedWeights) {
  Fixture fx(std::get<0>(GetParam()));
  TempDir tmp;
  // Write a copy of the checkpoint with every matrix rounded through bf16.
  std::filesystem::create_directories(tmp.file("rounded"));
  std::filesystem::copy_file(fx.dir + "/hf/config.json", tmp.file("rounded/config.json"));
  {
    SafetensorsFile src(fx.dir + "/hf/model.safetensors");
    std::vector<SafetensorsWriter::Spec> specs;
    for (const auto& t : src.tensors()) specs.push_back({t.name, DType::F32, t.shape});
    SafetensorsWriter w(tmp.file("rounded/model.safetensors"), specs);
    for (const auto& t : src.tensors()) {
      std::vector<float> v(static_cast<size_t>(t.numel()));
      std::memcpy(v.data(), t.data, t.nbytes);
      // Matrices only: norms, biases (gpt-oss experts' [E, 2I] biases too) and
      // Qwen2-MoE's [1, H] shared-expert gate stay f32 in a bf16 file.
      const bool f32_kept = t.name.size() >= 4 && (t.name.compare(t.name.size() - 4, 4, "bias") == 0 ||
                                                   t.name.find("shared_expert_gate") != std::string::npos);
      if (t.shape.size() >= 2 && !f32_kept)
        for (auto& x : v) x = bf16_to_f32(f32_to_bf16(x));
      w.write_next(v.data(), t.nbytes);
    }
    w.finish();
  }
  std::string rounded = tmp.file("rounded.colibri");
  ConvertOptions co;
  co.dtype = DType::F32;
  convert_checkpoint(tmp.file("rounded"), rounded, co);
  auto a = run_engine(fx.convert(tmp, DType::BF16), fx.requests());
  auto b = run_engine(rounded, fx.requests());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].tokens, b[i].tokens);
    ASSERT_EQ(a[i].logits.size(), b[i].logits.size());
    for (size_t p = 0; p < a[i].logits.size() / fx.vocab; ++p)
      ASSERT_LT(rel_l2(a[i].logits.data() + p * fx.vocab, b[i].logits.data() + p * fx.vocab, fx.vocab), 1e-5)
          << "sequence " << i << " position " << p;
  }
}

// f16 keeps 11 significant bits (2^-12 relative rounding): 8x tighter than
// bf16. Positions are within 5e-3 (measured 1e-4..2e-3) except where a routing
// decision with a gap below the rounding flips: once in these fixtures
// (qwen2_moe_b, prompt 2 position 1, MoE layer 1, gap ~1e-4: 4.7e-2 there).
// So: 95% of positions within 5e-3, none above 0.1, top-1 identical everywhere.
TEST_P(ParityStorage, F16WithinStatedTolerance) {
  Fixture fx(std::get<0>(GetParam()));
  TempDir tmp;
  auto out = run_engine(fx.convert(tmp, DType::F16), fx.requests());
  std::vector<double> rel;
  int top1 = 0;
  for (size_t i = 0; i < fx.prompts.size(); ++i)
    for (size_t p = 0; p < fx.prompts[i].size(); ++p) {
      const float* ours = out[i].logits.data() + p * fx.vocab;
      const float* ref = fx.prompt_logits[i].data() + p * fx.vocab;
      rel.push_back(rel_l2(ours, ref, fx.vocab));
      top1 += argmax(ours, fx.vocab) != argmax(ref, fx.vocab);
    }
  std::sort(rel.begin(), rel.end());
  EXPECT_LT(rel[static_cast<size_t>(0.95 * (rel.size() - 1))], 5e-3);
  EXPECT_LT(rel.back(), 0.1);
  EXPECT_EQ(top1, 0);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ParityRounded,
                         ::testing::Combine(::testing::ValuesIn(unquantised_fixtures()), ::testing::Values("default")),
                         [](const auto& info) { return std::get<0>(info.param) + "_" + std::get<1>(info.param); });
INSTANTIATE_TEST_SUITE_P(Fixtures, ParityStorage,
                         ::testing::Combine(::testing::ValuesIn(fixture_names()), ::testing::Values("default")),
                         [](const auto& info) { return std::get<0>(info.param) + "_" + std::get<1>(info.param); });
INSTANTIATE_TEST_SUITE_P(Fixtures, Parity,
                         ::testing::Combine(::testing::ValuesIn(fixture_names()), ::testing::Values("avx512", "avx2", "generic")),
                         [](const auto& info) { return std::get<0>(info.param) + "_" + std::get<1>(info.param); });
