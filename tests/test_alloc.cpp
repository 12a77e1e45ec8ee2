// test_alloc.cpp: the hot path allocates nothing (docs/architecture.md): every
// operator new between the end of the second decode step and the end of the
// sixth is counted, and there must be none, on the CPU path for every family
// (greedy and sampled) and, built as test_alloc_emu, on the GPU path through
// the CPU emulator of CUDA (tests/cuda_emu), with CUDA graphs on and off. The
// emulated runtime's own allocations are not counted (emu::runtime_depth):
// the real runtime's are not on the engine's heap.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <new>

#include "tests/fixture.h"

#ifdef COLIBRI_ALLOC_EMU
#include <cuda_runtime.h>  // the emulator's: emu::runtime_depth
#endif

namespace {

std::atomic<bool> g_counting{false};
std::atomic<uint64_t> g_allocs{0};

void note_alloc() {
#ifdef COLIBRI_ALLOC_EMU
  if (emu::runtime_depth > 0) return;
#endif
  if (g_counting.load(std::memory_order_relaxed)) g_allocs.fetch_add(1, std::memory_order_relaxed);
}

void* counted_alloc(size_t n) {
  note_alloc();
  void* p = std::malloc(n ? n : 1);
  if (!p) throw std::bad_alloc();
  return p;
}

void* counted_aligned_alloc(size_t n, std::align_val_t a) {
  note_alloc();
  const size_t al = static_cast<size_t>(a);
  void* p = std::aligned_alloc(al, (n + al - 1) / al * al);
  if (!p) throw std::bad_alloc();
  return p;
}

}  // namespace

void* operator new(size_t n) { return counted_alloc(n); }
void* operator new[](size_t n) { return counted_alloc(n); }
void* operator new(size_t n, std::align_val_t a) { return counted_aligned_alloc(n, a); }
void* operator new[](size_t n, std::align_val_t a) { return counted_aligned_alloc(n, a); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t, std::align_val_t) noexcept { std::free(p); }

using namespace colibri;
using namespace colibri::test;

namespace {

constexpr int kWarmSteps = 2, kCountedSteps = 4;

struct Counted {
  uint64_t allocs = 0;
  int steps = 0;  // decode steps inside the window
};

// Generates with every sequence running kWarmSteps + kCountedSteps decode steps
// past its prefill token, counting allocations from the last token of decode
// step kWarmSteps to the last token of step kWarmSteps + kCountedSteps.
Counted count_decode(const std::string& path, const Fixture& fx, EngineOptions eo, bool sampled) {
  std::vector<Request> reqs = fx.requests();
  const int B = static_cast<int>(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    reqs[i].max_new_tokens = 1 + kWarmSteps + kCountedSteps + 1;
    if (sampled) {
      reqs[i].sampling.temperature = 0.8f;
      reqs[i].sampling.top_k = 20;
      reqs[i].sampling.top_p = 0.9f;
      reqs[i].sampling.seed = 1234 + i;
    }
  }
  auto file = ColibriFile::open(path);
  auto comm = make_local_communicator();
  eo.max_batch = B;
  Engine engine(file, eo, *comm);
  int tokens = 0;
  const int start = B * (1 + kWarmSteps), end = B * (1 + kWarmSteps + kCountedSteps);
  GenerateOptions go;
  go.on_token = [&](int, int, int32_t) {
    ++tokens;
    if (tokens == start) {
      g_allocs = 0;
      g_counting = true;
    } else if (tokens == end) {
      g_counting = false;
    }
    return true;
  };
  const auto out = engine.generate(reqs, go);
  g_counting = false;
  EXPECT_EQ(tokens, B * reqs[0].max_new_tokens) << "the counted window did not happen as planned";
  for (const auto& o : out) EXPECT_EQ(o.tokens.size(), static_cast<size_t>(reqs[0].max_new_tokens));
  return {g_allocs.load(), (end - start) / B};
}

#ifndef COLIBRI_ALLOC_EMU

class AllocCpu : public ::testing::TestWithParam<std::string> {};

TEST_P(AllocCpu, DecodeStepsAllocateNothing) {
  Fixture fx(GetParam());
  TempDir tmp;
  const std::string path = fx.convert(tmp, DType::F32);
  for (bool sampled : {false, true}) {
    const Counted c = count_decode(path, fx, EngineOptions{}, sampled);
    std::printf("%s (%s): %llu allocations in %d decode steps of %zu sequences\n", fx.name.c_str(),
                sampled ? "sampled" : "greedy", static_cast<unsigned long long>(c.allocs), c.steps, fx.prompts.size());
    EXPECT_EQ(c.allocs, 0u) << fx.name << (sampled ? " sampled" : " greedy");
    EXPECT_EQ(c.steps, kCountedSteps);
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, AllocCpu, ::testing::ValuesIn(fixture_names()),
                         [](const auto& info) { return info.param; });

// The counter itself: an allocation inside the window is seen.
TEST(AllocCounter, SeesAnAllocation) {
  g_allocs = 0;
  g_counting = true;
  auto* v = new std::vector<int>(100, 1);
  g_counting = false;
  EXPECT_GE(g_allocs.load(), 2u);  // the vector and its elements
  delete v;
}

#else

// The dense part and the experts on the emulated GPU (the fixtures of each
// attention and routing kind), CUDA graphs on (decode passes replay their
// stretches' graphs) and off (every kernel launched one by one).
class AllocEmulatedGpu : public ::testing::TestWithParam<std::string> {};

TEST_P(AllocEmulatedGpu, DecodeStepsAllocateNothing) {
  ASSERT_TRUE(have_gpu()) << "the emulator has a device";
  Fixture fx(GetParam());
  TempDir tmp;
  const std::string path = fx.convert(tmp, DType::BF16);
  for (const char* graphs : {"1", "0"}) {
    setenv("COLIBRI_CUDA_GRAPHS", graphs, 1);
    EngineOptions eo;
    eo.device = 0;
    eo.store.device = 0;
    const Counted c = count_decode(path, fx, eo, false);
    std::printf("%s (graphs %s): %llu allocations in %d decode steps of %zu sequences\n", fx.name.c_str(), graphs,
                static_cast<unsigned long long>(c.allocs), c.steps, fx.prompts.size());
    EXPECT_EQ(c.allocs, 0u) << fx.name << " graphs " << graphs;
    EXPECT_EQ(c.steps, kCountedSteps);
  }
  unsetenv("COLIBRI_CUDA_GRAPHS");
}

INSTANTIATE_TEST_SUITE_P(Fixtures, AllocEmulatedGpu, ::testing::Values("mixtral_a", "deepseek_v3_a", "qwen2_moe_a"),
                         [](const auto& info) { return info.param; });

#endif

}  // namespace
