// test_kernels.cpp: every CPU kernel, generic, AVX2 and AVX-512, against a
// double precision reference on random shapes with odd sizes and tails.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>

#include "kernels/cpu/kernels.h"
#include "kernels/cpu/qkernels.h"
#include "model/error.h"
#include "model/dtype.h"
#include "tests/test_util.h"

using namespace colibri;
using kernels::KernelTable;

namespace {

std::vector<const KernelTable*> tables() {
  std::vector<const KernelTable*> t = {&kernels::generic_table()};
  if (kernels::cpu_has_avx2()) t.push_back(&kernels::avx2_table());
  if (kernels::cpu_has_avx512()) t.push_back(&kernels::avx512_table());
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
  // NOTE: up to 200 inputs covers AVX-512's 32-element steps, its 16-element
  // step and every tail; up to 13 rows every tile remainder (4, 2, 1 rows).
  std::uniform_int_distribution<int> dim(1, 200), rows_d(1, 13);
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

// The vectorised exp inside silu over its whole range (clamped far out).
TEST(Kernels, SiluOverAWideRange) {
  uint64_t seed = test::test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  for (const KernelTable* kt : tables()) {
    SCOPED_TRACE(kt->name);
    auto x = test::random_floats(rng, 4099, -120.f, 120.f), u = test::random_floats(rng, 4099, -2.f, 2.f);
    auto g = x;
    kt->silu_mul(g.data(), u.data(), 4099);
    for (int i = 0; i < 4099; ++i) {
      const double s = x[i] / (1.0 + std::exp(-static_cast<double>(x[i]))) * u[i];
      ASSERT_NEAR(g[i], s, 1e-6 * (1 + std::fabs(s))) << "x = " << x[i];
    }
  }
}

// Rotary embedding, half-split and interleaved pairs, partial (rd < head size).
TEST(Kernels, RopeMatchesReference) {
  uint64_t seed = test::test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  for (const KernelTable* kt : tables()) {
    SCOPED_TRACE(kt->name);
    for (int trial = 0; trial < 30; ++trial) {
      const int half = 1 + static_cast<int>(rng() % 70), rd = 2 * half, stride = rd + static_cast<int>(rng() % 9);
      const int heads = 1 + static_cast<int>(rng() % 4);
      const bool inter = trial % 2;
      auto x = test::random_floats(rng, static_cast<size_t>(heads * stride), -2.f, 2.f);
      auto ang = test::random_floats(rng, half, -3.f, 3.f);
      std::vector<float> c(half), sn(half);
      for (int i = 0; i < half; ++i) c[i] = std::cos(ang[i]), sn[i] = std::sin(ang[i]);
      auto y = x;
      kt->rope(y.data(), heads, stride, rd, inter, c.data(), sn.data());
      for (int h = 0; h < heads; ++h) {
        const float* v = x.data() + h * stride;
        for (int i = 0; i < half; ++i) {
          const double a = inter ? v[2 * i] : v[i], b = inter ? v[2 * i + 1] : v[i + half];
          ASSERT_NEAR(y[h * stride + i], a * c[i] - b * sn[i], 1e-6) << "head " << h << " pair " << i;
          ASSERT_NEAR(y[h * stride + i + half], b * c[i] + a * sn[i], 1e-6);
        }
        for (int i = rd; i < stride; ++i) ASSERT_EQ(y[h * stride + i], v[i]) << "dimension past rd changed";
      }
    }
  }
}

// Attention of one query over n cached rows, with and without a sink logit.
TEST(Kernels, AttendMatchesReference) {
  uint64_t seed = test::test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  for (const KernelTable* kt : tables()) {
    SCOPED_TRACE(kt->name);
    for (int trial = 0; trial < 40; ++trial) {
      const int d = 1 + static_cast<int>(rng() % 130), n = 1 + static_cast<int>(rng() % 300);
      const int stride = d + static_cast<int>(rng() % 5);
      const float scale = 1.0f / std::sqrt(static_cast<float>(d));
      auto q = test::random_floats(rng, d, -2.f, 2.f);
      auto k = test::random_floats(rng, static_cast<size_t>(n * stride), -2.f, 2.f);
      auto v = test::random_floats(rng, static_cast<size_t>(n * stride), -1.f, 1.f);
      const float sink = trial % 2 ? 1.5f : 0.f;
      std::vector<float> scores(n, NAN), out(d, NAN);
      kt->attend(q.data(), d, k.data(), v.data(), stride, nullptr, 0, 0, n, scale, trial % 2 ? &sink : nullptr,
                 scores.data(), out.data());
      std::vector<double> p(n);
      double mx = trial % 2 ? sink : -1e300, sum = 0;
      for (int t = 0; t < n; ++t) {
        double s = 0;
        for (int i = 0; i < d; ++i) s += static_cast<double>(q[i]) * k[t * stride + i];
        p[t] = s * scale;
        mx = std::max(mx, p[t]);
      }
      for (int t = 0; t < n; ++t) sum += (p[t] = std::exp(p[t] - mx));
      if (trial % 2) sum += std::exp(sink - mx);
      for (int i = 0; i < d; ++i) {
        double ref = 0;
        for (int t = 0; t < n; ++t) ref += p[t] / sum * v[t * stride + i];
        ASSERT_NEAR(out[i], ref, 2e-5) << "d " << d << " n " << n << " element " << i;
      }
    }
  }
}

namespace {
// A random attention case over a paged cache: a query of d values, the keys and
// values of positions [0, first + n) stored contiguously (rows `stride` apart),
// and a random injective table of blocks of B positions into a pool of `pool`
// blocks (`spare` more than needed).
struct PagedCase {
  int d, stride, B, first, n, end, pool;
  std::vector<int32_t> table;
  std::vector<float> q, k, v;
  PagedCase(std::mt19937_64& rng, int d_, int max_n, int spare)
      : d(d_), stride(d_ + static_cast<int>(rng() % 3)), B(1 + static_cast<int>(rng() % 17)),
        first(static_cast<int>(rng() % 40)), n(1 + static_cast<int>(rng() % static_cast<uint64_t>(max_n))),
        end(first + n), pool((end + B - 1) / B + spare) {
    std::vector<int32_t> perm(static_cast<size_t>(pool));
    for (int i = 0; i < pool; ++i) perm[static_cast<size_t>(i)] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
    table.assign(perm.begin(), perm.begin() + (end + B - 1) / B);
    q = test::random_floats(rng, static_cast<size_t>(d), -2.f, 2.f);
    k = test::random_floats(rng, static_cast<size_t>(end * stride), -2.f, 2.f);
    v = test::random_floats(rng, static_cast<size_t>(end * stride), -1.f, 1.f);
  }
  // The pool row that holds position p.
  size_t row(int p) const { return static_cast<size_t>(table[static_cast<size_t>(p / B)] * B + p % B); }
  std::string what() const {
    return "d " + std::to_string(d) + " block " + std::to_string(B) + " first " + std::to_string(first) + " n " +
           std::to_string(n);
  }
};
}  // namespace

// A paged cache (blocks of positions anywhere in the buffer, a block table)
// gives bitwise the result of the same rows stored contiguously, from any
// first position.
TEST(Kernels, AttendOverABlockTableEqualsContiguousBitwise) {
  uint64_t seed = test::test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  for (const KernelTable* kt : tables()) {
    SCOPED_TRACE(kt->name);
    for (int trial = 0; trial < 30; ++trial) {
      const PagedCase c(rng, 1 + static_cast<int>(rng() % 100), 200, 5);
      const int d = c.d, stride = c.stride;
      std::vector<float> kp(static_cast<size_t>(c.pool * c.B * stride), NAN), vp(kp.size(), NAN);
      for (int p = 0; p < c.end; ++p) {
        const ptrdiff_t r = static_cast<ptrdiff_t>(c.row(p) * static_cast<size_t>(stride));
        std::copy_n(c.k.begin() + p * stride, stride, kp.begin() + r);
        std::copy_n(c.v.begin() + p * stride, stride, vp.begin() + r);
      }
      const float scale = 0.3f, sink = 0.7f;
      const float* s = trial % 2 ? &sink : nullptr;
      std::vector<float> sc(static_cast<size_t>(c.n)), want(static_cast<size_t>(d), NAN), got(want);
      kt->attend(c.q.data(), d, c.k.data(), c.v.data(), stride, nullptr, 0, c.first, c.n, scale, s, sc.data(),
                 want.data());
      kt->attend(c.q.data(), d, kp.data(), vp.data(), stride, c.table.data(), c.B, c.first, c.n, scale, s, sc.data(),
                 got.data());
      for (int i = 0; i < d; ++i) ASSERT_TRUE(std::isfinite(want[static_cast<size_t>(i)])) << i;
      ASSERT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), 0) << c.what();
    }
  }
}

// widen16 gives to_f32's values, bitwise, for every 16-bit pattern but NaNs (a NaN
// stays a NaN), at every length (vector body and tail).
TEST(Kernels, Widen16IsToF32Bitwise) {
  uint64_t seed = test::test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  for (const KernelTable* kt : tables()) {
    SCOPED_TRACE(kt->name);
    for (DType t : {DType::BF16, DType::F16}) {
      std::vector<uint16_t> all(65536);
      for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
      std::vector<float> want(all.size()), got(all.size(), -1.0f);
      kernels::to_f32(all.data(), t, static_cast<int64_t>(all.size()), want.data());
      kt->widen16(all.data(), t, static_cast<int64_t>(all.size()), got.data());
      for (size_t i = 0; i < all.size(); ++i) {
        if (std::isnan(want[i])) {
          ASSERT_TRUE(std::isnan(got[i])) << dtype_name(t) << " pattern " << i;
        } else {
          ASSERT_EQ(std::memcmp(&got[i], &want[i], 4), 0) << dtype_name(t) << " pattern " << i;
        }
      }
      for (int trial = 0; trial < 20; ++trial) {  // short lengths and offsets: the tail
        const int64_t n = 1 + static_cast<int64_t>(rng() % 40), off = static_cast<int64_t>(rng() % 1000);
        std::vector<float> a(static_cast<size_t>(n) + 1, -7.0f), b(a);
        kernels::to_f32(all.data() + 30000 + off, t, n, a.data());
        kt->widen16(all.data() + 30000 + off, t, n, b.data());
        ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * 4), 0) << "n " << n;  // and nothing past n written
      }
    }
  }
}

// attend16 over a bf16 or f16 cache (paged, from any first position) is bitwise
// attend over the same cache widened to f32: the 16-bit KV cache changes what is
// stored, never the arithmetic.
TEST(Kernels, Attend16IsAttendOverTheWidenedCacheBitwise) {
  uint64_t seed = test::test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  for (const KernelTable* kt : tables()) {
    SCOPED_TRACE(kt->name);
    for (int trial = 0; trial < 40; ++trial) {
      const DType t = trial % 2 ? DType::BF16 : DType::F16;
      const PagedCase c(rng, 1 + static_cast<int>(rng() % (trial < 4 ? kernels::kMaxAttendDim : 160)), 150, 3);
      const int d = c.d, stride = c.stride;
      // The paged 16-bit cache (unused rows 0xffff: NaN in both types) and its widening.
      std::vector<uint16_t> k16(static_cast<size_t>(c.pool * c.B * stride), 0xffff), v16(k16.size(), 0xffff);
      std::vector<float> kw(k16.size(), NAN), vw(k16.size(), NAN);
      for (int p = 0; p < c.end; ++p) {
        const size_t r = c.row(p) * static_cast<size_t>(stride);
        for (int i = 0; i < stride; ++i) {
          const size_t src = static_cast<size_t>(p * stride + i);
          k16[r + i] = t == DType::BF16 ? f32_to_bf16(c.k[src]) : f32_to_f16(c.k[src]);
          v16[r + i] = t == DType::BF16 ? f32_to_bf16(c.v[src]) : f32_to_f16(c.v[src]);
          kw[r + i] = t == DType::BF16 ? bf16_to_f32(k16[r + i]) : f16_to_f32(k16[r + i]);
          vw[r + i] = t == DType::BF16 ? bf16_to_f32(v16[r + i]) : f16_to_f32(v16[r + i]);
        }
      }
      const float scale = 0.3f, sink = 0.7f;
      const float* s = trial % 3 ? &sink : nullptr;
      std::vector<float> sc(static_cast<size_t>(c.n)), want(static_cast<size_t>(d), NAN), got(want);
      kt->attend(c.q.data(), d, kw.data(), vw.data(), stride, c.table.data(), c.B, c.first, c.n, scale, s, sc.data(),
                 want.data());
      kt->attend16(c.q.data(), d, k16.data(), v16.data(), stride, t, c.table.data(), c.B, c.first, c.n, scale, s,
                   sc.data(), got.data());
      for (int i = 0; i < d; ++i) ASSERT_TRUE(std::isfinite(want[static_cast<size_t>(i)])) << i;
      ASSERT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), 0) << dtype_name(t) << " " << c.what();
    }
  }
}

// A row's result does not depend on the rows beside it or on how the outputs
// are split between threads: bitwise, for every table and dtype.
TEST(Kernels, GemmRowsAreBatchAndSplitInvariant) {
  uint64_t seed = test::test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> dim(1, 300), rows_d(2, 17);
  for (const KernelTable* kt : tables()) {
    SCOPED_TRACE(kt->name);
    for (DType t : {DType::F32, DType::BF16, DType::F16}) {
      SCOPED_TRACE(dtype_name(t));
      for (int trial = 0; trial < 20; ++trial) {
        const int in = dim(rng), out = dim(rng), rows = rows_d(rng);
        auto x = test::random_floats(rng, static_cast<size_t>(rows * in));
        std::vector<float> wseen;
        auto w = store(test::random_floats(rng, static_cast<size_t>(out * in)), t, &wseen);
        std::vector<float> batch(static_cast<size_t>(rows * out), NAN), alone(batch.size(), NAN);
        kt->gemm(x.data(), in, rows, w.data(), t, in, 0, out, batch.data(), out);
        const int cut = out / 3;
        for (int r = 0; r < rows; ++r) {
          // Each row alone, its outputs computed in two calls.
          kt->gemm(x.data() + r * in, in, 1, w.data(), t, in, 0, cut, alone.data() + r * out, out);
          kt->gemm(x.data() + r * in, in, 1, w.data(), t, in, cut, out, alone.data() + r * out, out);
        }
        ASSERT_EQ(std::memcmp(batch.data(), alone.data(), batch.size() * sizeof(float)), 0)
            << "rows " << rows << " in " << in << " out " << out;
      }
    }
  }
}

// Rows longer than the kernels' K block (1024 floats), whose lane
// accumulators are kept between blocks: still within the reference tolerance
// and bitwise each row alone, for every table and dtype, with and without tails.
TEST(Kernels, GemmLongRowsAreBatchInvariant) {
  uint64_t seed = test::test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> out_d(1, 40), rows_d(2, 9);
  for (const KernelTable* kt : tables()) {
    SCOPED_TRACE(kt->name);
    for (DType t : {DType::F32, DType::BF16, DType::F16}) {
      SCOPED_TRACE(dtype_name(t));
      for (int in : {1025, 2048, 2048 + 16 + 5, 3584}) {
        const int out = out_d(rng), rows = rows_d(rng);
        auto x = test::random_floats(rng, static_cast<size_t>(rows * in));
        std::vector<float> wseen;
        auto w = store(test::random_floats(rng, static_cast<size_t>(out * in)), t, &wseen);
        std::vector<float> batch(static_cast<size_t>(rows * out), NAN), alone(batch.size(), NAN);
        kt->gemm(x.data(), in, rows, w.data(), t, in, 0, out, batch.data(), out);
        for (int r = 0; r < rows; ++r) {
          kt->gemm(x.data() + r * in, in, 1, w.data(), t, in, 0, out, alone.data() + r * out, out);
          for (int o = 0; o < out; ++o) {
            double ref = 0, mag = 0;
            for (int i = 0; i < in; ++i) {
              ref += static_cast<double>(x[r * in + i]) * wseen[o * in + i];
              mag += std::fabs(static_cast<double>(x[r * in + i]) * wseen[o * in + i]);
            }
            ASSERT_NEAR(batch[r * out + o], ref, (in + 2) * 0x1p-23 * mag + 1e-30) << "in " << in << " at " << r << "," << o;
          }
        }
        ASSERT_EQ(std::memcmp(batch.data(), alone.data(), batch.size() * sizeof(float)), 0)
            << "rows " << rows << " in " << in << " out " << out;
      }
    }
  }
}

// Several products in one parallel region give each product's own bits.
TEST(Kernels, GemmManyEqualsSeparateProducts) {
  uint64_t seed = test::test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  const int threads = kernels::set_threads(0);
  kernels::set_threads(std::max(2, threads));
  std::vector<std::vector<float>> xs, ws, ys, refs;
  std::vector<kernels::GemmJob> jobs;
  for (int j = 0; j < 3; ++j) {
    const int64_t rows = 1 + static_cast<int64_t>(rng() % 5), in = 64 + static_cast<int64_t>(rng() % 300),
                  out = 40 + static_cast<int64_t>(rng() % 400);
    xs.push_back(test::random_floats(rng, static_cast<size_t>(rows * in)));
    ws.push_back(test::random_floats(rng, static_cast<size_t>(out * in)));
    ys.emplace_back(static_cast<size_t>(rows * out), NAN);
    refs.emplace_back(static_cast<size_t>(rows * out), NAN);
    jobs.push_back({xs[j].data(), in, rows, ws[j].data(), DType::F32, in, out, ys[j].data(), out});
  }
  kernels::gemm_many(jobs.data(), 3);
  for (int j = 0; j < 3; ++j) {
    const auto& g = jobs[j];
    kernels::gemm(g.x, g.ldx, g.rows, g.w, g.wt, g.in, g.out, refs[j].data(), g.ldy);
    EXPECT_EQ(std::memcmp(ys[j].data(), refs[j].data(), ys[j].size() * sizeof(float)), 0) << "job " << j;
  }
  kernels::set_threads(threads);
}

TEST(Kernels, SelectFallsBackLoudly) {
  EXPECT_FALSE(kernels::select("avx1024"));
  EXPECT_EQ(kernels::select("avx512"), kernels::cpu_has_avx512());
  EXPECT_TRUE(kernels::select("generic"));
  EXPECT_STREQ(kernels::active().name, "generic");
  if (kernels::cpu_has_avx2()) {
    EXPECT_TRUE(kernels::select("avx2"));
    EXPECT_STREQ(kernels::active().name, "avx2");
  }
  if (kernels::cpu_has_avx512()) {
    EXPECT_TRUE(kernels::select("avx512"));
    EXPECT_STREQ(kernels::active().name, "avx512");
  }
  kernels::select(kernels::default_kernels().name);
}

// The tables a build has follow its architecture (kernels/cpu/kernels.h): x86-64
// builds AVX2 and AVX-512 and takes the widest the CPU runs; any other target
// (aarch64) has only "generic", refuses the x86 names, and so does qkernels.
TEST(Kernels, TablesFollowTheArchitecture) {
  EXPECT_STREQ(kernels::generic_table().name, "generic");
  EXPECT_STREQ(qkernels::generic_table().name, "generic");
#if defined(__x86_64__)
  EXPECT_EQ(COLIBRI_X86_KERNELS, 1);
  __builtin_cpu_init();
  EXPECT_EQ(kernels::cpu_has_avx2(), __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                                         __builtin_cpu_supports("f16c"));
  const char* widest = kernels::cpu_has_avx512() ? "avx512" : kernels::cpu_has_avx2() ? "avx2" : "generic";
  if (!std::getenv("COLIBRI_KERNELS")) {
    EXPECT_STREQ(kernels::default_kernels().name, widest);
  }
  if (kernels::cpu_has_avx2()) {
    EXPECT_STREQ(kernels::avx2_table().name, "avx2");
    EXPECT_STREQ(qkernels::avx2_table().name, "avx2");
  }
  if (kernels::cpu_has_avx512()) {
    EXPECT_STREQ(kernels::avx512_table().name, "avx512");
  }
  if (qkernels::cpu_has_avx512()) {
    EXPECT_STREQ(qkernels::avx512_table().name, "avx512");
  }
#else
  EXPECT_EQ(COLIBRI_X86_KERNELS, 0);
  EXPECT_FALSE(kernels::cpu_has_avx2());
  EXPECT_FALSE(kernels::cpu_has_avx512());
  EXPECT_FALSE(qkernels::cpu_has_avx2());
  EXPECT_FALSE(qkernels::cpu_has_avx512());
  EXPECT_EQ(kernels::table_named("avx2"), nullptr);
  EXPECT_EQ(kernels::table_named("avx512"), nullptr);
  EXPECT_FALSE(kernels::select("avx2"));
  EXPECT_FALSE(qkernels::select("avx512"));
  EXPECT_STREQ(kernels::default_kernels().name, "generic");
  EXPECT_STREQ(kernels::active().name, "generic");
  EXPECT_STREQ(qkernels::active().name, "generic");
  EXPECT_THROW(kernels::avx2_table(), Error);
  EXPECT_THROW(qkernels::avx512_table(), Error);
#endif
}
