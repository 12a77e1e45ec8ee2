// cuda_fp16.h of the CPU emulator: IEEE half precision as its bits.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

struct __half {
  uint16_t __x;
};
typedef __half half;

inline __half __ushort_as_half(unsigned short u) { return __half{u}; }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline float __half2float(__half h) {
  const int sign = h.__x >> 15, e = (h.__x >> 10) & 31, m = h.__x & 1023;
  float v;
  if (e == 0) v = std::ldexp(static_cast<float>(m), -24);  // zero and subnormals
  else if (e == 31) v = m ? NAN : INFINITY;
  else v = std::ldexp(1.0f + static_cast<float>(m) / 1024.0f, e - 15);
  return sign ? -v : v;
}
// Round to nearest even, as the GPU's cvt.rn.f16.f32 (overflow to infinity,
// subnormals kept, every NaN the canonical 0x7fff).
inline __half __float2half_rn(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return __half{0x7fff};  // NaN
  if (a >= 0x477ff000u) return __half{static_cast<uint16_t>(sign | 0x7c00u)};  // rounds to >= 65520: infinity
  if (a < 0x38800000u) {  // below the smallest normal half (2^-14): a subnormal or zero
    if (a < 0x33000000u) return __half{sign};  // below half the smallest subnormal (2^-25): zero
    const uint32_t m = (a & 0x7fffffu) | 0x800000u;
    const int shift = 126 - static_cast<int>(a >> 23);  // 14 + (113 - e): value = m * 2^(e - 150), units of 2^-24
    const uint32_t q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    const uint32_t r = q + (rem > half || (rem == half && (q & 1u)));
    return __half{static_cast<uint16_t>(sign | r)};
  }
  const uint32_t e = (a >> 23) - 112, m = a & 0x7fffffu;  // rebias 127 -> 15
  uint32_t h = (e << 10) | (m >> 13);
  const uint32_t rem = m & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // may carry into the exponent: still right
  return __half{static_cast<uint16_t>(sign | h)};
}
inline __half __float2half(float f) { return __float2half_rn(f); }
