// quant.cpp: quantisation and dequantisation of expert weight rows (see quant.h).
#include "model/quant.h"

#include <algorithm>
#include <cmath>

#include "model/dtype.h"

namespace colibri {

const char* quant_type_name(QuantType t) {
  switch (t) {
    case QuantType::None: return "none";
    case QuantType::Int8: return "int8";
    case QuantType::Int4: return "int4";
  }
  return "invalid";
}

bool quant_type_from_name(std::string_view s, QuantType* out) {
  if (s == "none") *out = QuantType::None;
  else if (s == "int8") *out = QuantType::Int8;
  else if (s == "int4") *out = QuantType::Int4;
  else return false;
  return true;
}

bool quant_group_supported(int64_t g) {
  for (int s : kQuantGroupSizes)
    if (g == s) return true;
  return false;
}

uint32_t quant_storage_code(QuantType t) {
  switch (t) {
    case QuantType::Int8: return kExpertStorageInt8;
    case QuantType::Int4: return kExpertStorageInt4;
    case QuantType::None: break;
  }
  return 0;
}

int quant_code(QuantType t, int64_t group, const uint8_t* codes, int64_t i) {
  if (t == QuantType::Int8) return static_cast<int8_t>(codes[i]);
  const int64_t P = quant_unit(group), half = P / 2, unit = i / P, j = i % P;
  const uint8_t b = codes[unit * half + (j % half)];
  return static_cast<int>(j < half ? (b & 0x0F) : (b >> 4)) - 8;
}

bool quantize_row(QuantType t, int64_t group, const float* w, int64_t cols, uint8_t* codes, uint16_t* scales) {
  const bool i4 = t == QuantType::Int4;
  const int lo = i4 ? -8 : -127, hi = i4 ? 7 : 127;
  std::fill(codes, codes + quant_row_bytes(t, cols), uint8_t{0});
  for (int64_t g = 0; g < cols / group; ++g) {
    const float* x = w + g * group;
    float amax = 0.f, m = 0.f;
    for (int64_t i = 0; i < group; ++i) {
      if (!std::isfinite(x[i])) return false;
      if (std::fabs(x[i]) > amax) amax = std::fabs(x[i]), m = x[i];
    }
    // int8: d = amax / 127 > 0; int4: d = m / -8 (the extreme element maps to -8).
    const uint16_t h = f32_to_f16(i4 ? m / -8.0f : amax / 127.0f);
    const float d = f16_to_f32(h);
    if (!std::isfinite(d)) return false;
    scales[g] = h;
    for (int64_t i = 0; i < group; ++i) {
      const int q = d == 0.f ? 0 : static_cast<int>(std::clamp(std::nearbyint(x[i] / d), float(lo), float(hi)));
      const int64_t e = g * group + i;
      if (!i4) {
        codes[e] = static_cast<uint8_t>(static_cast<int8_t>(q));
      } else {
        const int64_t P = quant_unit(group), half = P / 2, unit = e / P, j = e % P;
        uint8_t& b = codes[unit * half + (j % half)];
        const uint8_t u = static_cast<uint8_t>(q + 8);
        b = j < half ? static_cast<uint8_t>((b & 0xF0) | u) : static_cast<uint8_t>((b & 0x0F) | (u << 4));
      }
    }
  }
  return true;
}

void dequantize_row(QuantType t, int64_t group, const uint8_t* codes, const uint16_t* scales, int64_t cols, float* out) {
  for (int64_t i = 0; i < cols; ++i)
    out[i] = static_cast<float>(quant_code(t, group, codes, i)) * f16_to_f32(scales[i / group]);
}

}  // namespace colibri
