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
