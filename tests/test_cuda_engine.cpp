// test_cuda_engine.cpp: the engine with its dense part on a GPU
// (EngineOptions::device, coordinator/backend_cuda.cpp) and its experts on the GPU
// or the CPU, against transformers on the stored fixtures, with the bf16
// tolerances of the CPU engine (test_parity.cpp's Bf16WithinStatedTolerance):
// the GPU holds the matrices in bf16 as a bf16 file does, and rounds the
// activations to bf16 before each product as well. They are compiled only where
// a GPU (or the emulator's) can run them (COLIBRI_GPU_CASES below); where none is
// found at run time they are skipped (and counted so). The refusal without one
// is tested here.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>

#include "model/routing_trace.h"
#include "tests/fixture.h"

using namespace colibri;
using namespace colibri::test;

namespace {



// COLIBRI_GPU_CASES (tests/CMakeLists.txt): the cases that need a GPU are
// compiled where one can run them: in the emulator's binary (colibri_emu_tests,
// cuda.emulated.engine) always, and in colibri_tests only when it is built for a
// GPU (CUDA, COLIBRI_GPU_TESTS). A CPU-only binary would only skip them.
#if COLIBRI_GPU_CASES
// Prompt logits within the CPU bf16 engine's tolerances (median 2e-2, 95% 4e-2)
// and the generated tokens of the right count.
void expect_bf16_parity(const Fixture& fx, const std::vector<SequenceOutput>& out) {
  ASSERT_EQ(out.size(), fx.prompts.size());
  for (size_t i = 0; i < out.size(); ++i) {
    ASSERT_EQ(out[i].tokens.size(), static_cast<size_t>(fx.new_tokens));
    ASSERT_EQ(out[i].logits.size(), (fx.prompts[i].size() + fx.new_tokens - 1) * fx.vocab);
  }
  const auto rel = sorted_prompt_errors(fx, out);
  std::printf("%s: relative L2 median %.2e, p95 %.2e, max %.2e over %zu positions\n", fx.name.c_str(),
              rel[rel.size() / 2], rel[static_cast<size_t>(0.95 * (rel.size() - 1))], rel.back(), rel.size());
  EXPECT_LT(rel[rel.size() / 2], 2e-2);
  EXPECT_LT(rel[static_cast<size_t>(0.95 * (rel.size() - 1))], 4e-2);
}

// The CPU engine's routing on `path` (its own chunking and batch), to replay on
// the GPU: the GPU also rounds the activations to bf16, so where a router's
// top-k gap is below that rounding (qwen2_moe_a: 0.1835 against 0.1834 at one
// position) it may pick another expert than the CPU and the KV cache carries
// the difference on; with the CPU's choices the comparison is of the numerics.
std::shared_ptr<RoutingReplay> cpu_routing(const Fixture& fx, const std::string& path, const TempDir& tmp,
                                           int64_t prefill_chunk) {
  const ModelConfig c = ColibriFile::open(path)->config();
  const std::string trace = tmp.path() + "/cpu_routing.jsonl";
  {
    RoutingTraceWriter w(trace, static_cast<int>(c.num_moe_layers()), static_cast<int>(c.num_experts),
                         static_cast<int>(c.experts_per_token));
    EngineOptions eo;
    eo.trace = &w;
    eo.prefill_chunk = prefill_chunk;
    run_engine(path, fx.requests(), eo);
    w.close();
  }
  return std::make_shared<RoutingReplay>(read_routing_trace(trace));
}

class CudaEngine : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU";
  }
};

#endif  // COLIBRI_GPU_CASES

}  // namespace

#if COLIBRI_GPU_CASES

// Everything on the GPU: dense part and experts (the experts of a bf16 file),
// the MoE rows on the device throughout, with the CPU's routing replayed (see
// cpu_routing; the GPU router itself is checked by the test below and cuda_check).
TEST_P(CudaEngine, AllGpuWithinBf16Tolerance) {
  Fixture fx(GetParam());
  TempDir tmp;
  const std::string path = fx.convert(tmp, DType::BF16);
  EngineOptions eo;
  eo.device = 0;
  eo.store.device = 0;
  eo.prefill_chunk = 3;  // prompts span several passes: the KV cache carries across them
  eo.replay = cpu_routing(fx, path, tmp, eo.prefill_chunk);
  expect_bf16_parity(fx, run_engine(path, fx.requests(), eo));
}

// A 16-bit KV cache on the GPU (--kv-dtype bf16 / f16): grouped attention with
// sinks and a window (gpt-oss) and MLA's latent cache (DeepSeek-V3) stay within
// bf16 tolerance of transformers, the prompts spanning several passes.
TEST(CudaEngineAll, SixteenBitKvCacheWithinBf16Tolerance) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU";
  for (const auto& [name, dt] : {std::pair<const char*, DType>{"gpt_oss_a", DType::F16}, {"deepseek_v3_a", DType::BF16}}) {
    Fixture fx(name);
    TempDir tmp;
    const std::string path = fx.convert(tmp, DType::BF16);
    {
      SCOPED_TRACE(std::string(name) + " " + dtype_name(dt));
      EngineOptions eo;
      eo.device = 0;
      eo.kv_dtype = dt;
      eo.prefill_chunk = 3;
      expect_bf16_parity(fx, run_engine(path, fx.requests(), eo));
    }
  }
}

// The dense part on the GPU, the experts on the CPU (an f32 file: the GPU
// rounds its matrices to bf16 at upload). Every fixture, the quantised included.
TEST(CudaEngineAll, GpuDenseCpuExpertsWithinBf16Tolerance) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU";
  for (const auto& name : fixture_names()) {
    SCOPED_TRACE(name);
    Fixture fx(name);
    TempDir tmp;
    EngineOptions eo;
    eo.device = 0;
    expect_bf16_parity(fx, run_engine(fx.convert(tmp, DType::F32), fx.requests(), eo));
  }
}

// The coordinator on the CPU, the experts on the GPU.
TEST_P(CudaEngine, GpuExpertsWithinBf16Tolerance) {
  Fixture fx(GetParam());
  TempDir tmp;
  EngineOptions eo;
  eo.store.device = 0;
  expect_bf16_parity(fx, run_engine(fx.convert(tmp, DType::BF16), fx.requests(), eo));
}

// Batched decode on the GPU gives each sequence what it gets alone (up to the
// GEMM's choice of algorithm per row count: bf16 tolerance, same tokens).
TEST(CudaEngineAll, BatchAgreesWithSingleSequences) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU";
  Fixture fx("mixtral_a");
  TempDir tmp;
  const std::string path = fx.convert(tmp, DType::BF16);
  EngineOptions eo;
  eo.device = 0;
  eo.store.device = 0;
  const auto reqs = fx.requests();
  const auto batch = run_engine(path, reqs, eo);
  for (size_t i = 0; i < reqs.size(); ++i) {
    const auto one = run_engine(path, {reqs[i]}, eo);
    ASSERT_EQ(one[0].logits.size(), batch[i].logits.size());
    EXPECT_LT(rel_l2(one[0].logits.data(), batch[i].logits.data(), static_cast<int64_t>(one[0].logits.size())), 1e-2)
        << "sequence " << i;
  }
}

// Decode steps replay CUDA graphs of the stretches between MoE layers; with
// COLIBRI_CUDA_GRAPHS=0 every kernel is launched one by one. The same kernels
// with the same arguments: bitwise the same logits and tokens, for the dense
// part alone on the GPU (host MoE rows through the hook) and for all of it.
TEST(CudaEngineAll, GraphsGiveBitwiseTheSameResults) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU";
  for (const char* name : {"mixtral_a", "deepseek_v3_a", "qwen2_moe_a"}) {
    SCOPED_TRACE(name);
    Fixture fx(name);
    TempDir tmp;
    const std::string path = fx.convert(tmp, DType::BF16);
    for (bool experts_on_gpu : {false, true}) {
      EngineOptions eo;
      eo.device = 0;
      if (experts_on_gpu) eo.store.device = 0;
      const auto graphs = run_engine(path, fx.requests(), eo);
      ::setenv("COLIBRI_CUDA_GRAPHS", "0", 1);
      const auto plain = run_engine(path, fx.requests(), eo);
      ::unsetenv("COLIBRI_CUDA_GRAPHS");
      ASSERT_EQ(graphs.size(), plain.size());
      for (size_t i = 0; i < graphs.size(); ++i) {
        EXPECT_EQ(graphs[i].tokens, plain[i].tokens) << "sequence " << i;
        ASSERT_EQ(graphs[i].logits.size(), plain[i].logits.size());
        EXPECT_EQ(0, std::memcmp(graphs[i].logits.data(), plain[i].logits.data(), graphs[i].logits.size() * 4))
            << "sequence " << i << " (experts on the GPU: " << experts_on_gpu << ")";
      }
    }
  }
}

#endif  // COLIBRI_GPU_CASES

// Without a GPU (or without CUDA in the build) the engine refuses at once
// with a clear message and Unsupported: nothing half-built, no crash.
TEST(CudaEngineRefusal, NoGpuIsAClearError) {
  if (have_gpu()) GTEST_SKIP() << "a GPU is present";
  Fixture fx("mixtral_a");
  TempDir tmp;
  const std::string path = fx.convert(tmp, DType::BF16);
  for (int which = 0; which < 2; ++which) {
    EngineOptions eo;
    (which == 0 ? eo.device : eo.store.device) = 0;
    expect_error([&] { run_engine(path, fx.requests(), eo); }, Status::Unsupported,
                 {"--device cuda", "CUDA"});
  }
}

#if COLIBRI_GPU_CASES
INSTANTIATE_TEST_SUITE_P(Fixtures, CudaEngine, ::testing::ValuesIn(unquantised_fixtures()),
                         [](const auto& info) { return info.param; });
#endif
