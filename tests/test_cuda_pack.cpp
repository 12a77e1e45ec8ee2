// test_cuda_pack.cpp: packing an FFN's host weights into the GPU layout
// (kernels/cuda/ffn_pack.h). Host code: runs without a GPU. The kernels
// themselves are checked by tests/cuda_check.cu (ctest cuda.check) on a GPU.
#include <cublasLt.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <string>
#include <random>
#include <vector>

#include "kernels/cuda/ffn_pack.h"
#include "model/dtype.h"
#include "model/error.h"
#include "tests/test_util.h"

namespace colibri {
namespace {

using test::expect_error;

TEST(CudaPack, LayoutIsAlignedAndHoldsEveryPart) {
  FfnShape s = FfnShape::silu(40, 24);
  for (bool biases : {false, true}) {
    const auto l = cuda::PackedFfnLayout::of(s, biases);
    for (size_t off : {l.gate_up, l.down, l.gate_bias, l.up_bias, l.down_bias}) EXPECT_EQ(off % 256, 0u);
    EXPECT_GE(l.down, l.gate_up + 2 * 24 * 40 * 2);
    if (biases) {
      EXPECT_GE(l.gate_bias, l.down + 40 * 24 * 2);
      EXPECT_GE(l.up_bias, l.gate_bias + 24 * 4);
      EXPECT_GE(l.down_bias, l.up_bias + 24 * 4);
      EXPECT_GE(l.bytes, l.down_bias + 40 * 4);
    } else {
      EXPECT_GE(l.bytes, l.down + 40 * 24 * 2);
    }
    EXPECT_EQ(l.bytes % 256, 0u);
  }
  expect_error([] { cuda::PackedFfnLayout::of(cuda::FfnShape{}, false); }, Status::InvalidArgument, {"positive"});
}

TEST(CudaPack, EveryWeightIsItsBf16RoundingInPlace) {
  const uint64_t seed = std::random_device{}();
  std::printf("seed %llu\n", (unsigned long long)seed);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  const int64_t H = 48, I = 40;
  FfnShape s = FfnShape::silu(H, I);
  std::vector<float> gate(I * H), up(I * H), down(H * I), gb(I), db(H);
  for (auto* v : {&gate, &up, &down, &gb, &db})
    for (auto& x : *v) x = d(rng);
  for (DType dt : {DType::F32, DType::F16, DType::BF16}) {
    // The same values stored as dt: the packed bf16 must be dt's value rounded to bf16.
    std::vector<char> g2(gate.size() * 4), u2(up.size() * 4), d2(down.size() * 4);
    convert_elements(gate.data(), DType::F32, g2.data(), dt, gate.size());
    convert_elements(up.data(), DType::F32, u2.data(), dt, up.size());
    convert_elements(down.data(), DType::F32, d2.data(), dt, down.size());
    FfnWeights w;
    w.dtype = dt, w.gate = g2.data(), w.up = u2.data(), w.down = d2.data(), w.gate_bias = gb.data(), w.down_bias = db.data();
    const auto l = cuda::PackedFfnLayout::of(s, true);
    std::vector<char> block(l.bytes, 0x5a);
    cuda::pack_ffn(w, s, l, block.data());
    auto expect_matrix = [&](size_t off, const std::vector<char>& src, size_t n, const char* what) {
      std::vector<float> f(n);
      convert_elements(src.data(), dt, f.data(), DType::F32, n);
      const uint16_t* p = reinterpret_cast<const uint16_t*>(block.data() + off);
      size_t bad = 0;
      for (size_t i = 0; i < n; ++i) bad += p[i] != f32_to_bf16(f[i]);
      EXPECT_EQ(bad, 0u) << what << " from " << dtype_name(dt);
    };
    expect_matrix(l.gate_up, g2, gate.size(), "gate");
    expect_matrix(l.gate_up + gate.size() * 2, u2, up.size(), "up");
    expect_matrix(l.down, d2, down.size(), "down");
    const float* pgb = reinterpret_cast<const float*>(block.data() + l.gate_bias);
    const float* pub = reinterpret_cast<const float*>(block.data() + l.up_bias);
    const float* pdb = reinterpret_cast<const float*>(block.data() + l.down_bias);
    for (int64_t i = 0; i < I; ++i) {
      EXPECT_EQ(pgb[i], gb[i]);
      EXPECT_EQ(pub[i], 0.0f);  // no up bias: zeros
    }
    for (int64_t i = 0; i < H; ++i) EXPECT_EQ(pdb[i], db[i]);
  }
}

TEST(CudaPack, RefusesWhatTheGpuFfnCannotTake) {
  FfnShape s = FfnShape::silu(32, 32);
  std::vector<float> m(32 * 32, 1.0f), b(32, 1.0f);
  FfnWeights w;
  w.gate = w.up = w.down = m.data();
  const auto l = cuda::PackedFfnLayout::of(s, false);
  std::vector<char> block(l.bytes);
  FfnWeights q = w;
  q.quant = QuantType::Int8;
  expect_error([&] { cuda::pack_ffn(q, s, l, block.data()); }, Status::Unsupported, {"quantised"});
  FfnWeights missing = w;
  missing.down = nullptr;
  expect_error([&] { cuda::pack_ffn(missing, s, l, block.data()); }, Status::InvalidArgument, {"missing"});
  FfnWeights biased = w;
  biased.up_bias = b.data();
  expect_error([&] { cuda::pack_ffn(biased, s, l, block.data()); }, Status::InvalidArgument, {"biases"});
}

}  // namespace
}  // namespace colibri

// cuBLASLt is loaded on first use (kernels/cuda/cublaslt_loader.cpp): a process
// that never calls it never maps the 540 MB library, and the first call loads
// it and reaches its real functions.
namespace {
bool cublaslt_mapped() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line))
    if (line.find("libcublasLt.so") != std::string::npos) return true;
  return false;
}
}  // namespace

TEST(CublasLtLoader, LoadsTheLibraryOnFirstCallOnly) {
  // NOTE: GoogleTest runs each case in its own process under CTest; run alone
  // (a filter), no earlier case has called cuBLASLt either.
  if (::testing::UnitTest::GetInstance()->test_to_run_count() > 1) GTEST_SKIP() << "run alone (ctest runs each case alone)";
  EXPECT_FALSE(cublaslt_mapped()) << "libcublasLt is mapped before any call";
  // Answered by the library itself (the loader alone knows no status names).
  EXPECT_STREQ(cublasLtGetStatusName(CUBLAS_STATUS_INVALID_VALUE), "CUBLAS_STATUS_INVALID_VALUE");
  EXPECT_TRUE(cublaslt_mapped()) << "the first call did not load libcublasLt";
  EXPECT_NE(std::string(cublasLtGetStatusString(CUBLAS_STATUS_SUCCESS)), "");
}
