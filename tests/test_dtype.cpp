// test_dtype.cpp: f32 <-> bf16/f16 conversions against exhaustive references.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "model/dtype.h"
#include "tests/test_util.h"

using namespace colibri;

TEST(DType, NamesAndSizes) {
  EXPECT_EQ(dtype_size(DType::F32), 4u);
  EXPECT_EQ(dtype_size(DType::F16), 2u);
  EXPECT_EQ(dtype_size(DType::BF16), 2u);
  EXPECT_EQ(dtype_from_name("bfloat16"), DType::BF16);
  EXPECT_EQ(dtype_from_name("F16"), DType::F16);
  EXPECT_FALSE(dtype_from_name("int8").has_value());
  EXPECT_FALSE(dtype_valid(3));
}

TEST(DType, Bf16RoundTripsEveryValue) {
  int checked = 0;
  for (uint32_t h = 0; h < 65536; ++h) {
    float f = bf16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(f))));
      continue;
    }
    ASSERT_EQ(f32_to_bf16(f), h) << "bf16 bits " << h;
    ++checked;
  }
  EXPECT_GT(checked, 65000);
}

TEST(DType, Bf16RoundsToNearestEven) {
  // 1 + 2^-8 is exactly halfway between bf16 1.0 and 1 + 2^-7: ties to even (1.0).
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 0x1p-8f)), 1.0f);
  // Slightly above halfway rounds up.
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 0x1p-8f + 0x1p-20f)), 1.0f + 0x1p-7f);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even): up.
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 3 * 0x1p-8f)), 1.0f + 0x1p-6f);
}

TEST(DType, F16RoundTripsEveryValue) {
  for (uint32_t h = 0; h < 65536; ++h) {
    float f = f16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(f32_to_f16(f), h) << "f16 bits " << h;
  }
  EXPECT_EQ(f16_to_f32(0x3c00), 1.0f);
  EXPECT_EQ(f16_to_f32(0x7bff), 65504.0f);
  EXPECT_TRUE(std::isinf(f16_to_f32(f32_to_f16(1e6f))));
}

TEST(DType, ConvertElementsMatchesScalar) {
  uint64_t seed = test::test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  auto v = test::random_floats(rng, 1001, -100.f, 100.f);
  std::vector<uint16_t> b(v.size()), h(v.size());
  convert_elements(v.data(), DType::F32, b.data(), DType::BF16, v.size());
  convert_elements(v.data(), DType::F32, h.data(), DType::F16, v.size());
  std::vector<float> back(v.size());
  convert_elements(b.data(), DType::BF16, back.data(), DType::F32, v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    ASSERT_EQ(b[i], f32_to_bf16(v[i]));
    ASSERT_EQ(h[i], f32_to_f16(v[i]));
    ASSERT_EQ(back[i], bf16_to_f32(b[i]));
    ASSERT_NEAR(back[i], v[i], std::fabs(v[i]) * 0x1p-8f);
  }
}
