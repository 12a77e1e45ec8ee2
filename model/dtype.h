// dtype.h: element types of stored weights and their conversions to and from f32.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

namespace colibri {

// NOTE: the numeric values are part of the .colibri file format; never renumber.
enum class DType : uint32_t { F32 = 0, F16 = 1, BF16 = 2 };

size_t dtype_size(DType t);
const char* dtype_name(DType t);                           // "f32", "f16", "bf16"
std::optional<DType> dtype_from_name(std::string_view s);  // accepts f32/float32/F32, ...
bool dtype_valid(uint32_t raw);

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even; NaN stays NaN (quiet).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// IEEE binary16 as a C++ type: _Float16 (GCC 12+ on x86-64), or on aarch64, whose
// GCC 12 has no _Float16 in C++, __fp16: the same format there (IEEE, not ARM's
// alternative), converted from float exactly as _Float16 is (round to nearest
// even, one FCVT instruction).
#if defined(__aarch64__)
using Float16 = __fp16;
#else
using Float16 = _Float16;
#endif

inline float f16_to_f32(uint16_t h) {
  Float16 v;
  std::memcpy(&v, &h, 2);
  return static_cast<float>(v);
}

inline uint16_t f32_to_f16(float f) {
  Float16 v = static_cast<Float16>(f);
  uint16_t h;
  std::memcpy(&h, &v, 2);
  return h;
}

// Converts n elements of type `from` at src to type `to` at dst.
void convert_elements(const void* src, DType from, void* dst, DType to, size_t n);
// Index of the first NaN or infinite element among n of type t, or -1 if all
// are finite (bit tests: no conversion).
int64_t find_non_finite(const void* data, DType t, size_t n);

}  // namespace colibri
