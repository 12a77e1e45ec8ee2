// test_quant.cpp: quantised experts (model/quant.h, kernels/cpu/qkernels.h,
// docs/quantization.md): the round trip of the weight quantisation, every SIMD
// kernel against the scalar reference and against f32 on the dequantised
// weights, batch invariance, the converter's option and layout, the reader's
// checks, and fixtures converted with int8/int4 experts against f32.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "kernels/cpu/qkernels.h"
#include "model/colibri_file.h"
#include "model/converter.h"
#include "model/dtype.h"
#include "model/quant.h"
#include "model/safetensors.h"
#include "tests/cli_runner.h"
#include "tests/file_edit.h"
#include "tests/fixture.h"
#include "tests/test_util.h"
#include "worker/expert_ffn.h"

using namespace colibri;
namespace fs = std::filesystem;
namespace qk = colibri::qkernels;

namespace {

std::vector<const qk::QKernelTable*> simd_tables() {
  std::vector<const qk::QKernelTable*> t;
  if (qk::cpu_has_avx2()) t.push_back(&qk::avx2_table());
  if (qk::cpu_has_avx512()) t.push_back(&qk::avx512_table());
  return t;
}

std::vector<const qk::QKernelTable*> all_tables() {
  std::vector<const qk::QKernelTable*> t = {&qk::generic_table()};
  for (auto* s : simd_tables()) t.push_back(s);
  return t;
}

// Weights with a spread of magnitudes: most groups Gaussian, some with an
// outlier, some all zero, some tiny.
std::vector<float> weights(std::mt19937_64& rng, int64_t rows, int64_t cols, int64_t group) {
  std::normal_distribution<float> n(0.f, 0.02f);
  std::uniform_int_distribution<int> kind(0, 9);
  std::vector<float> w(static_cast<size_t>(rows * cols));
  for (int64_t g = 0; g < rows * cols / group; ++g) {
    const int k = kind(rng);
    for (int64_t i = 0; i < group; ++i) {
      float v = n(rng);
      if (k == 0) v = 0.f;
      if (k == 1) v *= 1e-4f;
      w[static_cast<size_t>(g * group + i)] = v;
    }
    if (k == 2) w[static_cast<size_t>(g * group + (rng() % group))] = (rng() & 1 ? 1.f : -1.f) * 0.5f;  // outlier
  }
  return w;
}

struct QuantMat {
  QuantType type;
  int64_t rows, cols, group;
  std::vector<uint8_t> codes;
  std::vector<uint16_t> scales;
  std::vector<float> deq;  // the weights the codes stand for
  qk::QMatrix view() const { return {type, group, cols, codes.data(), scales.data()}; }
};

QuantMat quantize_matrix(QuantType t, const std::vector<float>& w, int64_t rows, int64_t cols, int64_t group) {
  QuantMat m{t, rows, cols, group, {}, {}, {}};
  const uint64_t rb = quant_row_bytes(t, cols);
  m.codes.resize(rows * rb);
  m.scales.resize(static_cast<size_t>(rows * (cols / group)));
  m.deq.resize(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    EXPECT_TRUE(quantize_row(t, group, w.data() + r * cols, cols, m.codes.data() + r * rb, m.scales.data() + r * (cols / group)));
    dequantize_row(t, group, m.codes.data() + r * rb, m.scales.data() + r * (cols / group), cols, m.deq.data() + r * cols);
  }
  return m;
}

// Activations: uniform, with some rows scaled up or down and a few zero blocks.
std::vector<float> activations(std::mt19937_64& rng, int64_t rows, int64_t in) {
  auto x = test::random_floats(rng, static_cast<size_t>(rows * in), -2.f, 2.f);
  for (int64_t r = 0; r < rows; ++r) {
    const float s = r % 3 == 1 ? 100.f : r % 3 == 2 ? 0.01f : 1.f;
    for (int64_t i = 0; i < in; ++i) x[static_cast<size_t>(r * in + i)] *= s;
  }
  if (in >= 64 && rows > 1)
    for (int64_t i = 32; i < 64; ++i) x[static_cast<size_t>(in + i)] = 0.f;  // row 1, block 1
  return x;
}

const std::vector<QuantType> kTypes = {QuantType::Int8, QuantType::Int4};

}  // namespace

// ---------------------------------------------------------------------------
// Weight quantisation

TEST(Quant, RoundTripErrorBounds) {
  uint64_t seed = test::test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  for (QuantType t : kTypes)
    for (int64_t G : {16, 32, 64, 128}) {
      SCOPED_TRACE(std::string(quant_type_name(t)) + " group " + std::to_string(G));
      const int64_t rows = 9, cols = G * 5;
      auto w = weights(rng, rows, cols, G);
      QuantMat m = quantize_matrix(t, w, rows, cols, G);
      double se = 0, sw = 0;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < cols / G; ++g) {
          const float d = f16_to_f32(m.scales[static_cast<size_t>(r * (cols / G) + g)]);
          float amax = 0.f, ext = 0.f;
          for (int64_t i = 0; i < G; ++i) {
            const float v = w[static_cast<size_t>(r * cols + g * G + i)];
            if (std::fabs(v) > amax) amax = std::fabs(v), ext = v;
          }
          // The scale is max|w| / 127 (int8) or m / -8 (int4, m the extreme) rounded to f16.
          const float want = t == QuantType::Int8 ? amax / 127.f : ext / -8.f;
          ASSERT_EQ(m.scales[static_cast<size_t>(r * (cols / G) + g)], f32_to_f16(want));
          for (int64_t i = 0; i < G; ++i) {
            const int64_t e = r * cols + g * G + i;
            const float v = w[static_cast<size_t>(e)], dq = m.deq[static_cast<size_t>(e)];
            const int q = quant_code(t, G, m.codes.data() + r * quant_row_bytes(t, cols), g * G + i);
            if (t == QuantType::Int8) {
              ASSERT_GE(q, -127);
              ASSERT_LE(q, 127);
            } else {
              ASSERT_GE(q, -8);
              ASSERT_LE(q, 7);
            }
            ASSERT_EQ(dq, static_cast<float>(q) * d);
            // Round to nearest within [lo, hi]: half a step, or, when v / d falls
            // outside (int4's +8 on the side opposite the extreme, or a scale
            // that f16 rounded down), the distance to the clamped end.
            const int lo = t == QuantType::Int8 ? -127 : -8, hi = t == QuantType::Int8 ? 127 : 7;
            double bound = std::fabs(v);
            if (d != 0.f) {
              const double z = static_cast<double>(v) / d;
              bound = z >= lo - 0.5 && z <= hi + 0.5 ? std::fabs(d) * 0.5
                                                      : std::fabs(v - std::clamp(z, double(lo), double(hi)) * d);
            } else {
              ASSERT_LT(std::fabs(want), 0x1p-24) << "a zero scale only where f16 underflows";
            }
            ASSERT_LE(std::fabs(static_cast<double>(v) - dq), bound * (1 + 1e-6) + 1e-30)
                << "element " << e << " w " << v << " d " << d;
            if (v == ext && t == QuantType::Int4 && std::fabs(d / want - 1) < 0.01) {
              ASSERT_EQ(q, -8) << "the extreme weight of an int4 group";
            }
          }
        }
      // Relative RMS error on Gaussian weights: a uniform rounding error of one
      // step d over sqrt(12), with d = max|w| / 127 (int8) or / 8 (int4) and
      // max|w| about 2-3 sigma: about 0.005 (int8) and 0.08 (int4).
      std::normal_distribution<float> n(0.f, 0.02f);
      std::vector<float> gw(static_cast<size_t>(rows * cols));
      for (auto& v : gw) v = n(rng);
      QuantMat gm = quantize_matrix(t, gw, rows, cols, G);
      for (size_t i = 0; i < gw.size(); ++i) {
        se += (static_cast<double>(gw[i]) - gm.deq[i]) * (static_cast<double>(gw[i]) - gm.deq[i]);
        sw += static_cast<double>(gw[i]) * gw[i];
      }
      const double rel = std::sqrt(se / sw);
      std::printf("[ info ] %s g%lld relative RMS error %.5f\n", quant_type_name(t), (long long)G, rel);
      EXPECT_LT(rel, t == QuantType::Int8 ? 0.008 : 0.14);
    }
}

TEST(Quant, NonFiniteWeightsAndNibblePacking) {
  std::vector<float> w(32, 0.01f);
  std::vector<uint8_t> codes(32);
  std::vector<uint16_t> sc(2);  // group 16 below: two scales
  w[5] = NAN;
  EXPECT_FALSE(quantize_row(QuantType::Int8, 32, w.data(), 32, codes.data(), sc.data()));
  w[5] = INFINITY;
  EXPECT_FALSE(quantize_row(QuantType::Int4, 32, w.data(), 32, codes.data(), sc.data()));
  w[5] = 1e7f;  // 1e7 / 127 overflows f16
  EXPECT_FALSE(quantize_row(QuantType::Int8, 32, w.data(), 32, codes.data(), sc.data()));
  // Packing: within each unit of 32, byte j holds element j (low) and j + 16 (high).
  for (int i = 0; i < 32; ++i) w[i] = static_cast<float>(i % 16 - 8) * (i < 16 ? 1.f : -1.f) * 0.125f;
  w[0] = -1.f;  // the extreme: d = 1/8, codes = w * 8
  ASSERT_TRUE(quantize_row(QuantType::Int4, 32, w.data(), 32, codes.data(), sc.data()));
  EXPECT_EQ(f16_to_f32(sc[0]), 0.125f);
  for (int j = 0; j < 16; ++j) {
    const int lo = static_cast<int>(std::nearbyint(w[j] * 8)), hi = std::min(7, static_cast<int>(std::nearbyint(w[j + 16] * 8)));
    EXPECT_EQ(codes[j] & 0x0F, lo + 8) << j;
    EXPECT_EQ(codes[j] >> 4, hi + 8) << j;
  }
  // Groups of 16 pack in units of 16: byte j holds element j and j + 8.
  ASSERT_TRUE(quantize_row(QuantType::Int4, 16, w.data(), 32, codes.data(), sc.data()));
  for (int i = 0; i < 32; ++i) {
    const int unit = i / 16, j = i % 16;
    const uint8_t b = codes[unit * 8 + j % 8];
    EXPECT_EQ(quant_code(QuantType::Int4, 16, codes.data(), i), (j < 8 ? (b & 0x0F) : (b >> 4)) - 8);
  }
}

// ---------------------------------------------------------------------------
// Kernels

namespace {

// The activation quantisation every table must reproduce bitwise.
void check_acts_equal(const qk::QActs& a, const qk::QActs& b) {
  ASSERT_EQ(a.rows, b.rows);
  ASSERT_EQ(a.nb, b.nb);
  for (int64_t r = 0; r < a.rows; ++r) {
    ASSERT_EQ(std::memcmp(a.q + r * a.q_stride, b.q + r * b.q_stride, static_cast<size_t>(a.in)), 0) << "row " << r;
    ASSERT_EQ(std::memcmp(a.d + r * a.nb, b.d + r * b.nb, static_cast<size_t>(a.nb) * 4), 0) << "row " << r;
    ASSERT_EQ(std::memcmp(a.corr + r * a.nb * 8, b.corr + r * b.nb * 8, static_cast<size_t>(a.nb) * 32), 0) << "row " << r;
  }
}

// sum_b |ws * xd| * sum_j |qw_j qx_j| for one output: bounds every partial
// sum either kernel forms, so it scales the f32 rounding.
double magnitude(const qk::QActs& a, const QuantMat& m, int64_t r, int64_t o) {
  const int64_t B = a.block;
  const uint8_t* wr = m.codes.data() + o * quant_row_bytes(m.type, m.cols);
  double s = 0;
  for (int64_t b = 0; b < a.nb; ++b) {
    int64_t isum = 0;
    for (int64_t j = 0; j < B; ++j)
      isum += std::abs(static_cast<int64_t>(quant_code(m.type, m.group, wr, b * B + j)) * a.q[r * a.q_stride + b * B + j]);
    const float dd = f16_to_f32(m.scales[static_cast<size_t>(o * (m.cols / m.group) + b * B / m.group)]) * a.d[r * a.nb + b];
    s += std::fabs(static_cast<double>(dd)) * static_cast<double>(isum);
  }
  return s;
}

}  // namespace

TEST(QKernels, ActivationQuantisation) {
  uint64_t seed = test::test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  for (int64_t block : {16, 32}) {
    const int64_t rows = 5, in = block * 7;
    auto x = activations(rng, rows, in);
    x[3] = 1e-35f;  // tiny values next to normal ones stay in the block's range
    for (int64_t i = 0; i < block; ++i) x[static_cast<size_t>(in * 4 + block + i)] = 1e-32f;  // a block below 1e-30: zero
    x[static_cast<size_t>(in * 3 + 2)] = INFINITY;                                             // row 3 block 0: NaN scale
    qk::QActBuffer ref;
    ref.prepare(rows, in, block);
    qk::generic_table().quantize(x.data(), in, 0, rows, QuantType::Int4, ref);
    const qk::QActs& a = ref.acts();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t b = 0; b < a.nb; ++b) {
        const float d = a.d[r * a.nb + b];
        float amax = 0.f;
        for (int64_t j = 0; j < block; ++j) amax = std::max(amax, std::fabs(x[static_cast<size_t>(r * in + b * block + j)]));
        if (r == 3 && b == 0) {
          EXPECT_TRUE(std::isnan(d));
        } else if (r == 4 && b == 1) {
          EXPECT_EQ(d, 0.f);
        } else {
          EXPECT_EQ(d, amax / 127.f);
        }
        int32_t lane[8] = {0};
        for (int64_t j = 0; j < block; ++j) {
          const int q = a.q[r * a.q_stride + b * block + j];
          lane[j / 4] += q;
          if (std::isfinite(d) && d > 0) {
            const float xv = x[static_cast<size_t>(r * in + b * block + j)];
            EXPECT_LE(std::fabs(q * static_cast<double>(d) - xv), 0.5001 * d) << r << " " << b << " " << j;
          } else {
            EXPECT_EQ(q, 0);
          }
        }
        for (int k = 0; k < 8; ++k) EXPECT_EQ(a.corr[(r * a.nb + b) * 8 + k], -8 * lane[k]) << "lane " << k;
      }
    for (const auto* t : simd_tables()) {
      SCOPED_TRACE(t->name);
      qk::QActBuffer got;
      got.prepare(rows, in, block);
      t->quantize(x.data(), in, 0, rows, QuantType::Int4, got);
      check_acts_equal(ref.acts(), got.acts());
      // Int8 weights use offset 128 in the correction lane.
      t->quantize(x.data(), in, 0, rows, QuantType::Int8, got);
      EXPECT_EQ(got.acts().corr[0], 16 * ref.acts().corr[0]);
    }
  }
}

TEST(QKernels, SimdMatchesScalarReference) {
  // NOTE: the integers and the per-block factors are identical; only the order
  // of the f32 accumulation differs, so |simd - scalar| <= (nb + 8) 2^-23 S with
  // S = sum_b |ws d| sum_j |qw_j qx_j| (a bound on every partial sum; nb blocks).
  uint64_t seed = test::test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> rows_d(1, 7), out_d(1, 45), nblk(1, 9);
  const auto simd = simd_tables();
  if (simd.empty()) GTEST_SKIP() << "no SIMD kernels on this CPU";
  double worst = 0;
  for (QuantType t : kTypes)
    for (int64_t G : {16, 32, 64, 128})
      for (int trial = 0; trial < 12; ++trial) {
        const int64_t rows = trial < 7 ? trial + 1 : rows_d(rng), out = out_d(rng);
        const int64_t in = G * (trial == 0 ? 1 : nblk(rng)) * (G < 32 ? 3 : 1);
        SCOPED_TRACE(std::string(quant_type_name(t)) + " group " + std::to_string(G) + " rows " + std::to_string(rows) +
                     " in " + std::to_string(in) + " out " + std::to_string(out));
        auto x = activations(rng, rows, in);
        QuantMat m = quantize_matrix(t, weights(rng, out, in, G), out, in, G);
        std::vector<float> ref(static_cast<size_t>(rows * out), NAN);
        qk::gemm_with(qk::generic_table(), x.data(), in, rows, m.view(), 0, out, ref.data(), out);
        qk::QActBuffer acts;
        acts.prepare(rows, in, quant_unit(G));
        qk::generic_table().quantize(x.data(), in, 0, rows, t, acts);
        for (const auto* k : simd) {
          SCOPED_TRACE(k->name);
          // A sub-range of outputs, into a NaN-filled y: the rest stays untouched.
          const int64_t ob = out > 2 ? 1 : 0, oe = out > 3 ? out - 1 : out;
          std::vector<float> y(static_cast<size_t>(rows * out), NAN);
          qk::gemm_with(*k, x.data(), in, rows, m.view(), ob, oe, y.data(), out);
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t o = 0; o < out; ++o) {
              const float got = y[static_cast<size_t>(r * out + o)];
              if (o < ob || o >= oe) {
                ASSERT_TRUE(std::isnan(got)) << "output " << o << " outside [" << ob << ", " << oe << ") was written";
                continue;
              }
              const float want = ref[static_cast<size_t>(r * out + o)];
              const double S = magnitude(acts.acts(), m, r, o);
              const double tol = (acts.acts().nb + 8) * 0x1p-23 * S + 1e-30;
              ASSERT_NEAR(got, want, tol) << "row " << r << " output " << o;
              if (S > 0) worst = std::max(worst, std::fabs(static_cast<double>(got) - want) / S);
            }
        }
      }
  std::printf("[ info ] largest |simd - scalar| / sum|terms|: %.3g\n", worst);
}

TEST(QKernels, MatchesF32OnDequantisedWeights) {
  // y against sum_i x_i w'_i in double (w' the dequantised weights). The only
  // approximation is the activation's: |q d - x| <= d/2 per element, so
  // |y - ref| <= 0.5 sum_i |w'_i| d_b(i) (plus f32 rounding, (nb + 8) 2^-23 S).
  uint64_t seed = test::test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  for (const auto* k : all_tables()) {
    SCOPED_TRACE(k->name);
    for (QuantType t : kTypes)
      for (int64_t G : {16, 32, 128}) {
        const int64_t rows = 3, out = 37, in = 256;
        auto x = activations(rng, rows, in);
        QuantMat m = quantize_matrix(t, weights(rng, out, in, G), out, in, G);
        std::vector<float> y(static_cast<size_t>(rows * out), NAN);
        qk::gemm_with(*k, x.data(), in, rows, m.view(), 0, out, y.data(), out);
        qk::QActBuffer acts;
        acts.prepare(rows, in, quant_unit(G));
        k->quantize(x.data(), in, 0, rows, t, acts);
        const qk::QActs& a = acts.acts();
        double rel_sum = 0;
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t o = 0; o < out; ++o) {
            double ref = 0, bound = 0;
            for (int64_t i = 0; i < in; ++i) {
              const double w = m.deq[static_cast<size_t>(o * in + i)];
              ref += static_cast<double>(x[static_cast<size_t>(r * in + i)]) * w;
              bound += 0.5 * std::fabs(w) * a.d[r * a.nb + i / a.block];
            }
            const double tol = bound * 1.0001 + (a.nb + 8) * 0x1p-23 * magnitude(a, m, r, o) + 1e-30;
            const float got = y[static_cast<size_t>(r * out + o)];
            ASSERT_NEAR(got, ref, tol) << quant_type_name(t) << " g" << G << " row " << r << " output " << o;
            rel_sum += std::fabs(got - ref) / std::max(bound, 1e-30);
          }
        // Rounding errors mostly cancel: on average far below the worst case.
        EXPECT_LT(rel_sum / (rows * out), 0.25) << quant_type_name(t) << " g" << G;
      }
  }
}

TEST(QKernels, BatchRowsAreBitwiseTheRowsAlone) {
  uint64_t seed = test::test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  for (const auto* k : all_tables()) {
    SCOPED_TRACE(k->name);
    for (QuantType t : kTypes)
      for (int64_t G : {16, 32, 64}) {
        const int64_t rows = 11, out = 29, in = G * 7;
        auto x = activations(rng, rows, in);
        QuantMat m = quantize_matrix(t, weights(rng, out, in, G), out, in, G);
        std::vector<float> all(static_cast<size_t>(rows * out)), one(static_cast<size_t>(out));
        qk::gemm_with(*k, x.data(), in, rows, m.view(), 0, out, all.data(), out);
        for (int64_t r = 0; r < rows; ++r) {
          qk::gemm_with(*k, x.data() + r * in, in, 1, m.view(), 0, out, one.data(), out);
          ASSERT_EQ(std::memcmp(one.data(), all.data() + r * out, static_cast<size_t>(out) * 4), 0)
              << quant_type_name(t) << " g" << G << " row " << r;
        }
      }
  }
}

TEST(QKernels, ThreadedWrapperIsBitwiseTheTable) {
  // Threads split outputs (and big batches' quantisation by rows), never a sum.
  uint64_t seed = test::test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  const int before = omp_get_max_threads();
  for (QuantType t : kTypes) {
    const int64_t rows = 37, out = 300, in = 512, G = 32;
    auto x = activations(rng, rows, in);
    QuantMat m = quantize_matrix(t, weights(rng, out, in, G), out, in, G);
    std::vector<float> want(static_cast<size_t>(rows * out)), got(want.size());
    qk::gemm_with(qk::active(), x.data(), in, rows, m.view(), 0, out, want.data(), out);
    for (int threads : {1, 3, 4}) {
      omp_set_num_threads(threads);
      std::fill(got.begin(), got.end(), NAN);
      qk::gemm(x.data(), in, rows, m.view(), out, got.data(), out);
      EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * 4), 0) << quant_type_name(t) << " threads " << threads;
    }
  }
  omp_set_num_threads(before);
}

TEST(QKernels, GemmManyIsBitwiseEachProductAlone) {
  // q, k and v of an attention layer: one quantisation of x, one parallel loop
  // over every product's blocks of 16 outputs (widths not multiples of 16).
  uint64_t seed = test::test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  const int before = omp_get_max_threads();
  for (QuantType t : kTypes)
    for (int64_t rows : {1, 5}) {
      const int64_t in = 256, G = 32, outs[3] = {37, 16, 5};
      auto x = activations(rng, rows, in);
      std::vector<QuantMat> ms;
      std::vector<std::vector<float>> want(3), got(3);
      qk::QGemmJob jobs[3];
      for (int j = 0; j < 3; ++j) {
        ms.push_back(quantize_matrix(t, weights(rng, outs[j], in, G), outs[j], in, G));
        want[j].assign(static_cast<size_t>(rows * outs[j]), 0.f);
        got[j].assign(want[j].size(), NAN);
        qk::gemm(x.data(), in, rows, ms[j].view(), outs[j], want[j].data(), outs[j]);
      }
      for (int j = 0; j < 3; ++j) jobs[j] = {ms[j].view(), outs[j], got[j].data(), outs[j]};
      for (int threads : {1, 2, 3}) {
        omp_set_num_threads(threads);
        for (auto& g : got) std::fill(g.begin(), g.end(), NAN);
        qk::gemm_many(x.data(), in, rows, jobs, 3);
        for (int j = 0; j < 3; ++j)
          EXPECT_EQ(std::memcmp(got[j].data(), want[j].data(), got[j].size() * 4), 0)
              << quant_type_name(t) << " rows " << rows << " product " << j << " threads " << threads;
      }
    }
  omp_set_num_threads(before);
  // Products that do not share one quantisation of x are refused.
  QuantMat a = quantize_matrix(QuantType::Int8, weights(rng, 4, 64, 32), 4, 64, 32);
  QuantMat b = quantize_matrix(QuantType::Int8, weights(rng, 4, 64, 16), 4, 64, 16);
  std::vector<float> x(64, 0.5f), ya(4), yb(4);
  const qk::QGemmJob mixed[2] = {{a.view(), 4, ya.data(), 4}, {b.view(), 4, yb.data(), 4}};
  test::expect_error([&] { qk::gemm_many(x.data(), 64, 1, mixed, 2); }, Status::Internal, {"differ in type, group or width"});
}

TEST(QKernels, NonFiniteInputMakesOnlyItsRowNaN) {
  std::mt19937_64 rng(7);
  for (const auto* k : all_tables()) {
    SCOPED_TRACE(k->name);
    for (QuantType t : kTypes) {
      const int64_t rows = 3, out = 5, in = 64;
      auto x = activations(rng, rows, in);
      x[static_cast<size_t>(in + 40)] = NAN;
      QuantMat m = quantize_matrix(t, weights(rng, out, in, 32), out, in, 32);
      std::vector<float> y(static_cast<size_t>(rows * out));
      qk::gemm_with(*k, x.data(), in, rows, m.view(), 0, out, y.data(), out);
      for (int64_t o = 0; o < out; ++o) {
        EXPECT_TRUE(std::isfinite(y[static_cast<size_t>(o)]));
        EXPECT_TRUE(std::isnan(y[static_cast<size_t>(out + o)]));
        EXPECT_TRUE(std::isfinite(y[static_cast<size_t>(2 * out + o)]));
      }
    }
  }
}

TEST(QKernels, ExpertFfnUsesTheQuantisedPath) {
  // ffn() on a quantised FfnWeights equals the same FFN composed from the
  // quantised products, for decode-sized and batch-sized inputs, serial and in
  // one OpenMP region (x quantised per thread or shared), and is bitwise the
  // same for every thread count.
  uint64_t seed = test::test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  const int before = omp_get_max_threads();
  for (auto [H, I] : {std::pair<int64_t, int64_t>{64, 96}, std::pair<int64_t, int64_t>{256, 512}})
    for (QuantType t : kTypes)
      for (int64_t G : {16, 32}) {
        QuantMat g = quantize_matrix(t, weights(rng, I, H, G), I, H, G), u = quantize_matrix(t, weights(rng, I, H, G), I, H, G),
                 d = quantize_matrix(t, weights(rng, H, I, G), H, I, G);
        FfnWeights w;
        w.quant = t;
        w.quant_group = G;
        w.gate = g.codes.data(), w.up = u.codes.data(), w.down = d.codes.data();
        w.gate_scales = g.scales.data(), w.up_scales = u.scales.data(), w.down_scales = d.scales.data();
        for (int64_t rows : {1, 3, 40}) {
          SCOPED_TRACE(std::string(quant_type_name(t)) + " g" + std::to_string(G) + " H " + std::to_string(H) + " rows " +
                       std::to_string(rows));
          auto x = activations(rng, rows, H);
          std::vector<float> eg(rows * I), eu(rows * I), ey(rows * H);
          qk::gemm_with(qk::active(), x.data(), H, rows, g.view(), 0, I, eg.data(), I);
          qk::gemm_with(qk::active(), x.data(), H, rows, u.view(), 0, I, eu.data(), I);
          for (size_t i = 0; i < eg.size(); ++i) eg[i] = eg[i] / (1.0f + std::exp(-eg[i])) * eu[i];
          qk::gemm_with(qk::active(), eg.data(), I, rows, d.view(), 0, H, ey.data(), H);
          std::vector<float> first;
          for (int threads : {1, 2, 3}) {
            omp_set_num_threads(threads);
            std::vector<float> y(rows * H, NAN), sg(rows * I), su(rows * I);
            ffn(w, FfnShape::silu(H, I), x.data(), rows, y.data(), sg.data(), su.data());
            for (size_t i = 0; i < y.size(); ++i)
              ASSERT_NEAR(y[i], ey[i], 1e-4 * (1 + std::fabs(ey[i]))) << "threads " << threads << " element " << i;
            if (first.empty()) first = y;
            EXPECT_EQ(std::memcmp(first.data(), y.data(), y.size() * 4), 0) << "threads " << threads;
          }
        }
      }
  omp_set_num_threads(before);
}

// ---------------------------------------------------------------------------
// Converter, layout and reader

namespace {

// The largest supported group size <= `want` that divides both widths.
int64_t group_for(const ModelConfig& c, int64_t want) {
  for (int64_t g = want; g >= 16; g /= 2)
    if (c.hidden_size % g == 0 && c.intermediate_size % g == 0) return g;
  return 0;
}

// fx converted with its experts and/or dense matrices quantised (group g).
std::string convert_quantised(const test::Fixture& fx, const test::TempDir& tmp, QuantType experts, QuantType dense,
                              int64_t g, DType dt = DType::F32) {
  const std::string out = tmp.file(fx.name + ".d" + quant_type_name(dense) + ".e" + quant_type_name(experts) + ".g" +
                                   std::to_string(g) + "." + dtype_name(dt) + ".colibri");
  ConvertOptions o;
  o.dtype = dt;
  o.expert_quant = experts;
  o.dense_quant = dense;
  o.group_size = g;
  ConvertResult r = convert_checkpoint(fx.dir + "/hf", out, o);
  EXPECT_EQ(r.expert_quant, experts);
  EXPECT_EQ(r.dense_quant, dense);
  EXPECT_EQ(r.group_size, g);
  if (dense != QuantType::None) {
    EXPECT_GT(r.dense_quantised, 0);
  }
  return out;
}
std::string convert_quant(const test::Fixture& fx, const test::TempDir& tmp, QuantType t, int64_t g,
                          DType dt = DType::F32) {
  return convert_quantised(fx, tmp, t, QuantType::None, g, dt);
}

// Logits [len][V] of each sequence, teacher-forced (the sequence as the prompt).
std::vector<std::vector<float>> forced_logits(const std::string& path, const std::vector<std::vector<int32_t>>& seqs,
                                              bool one_batch = true) {
  std::vector<Request> reqs;
  for (const auto& s : seqs) {
    Request q;
    q.prompt = s;
    q.max_new_tokens = 1;
    q.ignore_eos = true;
    reqs.push_back(q);
  }
  std::vector<std::vector<float>> out;
  if (one_batch) {
    for (auto& o : test::run_engine(path, reqs)) out.push_back(std::move(o.logits));
  } else {
    for (const auto& r : reqs) out.push_back(std::move(test::run_engine(path, {r}).front().logits));
  }
  return out;
}

struct Agreement {
  int64_t positions = 0, top1_same = 0;
  double kl_sum = 0, max_rel_l2 = 0;
  std::vector<double> rel_l2;  // per position
  double median_rel_l2() const {
    std::vector<double> v = rel_l2;
    std::sort(v.begin(), v.end());
    return v.empty() ? 0 : v[v.size() / 2];
  }
};

// Accumulates top-1 agreement, KL(p_ref || p_q) and the relative L2 error of
// each position's logits.
void compare(const std::vector<float>& ref, const std::vector<float>& q, int64_t V, Agreement& a) {
  const int64_t n = static_cast<int64_t>(ref.size()) / V;
  for (int64_t p = 0; p < n; ++p) {
    const float* r = ref.data() + p * V;
    const float* s = q.data() + p * V;
    const int64_t ar = std::max_element(r, r + V) - r, as = std::max_element(s, s + V) - s;
    a.top1_same += ar == as;
    const double mr = r[ar], ms = s[as];
    double zr = 0, zs = 0;
    for (int64_t i = 0; i < V; ++i) zr += std::exp(r[i] - mr), zs += std::exp(s[i] - ms);
    double kl = 0;
    for (int64_t i = 0; i < V; ++i) {
      const double lp = r[i] - mr - std::log(zr), lq = s[i] - ms - std::log(zs);
      kl += std::exp(lp) * (lp - lq);
    }
    a.kl_sum += kl;
    a.rel_l2.push_back(test::rel_l2(s, r, V));
    a.max_rel_l2 = std::max(a.max_rel_l2, a.rel_l2.back());
    ++a.positions;
  }
}

std::vector<std::vector<int32_t>> fixture_sequences(const test::Fixture& fx) {
  std::vector<std::vector<int32_t>> seqs;
  for (size_t i = 0; i < fx.prompts.size(); ++i) {
    auto s = fx.prompts[i];
    s.insert(s.end(), fx.greedy[i].begin(), fx.greedy[i].end());
    seqs.push_back(s);
  }
  return seqs;
}

// Every sequence's logits in one batch are bitwise those it gets alone.
void expect_batch_equals_alone(const std::string& path, const std::vector<std::vector<int32_t>>& seqs,
                               const std::string& what) {
  const auto batch = forced_logits(path, seqs, true), alone = forced_logits(path, seqs, false);
  for (size_t s = 0; s < seqs.size(); ++s) {
    ASSERT_EQ(batch[s].size(), alone[s].size());
    EXPECT_EQ(std::memcmp(batch[s].data(), alone[s].data(), batch[s].size() * 4), 0) << what << " seq " << s;
  }
}

}  // namespace

TEST(QuantConvert, EveryFixtureOpensGeneratesAndStaysCloseToF32) {
  // Each fixture with int8 and int4 experts (group 32, or 16 where 32 does not
  // divide hidden/intermediate), teacher-forced on its prompts and greedy
  // continuation (about 75 positions), against the f32 engine on the same
  // fixture. Measured (AVX-512 and AVX2 kernels), worst fixture: median
  // position's relative L2 error of the logits 0.020 (int8) / 0.20 (int4), mean
  // KL(f32 || quantised) 0.011 / 0.065, top-1 agreement 68/75 / 47/75. The
  // fixtures' router gaps are tiny (down to 1e-4), so some positions switch
  // experts and differ much more (max rel L2 up to 1.15, mixtral_b: top-1 routing).
  // Bounds: about 2.5x the median and KL, top-1 >= 85% / 50%.
  test::TempDir tmp;
  for (const auto& name : test::fixture_names()) {
    SCOPED_TRACE(name);
    test::Fixture fx(name);
    const std::string f32 = fx.convert(tmp, DType::F32);
    const auto seqs = fixture_sequences(fx);
    const auto ref = forced_logits(f32, seqs);
    const ModelConfig cfg = ColibriFile::open(f32)->config();
    const int64_t g = group_for(cfg, 32);
    ASSERT_GT(g, 0);
    for (QuantType t : kTypes) {
      SCOPED_TRACE(quant_type_name(t));
      const std::string path = convert_quant(fx, tmp, t, g);
      auto file = ColibriFile::open(path);
      EXPECT_EQ(file->config().expert_quant.type, quant_type_name(t));
      EXPECT_EQ(file->config().expert_quant.group_size, g);
      for (const auto& e : file->experts()) {
        ASSERT_EQ(e.quant, t);
        ASSERT_EQ(e.quant_group, g);
        file->verify_expert(e);
      }
      const auto got = forced_logits(path, seqs);
      Agreement a;
      for (size_t s = 0; s < seqs.size(); ++s) {
        ASSERT_EQ(got[s].size(), ref[s].size());
        for (float v : got[s]) ASSERT_TRUE(std::isfinite(v));
        compare(ref[s], got[s], fx.vocab, a);
      }
      const double kl = a.kl_sum / a.positions;
      std::printf("[ info ] %-14s %s g%-3lld rel L2 median %.4f max %.4f  mean KL %.2e  top-1 %lld/%lld\n", name.c_str(),
                  quant_type_name(t), (long long)g, a.median_rel_l2(), a.max_rel_l2, kl, (long long)a.top1_same,
                  (long long)a.positions);
      const bool i8 = t == QuantType::Int8;
      EXPECT_LT(a.median_rel_l2(), i8 ? 0.05 : 0.5);
      EXPECT_LT(kl, i8 ? 0.03 : 0.2);
      EXPECT_GE(a.top1_same, (i8 ? 0.85 : 0.5) * a.positions);
      // Generation runs end to end (decode included).
      auto outs = test::run_engine(path, fx.requests());
      for (const auto& o : outs) EXPECT_EQ(o.tokens.size(), static_cast<size_t>(fx.new_tokens));
    }
  }
}

TEST(QuantConvert, BatchGivesBitwiseTheSequencesAlone) {
  // End to end through the engine: a batch's rows reach the experts together,
  // and each sequence still gets exactly its logits alone.
  test::TempDir tmp;
  for (const char* name : {"mixtral_a", "gpt_oss_a", "deepseek_v3_b"}) {
    SCOPED_TRACE(name);
    test::Fixture fx(name);
    const int64_t g = group_for(ColibriFile::open(fx.convert(tmp, DType::F32))->config(), 32);
    for (QuantType t : kTypes) {
      expect_batch_equals_alone(convert_quant(fx, tmp, t, g, DType::BF16), fixture_sequences(fx), quant_type_name(t));
    }
  }
}

TEST(QuantConvert, LayoutAndCodesMatchTheCheckpoint) {
  // mixtral_a (H 64, I 96, 4 experts, classic layout): the block holds exactly
  // quantize_row of each HF row, at the documented offsets.
  test::TempDir tmp;
  test::Fixture fx("mixtral_a");
  for (QuantType t : kTypes) {
    SCOPED_TRACE(quant_type_name(t));
    const std::string path = convert_quant(fx, tmp, t, 32, DType::BF16);
    auto file = ColibriFile::open(path);
    const ModelConfig& c = file->config();
    const int64_t H = c.hidden_size, I = c.intermediate_size, G = 32;
    ASSERT_EQ(H, 64);
    ASSERT_EQ(I, 96);
    const ExpertLayout l = expert_layout(c, DType::BF16);
    const uint64_t codes = static_cast<uint64_t>(H * I) / (t == QuantType::Int4 ? 2 : 1);
    auto a64 = [](uint64_t v) { return (v + 63) / 64 * 64; };
    EXPECT_EQ(l.gate_offset, 0u);
    EXPECT_EQ(l.gate_scale_offset, a64(codes));
    EXPECT_EQ(l.up_offset, l.gate_scale_offset + a64(I * (H / G) * 2));
    EXPECT_EQ(l.up_scale_offset, l.up_offset + a64(codes));
    EXPECT_EQ(l.down_offset, l.up_scale_offset + a64(I * (H / G) * 2));
    EXPECT_EQ(l.down_scale_offset, l.down_offset + a64(codes));
    EXPECT_EQ(l.size, l.down_scale_offset + H * (I / G) * 2);
    EXPECT_FALSE(l.has_bias);
    // The dense tensors stay bf16.
    EXPECT_EQ(file->tensor("blk.0.attn_q").dtype, DType::BF16);
    SafetensorsFile st(fx.dir + "/hf/model.safetensors");
    std::vector<float> row(static_cast<size_t>(std::max(H, I)));
    std::vector<uint8_t> qc(static_cast<size_t>(std::max(H, I)));
    std::vector<uint16_t> qs(static_cast<size_t>(std::max(H, I) / G));
    for (int m = 0; m < 2; ++m)
      for (int e = 0; e < c.num_experts; ++e) {
        const ExpertView& v = file->expert(m, e);
        ASSERT_EQ(v.size, l.size);
        struct Part { const char* w; const void* codes; const uint16_t* scales; int64_t rows, cols; };
        for (const Part& p : {Part{"w1", v.gate, v.gate_scales, I, H}, Part{"w3", v.up, v.up_scales, I, H},
                              Part{"w2", v.down, v.down_scales, H, I}}) {
          const SafeTensor* s =
              st.find("model.layers." + std::to_string(m) + ".block_sparse_moe.experts." + std::to_string(e) + "." + p.w + ".weight");
          ASSERT_NE(s, nullptr);
          const uint64_t rb = quant_row_bytes(t, p.cols);
          for (int64_t r = 0; r < p.rows; ++r) {
            convert_elements(s->data + r * p.cols * 4, DType::F32, row.data(), DType::F32, static_cast<size_t>(p.cols));
            ASSERT_TRUE(quantize_row(t, G, row.data(), p.cols, qc.data(), qs.data()));
            ASSERT_EQ(std::memcmp(qc.data(), static_cast<const uint8_t*>(p.codes) + r * rb, rb), 0) << p.w << " row " << r;
            ASSERT_EQ(std::memcmp(qs.data(), p.scales + r * (p.cols / G), static_cast<size_t>(p.cols / G) * 2), 0);
          }
        }
      }
  }
  // gpt-oss: the f32 biases follow the down scales.
  test::Fixture oss("gpt_oss_a");
  auto file = ColibriFile::open(convert_quant(oss, tmp, QuantType::Int4, 32));
  const ExpertLayout l = expert_layout(file->config(), DType::F32);
  const int64_t H = file->config().hidden_size, I = file->config().intermediate_size;
  EXPECT_TRUE(l.has_bias);
  EXPECT_EQ(l.gate_bias_offset, (l.down_scale_offset + H * (I / 32) * 2 + 63) / 64 * 64);
  const ExpertView& v = file->expert(0, 0);
  EXPECT_EQ(reinterpret_cast<const uint8_t*>(v.gate_bias), v.block + l.gate_bias_offset);
  EXPECT_EQ(reinterpret_cast<const uint8_t*>(v.down_bias), v.block + l.down_bias_offset);
}

TEST(QuantConvert, BadOptionsFailClearlyAndWriteNothing) {
  test::TempDir tmp;
  struct Case {
    const char* fixture;
    QuantType t;
    int64_t g;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {"mixtral_a", QuantType::Int8, 64, "--group-size 64 does not divide intermediate_size 96"},
      {"mixtral_b", QuantType::Int4, 32, "--group-size 32 does not divide hidden_size 48"},
      {"mixtral_a", QuantType::Int4, 48, "--group-size 48 is not supported (supported: 16, 32, 64, 128)"},
      {"mixtral_a", QuantType::Int8, 0, "--group-size 0 is not supported"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.needle);
    test::Fixture fx(c.fixture);
    const std::string out = tmp.file("bad.colibri");
    ConvertOptions o;
    o.expert_quant = c.t;
    o.group_size = c.g;
    test::expect_error([&] { convert_checkpoint(fx.dir + "/hf", out, o); }, Status::InvalidArgument, {c.needle});
    EXPECT_FALSE(fs::exists(out));
    EXPECT_FALSE(test::temp_left(out));
  }
  // The command line: exit 11 (invalid argument) with the message.
  const std::string hf = test::fixtures_dir() + "/mixtral_a/hf", out = tmp.file("cli.colibri");
  struct CliCase {
    std::vector<std::string> args;
    std::string needle;
  };
  const std::vector<CliCase> cli = {
      {{"--quantize-experts", "int3"}, "unknown --quantize-experts 'int3' (int8, int4)"},
      {{"--quantize-experts", "none"}, "unknown --quantize-experts 'none'"},
      {{"--group-size", "32"}, "--group-size needs --quantize-experts"},
      {{"--quantize-experts", "int8", "--group-size", "abc"}, "--group-size 'abc' is not supported"},
      {{"--quantize-experts", "int8", "--group-size", "64"}, "--group-size 64 does not divide intermediate_size 96"},
  };
  for (const auto& c : cli) {
    std::vector<std::string> args = {"convert", hf, out};
    args.insert(args.end(), c.args.begin(), c.args.end());
    auto r = test::run_cli(tmp, args);
    EXPECT_TRUE(r.exited);
    EXPECT_EQ(r.code, 11) << r.err;
    EXPECT_NE(r.err.find(c.needle), std::string::npos) << r.err;
    EXPECT_FALSE(fs::exists(out));
  }
  auto ok = test::run_cli(tmp, {"convert", hf, out, "--quantize-experts", "int4", "--group-size", "32", "--dtype", "bf16"});
  EXPECT_EQ(ok.code, 0) << ok.err;
  EXPECT_NE(ok.err.find("experts int4 group 32"), std::string::npos) << ok.err;
  auto gen = test::run_cli(tmp, {"generate", "--model", out, "--prompt-ids", "1,2,3", "--max-new-tokens", "4"});
  EXPECT_EQ(gen.code, 0) << gen.err;
}

namespace {
std::string read_all(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}
void write_all(const std::string& p, const std::string& b) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out << b;
}
using test::edit_config;
using test::header_of;
using test::reseal;
// Record i of the table at `table` (a file offset) read, changed by f, written back.
template <class Record>
void edit_record(std::string& b, uint64_t table, size_t i, const std::function<void(Record&)>& f) {
  const size_t pos = table + i * sizeof(Record);
  Record r;
  std::memcpy(&r, b.data() + pos, sizeof r);
  f(r);
  std::memcpy(b.data() + pos, &r, sizeof r);
}
void edit_expert(std::string& b, size_t i, const std::function<void(ExpertRecord&)>& f) {
  edit_record<ExpertRecord>(b, header_of(b).expert_index_offset, i, f);
}
}  // namespace

TEST(QuantConvert, ReaderRejectsInconsistentQuantisation) {
  test::TempDir tmp;
  test::Fixture fx("mixtral_c");  // H 32, I 64
  const std::string q8 = read_all(convert_quant(fx, tmp, QuantType::Int8, 32));
  const std::string plain = read_all(fx.convert(tmp, DType::F32));
  // The embedded config of a quantised file names it; an unquantised one has no such key.
  EXPECT_NE(q8.find("\"expert_quant\": {\n    \"group_size\": 32,\n    \"type\": \"int8\"\n  }"), std::string::npos);
  EXPECT_EQ(plain.find("expert_quant"), std::string::npos);
  struct Case {
    const char* name;
    const std::string* base;
    std::function<void(std::string&)> corrupt;
    std::vector<std::string> needles;
  };
  const std::vector<Case> cases = {
      {"type swapped", &q8, [](std::string& b) { edit_config(b, "\"int8\"", "\"int4\""); },
       {"expert 0 of layer 0 has dtype 16 but the config's expert_quant is int4 (17)"}},
      {"unknown type", &q8, [](std::string& b) { edit_config(b, "\"int8\"", "\"int3\""); },
       {"expert_quant.type 'int3' is not supported (supported: none, int8, int4)"}},
      {"group 16: layout differs", &q8, [](std::string& b) { edit_config(b, "\"group_size\": 32", "\"group_size\": 16"); },
       {"block layout", "does not match the config"}},
      {"group 64 does not divide", &q8, [](std::string& b) { edit_config(b, "\"group_size\": 32", "\"group_size\": 64"); },
       {"expert_quant.group_size 64 does not divide hidden_size 32"}},
      {"group 48 unsupported", &q8, [](std::string& b) { edit_config(b, "\"group_size\": 32", "\"group_size\": 48"); },
       {"expert_quant.group_size 48 is not supported"}},
      {"record says f32", &q8, [](std::string& b) { edit_expert(b, 3, [](ExpertRecord& r) { r.dtype = 0; }); },
       {"has dtype 0 but the config's expert_quant is int8"}},
      {"plain file, quantised record", &plain, [](std::string& b) { edit_expert(b, 0, [](ExpertRecord& r) { r.dtype = 17; }); },
       {"is stored quantised (dtype 17) but the config has no expert_quant"}},
      {"scale offsets are the config's", &q8, [](std::string& b) { edit_expert(b, 1, [](ExpertRecord& r) { r.up_offset += 64; }); },
       {"block layout"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    std::string b = *c.base;
    c.corrupt(b);
    reseal(b);
    const std::string p = tmp.file("corrupt.colibri");
    write_all(p, b);
    test::expect_error([&] { ColibriFile::open(p); }, Status::Format, c.needles);
  }
  // Untouched, both open.
  write_all(tmp.file("ok.colibri"), q8);
  EXPECT_NO_THROW(ColibriFile::open(tmp.file("ok.colibri")));
}

// ---------------------------------------------------------------------------
// Quantised dense matrices (--quantize-dense): attention projections, dense and
// shared FFNs and the LM head; the embedding table, routers, MLA's per-head
// k_b / v_b and the norms keep their storage.

namespace {

// The largest supported group <= `want` dividing the hidden size (every q, k,
// v and the LM head then quantise).
int64_t dense_group_for(const ModelConfig& c, int64_t want) {
  for (int64_t g = want; g >= 16; g /= 2)
    if (c.hidden_size % g == 0) return g;
  return 0;
}

std::string convert_dense(const test::Fixture& fx, const test::TempDir& tmp, QuantType dense, QuantType experts, int64_t g,
                          DType dt = DType::F32) {
  return convert_quantised(fx, tmp, experts, dense, g, dt);
}

// `in` with every quantised dense matrix replaced by the f32 weights it stands
// for (dequantize_row), dense_quant dropped; the rest copied as stored.
void write_dense_dequantised(const std::string& in, const std::string& out) {
  auto f = ColibriFile::open(in);
  ModelConfig c = f->config();
  c.dense_quant = {};
  std::vector<ColibriWriter::DenseTensor> dense;
  for (const auto& t : f->tensors()) dense.push_back({t.name, t.dtype, t.shape});
  ColibriWriter w(out, c, dense, f->experts().front().dtype);
  std::vector<float> x;
  for (size_t i = 0; i < f->tensors().size(); ++i) {
    const TensorView& t = f->tensors()[i];
    if (t.quant == QuantType::None) {
      w.write_dense(i, t.data, t.size);
      continue;
    }
    const int64_t rows = t.shape[0], cols = t.shape[1];
    x.resize(static_cast<size_t>(rows * cols));
    for (int64_t r = 0; r < rows; ++r)
      dequantize_row(t.quant, t.quant_group, t.data + r * quant_row_bytes(t.quant, cols), t.scales + r * (cols / t.quant_group),
                     cols, x.data() + r * cols);
    w.write_dense(i, x.data(), x.size() * sizeof(float));
  }
  for (const auto& e : f->experts()) w.write_expert(e.layer, e.expert, e.block, e.size);
  w.finish();
}

void edit_tensor(std::string& b, size_t i, const std::function<void(TensorRecord&)>& f) {
  edit_record<TensorRecord>(b, test::header_of(b).tensor_dir_offset, i, f);
}

}  // namespace

TEST(QuantDense, EveryFixtureStoresTheRightMatricesAndStaysCloseToF32) {
  // Each fixture with its dense matrices int8 / int4 (experts f32), and with
  // experts and dense matrices both quantised, teacher-forced as above against
  // the f32 engine. Measured worst fixtures (AVX-512 and AVX2 kernels): see the
  // bounds' comments below.
  test::TempDir tmp;
  struct Variant {
    QuantType dense, experts;
    double median_l2, kl, top1, vs_dequantised;  // bounds
  };
  // Measured worst fixtures (widths 32-64, so groups of 16-32 and few of them
  // per row; int4 is coarse at that size), dense only / with experts:
  //   int8: median rel L2 0.050 / 0.043, mean KL 0.053 / 0.047, top-1 58/75 / 63/75
  //   int4: median rel L2 0.42 / 0.43, mean KL 0.22 / 0.23, top-1 35/75 / 27/75
  // Against the same engine on the dequantised dense weights in f32 (only the
  // activations' int8 rounding differs): median rel L2 at most 0.035.
  // Bounds about 2x the medians and KL, top-1 about 0.8x.
  const std::vector<Variant> variants = {
      {QuantType::Int8, QuantType::None, 0.1, 0.1, 0.62, 0.07},
      {QuantType::Int4, QuantType::None, 0.85, 0.45, 0.37, 0.07},
      {QuantType::Int8, QuantType::Int8, 0.1, 0.1, 0.67, 0.07},
      {QuantType::Int4, QuantType::Int4, 0.85, 0.45, 0.29, 0.07},
  };
  for (const auto& name : test::fixture_names()) {
    SCOPED_TRACE(name);
    test::Fixture fx(name);
    const std::string f32 = fx.convert(tmp, DType::F32);
    const auto seqs = fixture_sequences(fx);
    const auto ref = forced_logits(f32, seqs);
    const ModelConfig cfg = ColibriFile::open(f32)->config();
    for (const auto& v : variants) {
      const int64_t g = v.experts == QuantType::None ? dense_group_for(cfg, 32)
                                                     : std::min(dense_group_for(cfg, 32), group_for(cfg, 32));
      ASSERT_GT(g, 0);
      SCOPED_TRACE(std::string("dense ") + quant_type_name(v.dense) + " experts " + quant_type_name(v.experts));
      const std::string path = convert_dense(fx, tmp, v.dense, v.experts, g);
      auto file = ColibriFile::open(path);
      EXPECT_EQ(file->config().dense_quant.type, quant_type_name(v.dense));
      EXPECT_EQ(file->config().dense_quant.group_size, g);
      int quantised = 0;
      for (const auto& spec : dense_tensor_specs(file->config())) {
        const TensorView& t = file->tensor(spec.name);
        if (spec.quantizable) {
          ++quantised;
          ASSERT_EQ(t.quant, v.dense) << spec.name;
          ASSERT_EQ(t.quant_group, g);
          ASSERT_EQ(t.size, quant_matrix_layout(v.dense, spec.shape[0], spec.shape[1], g).size);
        } else {
          ASSERT_EQ(t.quant, QuantType::None) << spec.name;
          ASSERT_EQ(t.dtype, DType::F32) << spec.name;
        }
      }
      // At least three attention matrices per layer (GQA q, k, v, o; MLA q or
      // q_a, kv_a, output), and the LM head unless tied.
      EXPECT_GE(quantised, 3 * cfg.num_layers + (cfg.tie_word_embeddings ? 0 : 1));
      const auto got = forced_logits(path, seqs);
      Agreement a;
      for (size_t s = 0; s < seqs.size(); ++s) {
        ASSERT_EQ(got[s].size(), ref[s].size());
        for (float x : got[s]) ASSERT_TRUE(std::isfinite(x));
        compare(ref[s], got[s], fx.vocab, a);
      }
      const double kl = a.kl_sum / a.positions;
      std::printf("[ info ] %-14s dense %s experts %-4s g%-3lld rel L2 median %.4f max %.4f  mean KL %.2e  top-1 %lld/%lld\n",
                  name.c_str(), quant_type_name(v.dense), quant_type_name(v.experts), (long long)g, a.median_rel_l2(),
                  a.max_rel_l2, kl, (long long)a.top1_same, (long long)a.positions);
      EXPECT_LT(a.median_rel_l2(), v.median_l2);
      EXPECT_LT(kl, v.kl);
      EXPECT_GE(a.top1_same, v.top1 * a.positions);
      // Sharper: against f32 products on the dequantised weights themselves,
      // only the activations' int8 rounding differs.
      const std::string deq = path + ".deq.colibri";
      write_dense_dequantised(path, deq);
      const auto exact = forced_logits(deq, seqs);
      Agreement d;
      for (size_t s = 0; s < seqs.size(); ++s) compare(exact[s], got[s], fx.vocab, d);
      std::printf("[ info ] %-14s   vs dequantised weights: rel L2 median %.4f max %.4f  top-1 %lld/%lld\n", name.c_str(),
                  d.median_rel_l2(), d.max_rel_l2, (long long)d.top1_same, (long long)d.positions);
      EXPECT_LT(d.median_rel_l2(), v.vs_dequantised);
      auto outs = test::run_engine(path, fx.requests());
      for (const auto& o : outs) EXPECT_EQ(o.tokens.size(), static_cast<size_t>(fx.new_tokens));
    }
  }
}

TEST(QuantDense, BatchGivesBitwiseTheSequencesAlone) {
  // GQA (q, k, v sharing one quantisation of x), MLA with a q low rank, dense
  // layers and shared experts, gpt-oss biases and sinks.
  test::TempDir tmp;
  for (const char* name : {"mixtral_a", "deepseek_v3_b", "qwen2_moe_a", "gpt_oss_a"}) {
    SCOPED_TRACE(name);
    test::Fixture fx(name);
    const int64_t g = dense_group_for(ColibriFile::open(fx.convert(tmp, DType::F32))->config(), 32);
    for (QuantType t : kTypes) {
      expect_batch_equals_alone(convert_dense(fx, tmp, t, QuantType::None, g, DType::BF16), fixture_sequences(fx),
                                quant_type_name(t));
    }
  }
}

TEST(QuantDense, CodesMatchTheCheckpoint) {
  // mixtral_a: the LM head and layer 1's attention output hold exactly
  // quantize_row of each HF row: codes, then the f16 scales 64-byte aligned.
  test::TempDir tmp;
  test::Fixture fx("mixtral_a");
  SafetensorsFile st(fx.dir + "/hf/model.safetensors");
  for (QuantType t : kTypes) {
    SCOPED_TRACE(quant_type_name(t));
    auto file = ColibriFile::open(convert_dense(fx, tmp, t, QuantType::None, 16, DType::BF16));
    EXPECT_EQ(file->tensor("token_embd").dtype, DType::BF16);
    EXPECT_EQ(file->tensor("blk.0.ffn_gate_inp").dtype, DType::BF16);
    EXPECT_EQ(file->tensor("blk.0.ffn_gate_inp").quant, QuantType::None);
    for (const auto& [ours, theirs] : {std::pair{"output", "lm_head.weight"},
                                       std::pair{"blk.1.attn_output", "model.layers.1.self_attn.o_proj.weight"}}) {
      const TensorView& v = file->tensor(ours);
      const SafeTensor* s = st.find(theirs);
      ASSERT_NE(s, nullptr) << theirs;
      const int64_t rows = v.shape[0], cols = v.shape[1], G = 16;
      const uint64_t rb = quant_row_bytes(t, cols);
      EXPECT_EQ(reinterpret_cast<const uint8_t*>(v.scales), v.data + (rows * rb + 63) / 64 * 64);
      std::vector<float> row(static_cast<size_t>(cols));
      std::vector<uint8_t> qc(rb);
      std::vector<uint16_t> qs(static_cast<size_t>(cols / G));
      for (int64_t r = 0; r < rows; ++r) {
        convert_elements(s->data + r * cols * 4, DType::F32, row.data(), DType::F32, static_cast<size_t>(cols));
        ASSERT_TRUE(quantize_row(t, G, row.data(), cols, qc.data(), qs.data()));
        ASSERT_EQ(std::memcmp(qc.data(), v.data + r * rb, rb), 0) << ours << " row " << r;
        ASSERT_EQ(std::memcmp(qs.data(), v.scales + r * (cols / G), qs.size() * 2), 0) << ours << " row " << r;
      }
    }
  }
}

TEST(QuantDense, BadOptionsAndInconsistentFilesFailClearly) {
  test::TempDir tmp;
  test::Fixture fx("mixtral_a");  // H 64: every attention input is 64 wide
  {
    const std::string out = tmp.file("bad.colibri");
    ConvertOptions o;
    o.dense_quant = QuantType::Int8;
    o.group_size = 128;
    test::expect_error([&] { convert_checkpoint(fx.dir + "/hf", out, o); }, Status::InvalidArgument,
                       {"--quantize-dense with --group-size 128 would quantise no matrix"});
    EXPECT_FALSE(fs::exists(out));
    EXPECT_FALSE(test::temp_left(out));
  }
  const std::string hf = fx.dir + "/hf", out = tmp.file("cli.colibri");
  for (const auto& [args, needle] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--quantize-dense", "int2"}, "unknown --quantize-dense 'int2' (int8, int4)"},
           {{"--quantize-dense", "int8", "--group-size", "128"}, "would quantise no matrix"}}) {
    std::vector<std::string> a = {"convert", hf, out};
    a.insert(a.end(), args.begin(), args.end());
    auto r = test::run_cli(tmp, a);
    EXPECT_EQ(r.code, 11) << r.err;
    EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
    EXPECT_FALSE(fs::exists(out));
  }
  auto ok = test::run_cli(tmp, {"convert", hf, out, "--quantize-dense", "int8", "--quantize-experts", "int4", "--dtype", "bf16"});
  ASSERT_EQ(ok.code, 0) << ok.err;
  EXPECT_NE(ok.err.find("experts int4 group 32, 9 dense matrices int8 group 32"), std::string::npos) << ok.err;
  auto ins = test::run_cli(tmp, {"inspect", out});
  EXPECT_EQ(ins.code, 0) << ins.err;
  EXPECT_NE(ins.out.find("blk.1.attn_output                int8 g32"), std::string::npos) << ins.out;
  EXPECT_NE(ins.out.find("token_embd                       bf16"), std::string::npos) << ins.out;
  auto gen = test::run_cli(tmp, {"generate", "--model", out, "--prompt-ids", "1,2,3", "--max-new-tokens", "4"});
  EXPECT_EQ(gen.code, 0) << gen.err;

  // The reader: what a tensor's record says must agree with the config.
  const std::string q8_path = convert_dense(fx, tmp, QuantType::Int8, QuantType::None, 32);
  const std::string q8 = read_all(q8_path);
  const std::string plain = read_all(fx.convert(tmp, DType::F32));
  EXPECT_NE(q8.find("\"dense_quant\": {\n    \"group_size\": 32,\n    \"type\": \"int8\"\n  }"), std::string::npos);
  EXPECT_EQ(plain.find("dense_quant"), std::string::npos);
  const ColibriFile::Options no_verify{false};
  auto index_of = [&](const std::string& name) {
    auto f = ColibriFile::open(q8_path);
    for (size_t i = 0; i < f->tensors().size(); ++i)
      if (f->tensors()[i].name == name) return i;
    return size_t{0};
  };
  const size_t q_idx = index_of("blk.0.attn_q"), embd_idx = index_of("token_embd");
  ASSERT_NE(q_idx, embd_idx);
  struct Case {
    const char* name;
    const std::string* base;
    std::function<void(std::string&)> corrupt;
    std::vector<std::string> needles;
  };
  const std::vector<Case> cases = {
      {"type swapped", &q8, [](std::string& b) { test::edit_config(b, "\"int8\"", "\"int4\""); },
       {"is stored quantised (dtype 16) but the config's dense_quant is int4"}},
      {"group 48 unsupported", &q8, [](std::string& b) { test::edit_config(b, "\"group_size\": 32", "\"group_size\": 48"); },
       {"dense_quant.group_size 48 is not supported"}},
      {"config without dense_quant", &q8, [](std::string& b) { test::edit_config(b, "\"dense_quant\"", "\"dense_quanx\""); },
       {"is stored quantised (dtype 16) but the config's dense_quant is none"}},
      {"plain file, quantised record", &plain, [&](std::string& b) { edit_tensor(b, q_idx, [](TensorRecord& r) { r.dtype = 17; }); },
       {"is stored quantised (dtype 17) but the config's dense_quant is none"}},
      {"record says f32", &q8, [&](std::string& b) { edit_tensor(b, q_idx, [](TensorRecord& r) { r.dtype = 0; }); },
       {"tensor 'blk.0.attn_q' size", "does not match its shape and dtype"}},
      {"embedding stored quantised", &q8, [&](std::string& b) { edit_tensor(b, embd_idx, [](TensorRecord& r) {
         r.dtype = 16;
         r.size = quant_matrix_layout(QuantType::Int8, r.shape[0], r.shape[1], 32).size;
       }); },
       {"tensor 'token_embd' is stored int8 but the config's dense_quant says unquantised"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    std::string b = *c.base;
    c.corrupt(b);
    reseal(b);
    const std::string p = tmp.file("corrupt.colibri");
    write_all(p, b);
    test::expect_error([&] { ColibriFile::open(p, no_verify); }, Status::Format, c.needles);
  }
}

// ---------------------------------------------------------------------------
// Quality report (docs/quantization.md): disabled; run by hand with
//   colibri_tests --gtest_also_run_disabled_tests --gtest_filter='QuantQuality.*'
// COLIBRI_QUANT_MEDIUM=HF_DIR adds a synthesized model (reference: bf16).

namespace {

// Copies the checkpoint `hf` into `dir` (one safetensors file) with every routed
// expert matrix replaced, in f32, by the weights its `t` quantisation stands for
// (rows along the last dimension: the classic and the transformers-5 fused
// layouts); false for layouts it does not handle (gpt-oss).
bool write_dequantised_checkpoint(const std::string& hf, const std::string& dir, QuantType t, int64_t g) {
  Checkpoint ck(hf);
  auto expert_matrix = [](const std::string& n) {
    return (n.find(".block_sparse_moe.experts.") != std::string::npos || n.find(".mlp.experts.") != std::string::npos) &&
           n.find("bias") == std::string::npos;
  };
  std::vector<SafetensorsWriter::Spec> specs;
  for (const auto& n : ck.names()) {
    const SafeTensor& st = ck.get(n);
    if (!st.dtype) return false;  // MXFP4 blocks
    specs.push_back({n, expert_matrix(n) ? DType::F32 : *st.dtype, st.shape});
  }
  fs::create_directories(dir);
  fs::copy_file(hf + "/config.json", dir + "/config.json", fs::copy_options::overwrite_existing);
  SafetensorsWriter w(dir + "/model.safetensors", specs);
  std::vector<float> f;
  std::vector<uint8_t> codes;
  std::vector<uint16_t> sc;
  for (const auto& sp : specs) {
    const SafeTensor& st = ck.get(sp.name);
    if (!expert_matrix(sp.name)) {
      w.write_next(st.data, st.nbytes);
      continue;
    }
    const int64_t cols = st.shape.back(), rows = st.numel() / cols;
    if (cols % g != 0) return false;
    f.resize(static_cast<size_t>(st.numel()));
    convert_elements(st.data, *st.dtype, f.data(), DType::F32, f.size());
    codes.resize(quant_row_bytes(t, cols));
    sc.resize(static_cast<size_t>(cols / g));
    for (int64_t r = 0; r < rows; ++r) {
      if (!quantize_row(t, g, f.data() + r * cols, cols, codes.data(), sc.data())) return false;
      dequantize_row(t, g, codes.data(), sc.data(), cols, f.data() + r * cols);
    }
    w.write_next(f.data(), f.size() * sizeof(float));
  }
  w.finish();
  return true;
}

// One model's rows: the reference in `ref_dtype`, then int8 g32, int4 g32/64/128
// (group 16 where 32 does not divide a width; a larger group that does not divide
// is reported so), and for an f32 reference also bf16 storage of every matrix (the
// model's sensitivity to a 2^-9 relative perturbation, for scale).
void quality_rows(const std::string& label, const std::string& hf, DType ref_dtype, int seqs_n, int prompt_len,
                  int new_tokens, const test::TempDir& tmp) {
  ConvertOptions o;
  o.dtype = ref_dtype;
  const std::string ref_path = tmp.file(label + ".ref.colibri");
  convert_checkpoint(hf, ref_path, o);
  const ModelConfig cfg = ColibriFile::open(ref_path)->config();
  const int64_t V = cfg.vocab_size;
  // Random prompts (a fixed seed), the reference's greedy continuation, then both
  // models teacher-forced on prompt + continuation: every position compared.
  std::mt19937_64 rng(12345);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(V - 1));
  std::vector<Request> reqs;
  for (int s = 0; s < seqs_n; ++s) {
    Request q;
    for (int i = 0; i < prompt_len; ++i) q.prompt.push_back(tok(rng));
    q.max_new_tokens = new_tokens;
    q.ignore_eos = true;
    reqs.push_back(q);
  }
  auto gen = test::run_engine(ref_path, reqs);
  std::vector<std::vector<int32_t>> seqs;
  for (int s = 0; s < seqs_n; ++s) {
    auto v = reqs[s].prompt;
    v.insert(v.end(), gen[s].tokens.begin(), gen[s].tokens.end() - 1);
    seqs.push_back(v);
  }
  const auto ref = forced_logits(ref_path, seqs);
  // How peaked the reference is: mean top-1 probability and top-1 - top-2 logit margin.
  double p1 = 0, margin = 0;
  int64_t n = 0;
  for (const auto& l : ref)
    for (size_t p = 0; p < l.size() / V; ++p, ++n) {
      std::vector<float> row(l.begin() + p * V, l.begin() + (p + 1) * V);
      std::partial_sort(row.begin(), row.begin() + 2, row.end(), std::greater<float>());
      double z = 0;
      for (int64_t i = 0; i < V; ++i) z += std::exp(l[p * V + i] - row[0]);
      p1 += 1 / z;
      margin += row[0] - row[1];
    }
  auto row = [&](const std::string& what, int64_t g, const std::string& path) {
    const auto got = forced_logits(path, seqs);
    Agreement a;
    for (size_t s = 0; s < seqs.size(); ++s) compare(ref[s], got[s], V, a);
    std::printf("| %s | %s | %lld | %lld | %.2f%% | %.2e | %.4f | %.4f | %.4f / %.2f |\n", label.c_str(), what.c_str(),
                (long long)g, (long long)a.positions, 100.0 * a.top1_same / a.positions, a.kl_sum / a.positions,
                a.median_rel_l2(), a.max_rel_l2, p1 / n, margin / n);
    std::fflush(stdout);
  };
  if (ref_dtype == DType::F32) {
    ConvertOptions bo;
    bo.dtype = DType::BF16;
    const std::string bp = tmp.file(label + ".bf16.colibri");
    convert_checkpoint(hf, bp, bo);
    row("bf16 (baseline)", 0, bp);
    fs::remove(bp);
  }
  for (auto [t, want_g] : {std::pair{QuantType::Int8, 32}, std::pair{QuantType::Int4, 32}, std::pair{QuantType::Int4, 64},
                           std::pair{QuantType::Int4, 128}}) {
    const int64_t g = group_for(cfg, want_g);
    if (g != want_g && want_g > 32) {
      std::printf("| %s | %s | %d | does not divide H %lld / I %lld | | | | | |\n", label.c_str(), quant_type_name(t), want_g,
                  (long long)cfg.hidden_size, (long long)cfg.intermediate_size);
      continue;
    }
    ConvertOptions qo = o;
    qo.expert_quant = t;
    qo.group_size = g;
    const std::string qp = tmp.file(label + ".q.colibri");
    convert_checkpoint(hf, qp, qo);
    row(quant_type_name(t), g, qp);
    fs::remove(qp);
    // The same weights with f32 activations: what the activation quantisation costs.
    if (want_g == 32 && cfg.architecture != "gpt_oss") {
      const std::string dq = tmp.file(label + ".dq"), dp = tmp.file(label + ".dq.colibri");
      if (write_dequantised_checkpoint(hf, dq, t, g)) {
        ConvertOptions fo;
        fo.dtype = DType::F32;
        convert_checkpoint(dq, dp, fo);
        fs::remove_all(dq);
        row(std::string(quant_type_name(t)) + " weights, f32 activations", g, dp);
        fs::remove(dp);
      }
    }
  }
  // The dense matrices quantised too (--quantize-dense), group 32 where it
  // divides the hidden size (else 16).
  const int64_t gd = std::min(group_for(cfg, 32), cfg.hidden_size % 32 == 0 ? int64_t{32} : int64_t{16});
  for (auto [te, td] : {std::pair{QuantType::Int8, QuantType::Int8}, std::pair{QuantType::Int4, QuantType::Int8},
                        std::pair{QuantType::Int4, QuantType::Int4}}) {
    ConvertOptions qo = o;
    qo.expert_quant = te;
    qo.dense_quant = td;
    qo.group_size = gd;
    const std::string qp = tmp.file(label + ".qd.colibri");
    convert_checkpoint(hf, qp, qo);
    row(std::string(quant_type_name(te)) + ", dense " + quant_type_name(td), gd, qp);
    fs::remove(qp);
  }
  fs::remove(ref_path);
}

}  // namespace

TEST(QuantQuality, DISABLED_Report) {
  test::TempDir tmp;
  std::printf("| model | experts | group | positions | top-1 agreement | mean KL | median rel L2 | max rel L2 | "
              "reference p(top-1) / margin |\n|---|---|---|---|---|---|---|---|---|\n");
  if (!std::getenv("COLIBRI_QUANT_SKIP_FIXTURES"))
    for (const auto& name : test::fixture_names())
      quality_rows(name, test::fixtures_dir() + "/" + name + "/hf", DType::F32, 8, 16, 48, tmp);
  if (const char* m = std::getenv("COLIBRI_QUANT_MEDIUM")) quality_rows("medium", m, DType::BF16, 4, 32, 96, tmp);
}
