// test_kernels.cpp: every CPU kernel, generic and AVX2, against a double
// precision reference on random shapes with odd sizes and tails.
#include <gtest/gtest.h>

#include <cmath>

#include "kernels/cpu/kernels.h"
#include "model/dtype.h"
#include "tests/test_util.h"

using namespace colibri;
using kernels::KernelTable;

namespace {

std::vector<const KernelTable*> tables() {
  std::vector<const KernelTable*> t = {&kernels::generic_table()};
  if (kernels::cpu_has_avx2()) t.push_back(&kernels::avx2_table());
  return t;
}

// Stores `v` in dtype `t`, and returns the values the kernel will actually see.
std::vector<uint8_t> store(const std::vector<float>& v, DType t, std::vector<float>* seen) {
  std::vector<uint8_t> out(v.size() * dtype_size(t));
  convert_elements(v.data(), DType::F32, out.data(), t, v.size());
  seen->resize(v.size());
  convert_elements(out.data(), t, seen->data(), DType::F32, v.size());
  return out;
}

}  // namespace

TEST(Kernels, GemmMatchesReferenceForEveryDtypeAndShape) {
  uint64_t seed = test::test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> dim(1, 70), rows_d(1, 9);
  for (const KernelTable* kt : tables()) {
    SCOPED_TRACE(kt->name);
    for (DType t : {DType::F32, DType::BF16, DType::F16}) {
      SCOPED_TRACE(dtype_name(t));
      for (int trial = 0; trial < 40; ++trial) {
        const int in = trial < 3 ? 1 + trial * 8 : dim(rng), out = dim(rng), rows = rows_d(rng);
        auto x = test::random_floats(rng, static_cast<size_t>(rows * in));
        std::vector<float> wseen;
        auto w = store(test::random_floats(rng, static_cast<size_t>(out * in)), t, &wseen);
        // y starts as NaN so an unwritten element fails.
        std::vector<float> y(static_cast<size_t>(rows * out), NAN);
        kt->gemm(x.data(), in, rows, w.data(), t, in, 0, out, y.data(), out);
        for (int r = 0; r < rows; ++r)
          for (int o = 0; o < out; ++o) {
            double ref = 0, mag = 0;
            for (int i = 0; i < in; ++i) {
              ref += static_cast<double>(x[r * in + i]) * wseen[o * in + i];
              mag += std::fabs(static_cast<double>(x[r * in + i]) * wseen[o * in + i]);
            }
            // NOTE: f32 accumulation of `in` products: error below in * 2^-23 * sum|x*w|.
            double tol = (in + 2) * 0x1p-23 * mag + 1e-30;
            ASSERT_NEAR(y[r * out + o], ref, tol) << "rows " << rows << " in " << in << " out " << out << " at " << r << "," << o;
          }
      }
    }
  }
}

TEST(Kernels, GemmRowsAreBitwiseIndependentOfBatch) {
  // The contract behind "a batch equals its sequences alone": row r of a
  // multi-row product is bitwise the product of row r alone.
  uint64_t seed = test::test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  for (const KernelTable* kt : tables()) {
    SCOPED_TRACE(kt->name);
    for (DType t : {DType::F32, DType::BF16, DType::F16}) {
      const int in = 53, out = 19, rows = 11;
      auto x = test::random_floats(rng, rows * in);
      std::vector<float> seen;
      auto w = store(test::random_floats(rng, out * in), t, &seen);
      std::vector<float> all(rows * out), one(out);
      kt->gemm(x.data(), in, rows, w.data(), t, in, 0, out, all.data(), out);
      for (int r = 0; r < rows; ++r) {
        kt->gemm(x.data() + r * in, in, 1, w.data(), t, in, 0, out, one.data(), out);
        for (int o = 0; o < out; ++o) ASSERT_EQ(all[r * out + o], one[o]) << dtype_name(t) << " row " << r << " col " << o;
      }
    }
  }
}

TEST(Kernels, ThreadedGemmIsIndependentOfThreadCount) {
  uint64_t seed = test::test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  const int in = 256, out = 300, rows = 5;
  auto x = test::random_floats(rng, rows * in);
  std::vector<float> seen;
  auto w = store(test::random_floats(rng, out * in), DType::BF16, &seen);
  std::vector<float> a(rows * out), b(rows * out);
  int before = kernels::set_threads(0);
  kernels::set_threads(1);
  kernels::gemm(x.data(), in, rows, w.data(), DType::BF16, in, out, a.data(), out);
  kernels::set_threads(2);
  kernels::gemm(x.data(), in, rows, w.data(), DType::BF16, in, out, b.data(), out);
  kernels::set_threads(before);
  for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << i;
}

TEST(Kernels, RmsNormSiluAxpyDotMatchReference) {
  uint64_t seed = test::test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  for (const KernelTable* kt : tables()) {
    SCOPED_TRACE(kt->name);
    for (int n : {1, 7, 8, 15, 16, 17, 33, 64, 129}) {
      auto x = test::random_floats(rng, n, -3.f, 3.f), w = test::random_floats(rng, n, 0.5f, 1.5f);
      // dot
      double dref = 0, mag = 0;
      for (int i = 0; i < n; ++i) dref += static_cast<double>(x[i]) * w[i], mag += std::fabs(x[i] * w[i]);
      EXPECT_NEAR(kt->dot(x.data(), w.data(), n), dref, (n + 2) * 0x1p-23 * mag);
      // rmsnorm
      std::vector<float> y(n, NAN);
      const float eps = 1e-5f;
      kt->rmsnorm(x.data(), w.data(), y.data(), n, eps);
      double ss = 0;
      for (float v : x) ss += static_cast<double>(v) * v;
      double inv = 1.0 / std::sqrt(ss / n + eps);
      for (int i = 0; i < n; ++i) ASSERT_NEAR(y[i], x[i] * inv * w[i], 1e-5 * (1 + std::fabs(x[i] * inv * w[i])));
      // silu_mul
      auto g = x;
      kt->silu_mul(g.data(), w.data(), n);
      for (int i = 0; i < n; ++i) {
        double s = x[i] / (1.0 + std::exp(-static_cast<double>(x[i]))) * w[i];
        ASSERT_NEAR(g[i], s, 1e-6 * (1 + std::fabs(s)));
      }
      // axpy
      auto acc = w;
      kt->axpy(acc.data(), 0.75f, x.data(), n);
      // NOTE: the AVX2 build may fuse the multiply-add (one rounding instead of two).
      for (int i = 0; i < n; ++i) ASSERT_NEAR(acc[i], w[i] + 0.75 * static_cast<double>(x[i]), 1e-6 * (1 + std::fabs(w[i])));
    }
  }
}

TEST(Kernels, SelectFallsBackLoudly) {
  EXPECT_FALSE(kernels::select("avx512"));
  EXPECT_TRUE(kernels::select("generic"));
  EXPECT_STREQ(kernels::active().name, "generic");
  if (kernels::cpu_has_avx2()) {
    EXPECT_TRUE(kernels::select("avx2"));
    EXPECT_STREQ(kernels::active().name, "avx2");
  }
}
