// cuda_checks.h: the checks of the CUDA kernels against CPU references (Gemm,
// FfnRunner, to_bf16, the dense layers of kernels/cuda/dense.h), shared by
// tests/cuda_check.cu (on a GPU, with nvcc) and tests/cuda_emu/emu_check.cpp (the
// same checks on the CPU, through the SIMT emulator: ctest cuda.emulated.*).
// What is checked, and how, is described at the top of tests/cuda_check.cu.
// Host code only (no kernels): compiled by nvcc and by a plain C++ compiler
// against tests/cuda_emu/include's CUDA headers. For one translation unit.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/dense.h"
#include "kernels/cuda/ffn.h"
#include "model/error.h"

using namespace colibri;
using namespace colibri::cuda;

namespace {

int failures = 0, checks = 0;

#define CHECK(cond, ...)                                    \
  do {                                                      \
    ++checks;                                               \
    if (!(cond)) {                                          \
      ++failures;                                           \
      std::printf("FAIL %s:%d: ", __FILE__, __LINE__);      \
      std::printf(__VA_ARGS__);                             \
      std::printf("\n");                                    \
    }                                                       \
  } while (0)

uint16_t bf16_of(float f) {  // round to nearest even (as model/dtype.h)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float f32_of(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

std::vector<uint16_t> random_bf16(std::mt19937_64& rng, size_t n, float scale) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = bf16_of(d(rng));
  return v;
}

template <class T>
DeviceBuffer upload(const std::vector<T>& v) {
  DeviceBuffer b(v.size() * sizeof(T));
  b.upload(v.data(), v.size() * sizeof(T));
  return b;
}

DeviceBuffer nan_buffer(size_t floats) {
  std::vector<float> v(floats, std::nanf(""));
  return upload(v);
}

template <class F>
bool throws_invalid(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.status() == Status::InvalidArgument;
  }
  return false;
}

void check_to_bf16(std::mt19937_64& rng) {
  std::normal_distribution<float> d(0.0f, 3.0f);
  std::vector<float> x(10007);
  for (auto& v : x) v = d(rng);
  x[0] = 0.0f, x[1] = -0.0f, x[2] = 1.0f + 1.0f / 256, x[3] = 1.0f + 3.0f / 256, x[4] = 65504.0f, x[5] = 1e-30f;
  DeviceBuffer dx = upload(x), dy(x.size() * 2);
  to_bf16(dx.as<float>(), dy.as<uint16_t>(), static_cast<int64_t>(x.size()));
  synchronize();
  std::vector<uint16_t> y(x.size());
  dy.download(y.data(), y.size() * 2);
  size_t bad = 0;
  for (size_t i = 0; i < x.size(); ++i) bad += y[i] != bf16_of(x[i]);
  CHECK(bad == 0, "to_bf16: %zu of %zu elements differ from round-to-nearest-even", bad, x.size());
}

void check_gemm(std::mt19937_64& rng) {
  Gemm gemm;
  const int64_t shapes[][3] = {{1, 256, 128}, {7, 512, 96}, {64, 1024, 384}, {512, 256, 1024}, {3, 4096, 64}};
  for (const auto& s : shapes) {
    const int64_t rows = s[0], in = s[1], out = s[2];
    const auto x = random_bf16(rng, static_cast<size_t>(rows * in), 1.0f);
    const auto w = random_bf16(rng, static_cast<size_t>(out * in), 1.0f / std::sqrt(static_cast<float>(in)));
    DeviceBuffer dx = upload(x), dw = upload(w), dy = nan_buffer(static_cast<size_t>(rows * out));
    gemm.run(dw.as<uint16_t>(), out, in, dx.as<uint16_t>(), rows, dy.as<float>());
    synchronize();
    std::vector<float> y(static_cast<size_t>(rows * out));
    dy.download(y.data(), y.size() * 4);
    double worst = 0;
    size_t bad = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t o = 0; o < out; ++o) {
        double ref = 0, mag = 0;
        for (int64_t k = 0; k < in; ++k) {
          const double p = static_cast<double>(f32_of(x[r * in + k])) * f32_of(w[o * in + k]);
          ref += p;
          mag += std::fabs(p);
        }
        const double got = y[static_cast<size_t>(r * out + o)];
        const double err = std::fabs(got - ref);
        if (!(err <= 1e-3 * mag + 1e-6)) ++bad;  // NaN (unwritten) fails too
        worst = std::max(worst, err / (mag + 1e-30));
      }
    CHECK(bad == 0, "Gemm %lld x %lld . (%lld x %lld)^T: %zu elements off (worst relative %.3g)", (long long)rows,
          (long long)in, (long long)out, (long long)in, bad, worst);
  }
}

// The FFN on the CPU in double, from the same bf16 weights; x and h rounded to
// bf16 as the GPU rounds them.
std::vector<double> cpu_ffn(const FfnShape& s, const std::vector<uint16_t>& gate_up, const std::vector<uint16_t>& down,
                            const std::vector<float>* biases, const std::vector<float>& x, int64_t rows) {
  const int64_t H = s.hidden, I = s.inter;
  std::vector<double> y(static_cast<size_t>(rows * H));
  std::vector<float> h(static_cast<size_t>(I));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < I; ++i) {
      double g = 0, u = 0;
      for (int64_t k = 0; k < H; ++k) {
        const double xv = f32_of(bf16_of(x[r * H + k]));
        g += xv * f32_of(gate_up[i * H + k]);
        u += xv * f32_of(gate_up[(I + i) * H + k]);
      }
      float gf = static_cast<float>(g), uf = static_cast<float>(u), v;
      if (biases) gf += (*biases)[i], uf += (*biases)[I + i];
      if (s.oai) {
        const float gv = std::min(gf, s.limit), uv = std::clamp(uf, -s.limit, s.limit);
        v = (uv + 1.0f) * (gv / (1.0f + std::exp(-(gv * s.alpha))));
      } else {
        v = gf / (1.0f + std::exp(-gf)) * uf;
      }
      h[i] = f32_of(bf16_of(v));
    }
    for (int64_t o = 0; o < H; ++o) {
      double acc = 0;
      for (int64_t i = 0; i < I; ++i) acc += static_cast<double>(h[i]) * f32_of(down[o * I + i]);
      if (biases) acc += (*biases)[2 * I + o];
      y[static_cast<size_t>(r * H + o)] = acc;
    }
  }
  return y;
}

const void* x_dummy() {
  static std::vector<char> v(1 << 20);
  return v.data();
}

// offset: the rows start this many rows into their buffers (x and y then need
// not be 256-byte aligned: hidden 200 puts them 800 bytes in).
void check_ffn(std::mt19937_64& rng, bool oai, int64_t hidden = 256, int64_t inter = 384, int64_t offset = 0) {
  FfnShape s;
  s.hidden = hidden, s.inter = inter, s.oai = oai;
  const PackedFfnLayout l = PackedFfnLayout::of(s, oai);
  const int64_t H = s.hidden, I = s.inter;
  const auto gate_up = random_bf16(rng, static_cast<size_t>(2 * I * H), 2.0f / std::sqrt(static_cast<float>(H)));
  const auto down = random_bf16(rng, static_cast<size_t>(H * I), 1.0f / std::sqrt(static_cast<float>(I)));
  std::vector<float> biases;
  std::normal_distribution<float> d(0.0f, 0.5f);
  if (oai)
    for (int64_t i = 0; i < 2 * I + H; ++i) biases.push_back(d(rng));
  // The packed block, built here (the library's pack_ffn is tested on the CPU).
  std::vector<char> block(l.bytes, 0);
  std::memcpy(block.data() + l.gate_up, gate_up.data(), gate_up.size() * 2);
  std::memcpy(block.data() + l.down, down.data(), down.size() * 2);
  if (oai) {
    std::memcpy(block.data() + l.gate_bias, biases.data(), static_cast<size_t>(I) * 4);
    std::memcpy(block.data() + l.up_bias, biases.data() + I, static_cast<size_t>(I) * 4);
    std::memcpy(block.data() + l.down_bias, biases.data() + 2 * I, static_cast<size_t>(H) * 4);
  }
  DeviceBuffer dw = upload(block);
  const DeviceFfn w = DeviceFfn::at(dw.get(), l);
  FfnRunner runner(s, 64);
  for (int64_t rows : {1, 3, 16, 64}) {
    std::vector<float> x(static_cast<size_t>(rows * H));
    for (auto& v : x) v = d(rng) * 2.0f;
    std::vector<float> xo(static_cast<size_t>(offset * H), 0.0f);
    xo.insert(xo.end(), x.begin(), x.end());
    DeviceBuffer dx = upload(xo), dy = nan_buffer(static_cast<size_t>((rows + offset) * H));
    runner.run(w, dx.as<float>() + offset * H, rows, dy.as<float>() + offset * H);
    synchronize();
    std::vector<float> y(static_cast<size_t>(rows * H));
    dy.download(y.data(), y.size() * 4, static_cast<size_t>(offset * H) * 4);
    const auto ref = cpu_ffn(s, gate_up, down, oai ? &biases : nullptr, x, rows);
    double peak = 0, worst = 0;
    for (double v : ref) peak = std::max(peak, std::fabs(v));
    size_t bad = 0;
    for (size_t i = 0; i < y.size(); ++i) {
      const double err = std::fabs(y[i] - ref[i]);
      if (!(err <= 2e-3 * peak + 1e-5)) ++bad;
      worst = std::max(worst, err);
    }
    CHECK(bad == 0, "FFN (%s, hidden %lld, inter %lld, offset %lld rows) rows %lld: %zu of %zu elements off (worst %.3g, "
          "max |y| %.3g)", oai ? "oai" : "silu", (long long)H, (long long)I, (long long)offset, (long long)rows, bad,
          y.size(), worst, peak);
  }
  CHECK(throws_invalid([&] { runner.run(w, nullptr, 65, nullptr); }), "FfnRunner accepted 65 rows (sized for 64)");
  DeviceBuffer dx(static_cast<size_t>(H) * 4), dy(static_cast<size_t>(H) * 4);
  CHECK(throws_invalid([&] { runner.run(w, nullptr, 1, dy.as<float>()); }), "FfnRunner accepted a null input");
  CHECK(throws_invalid([&] { dx.upload(x_dummy(), static_cast<size_t>(H) * 4 + 4); }), "upload past the end accepted");
}

// ---- dense layers (kernels/cuda/dense.h) -----------------------------------------

const float kNaN = std::nanf("");

std::vector<float> random_f32(std::mt19937_64& rng, size_t n, float scale, float mean = 0.0f) {
  std::normal_distribution<float> d(mean, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

template <class T>
std::vector<T> download(const DeviceBuffer& b, size_t n, size_t offset_elems = 0) {
  std::vector<T> v(n);
  b.download(v.data(), n * sizeof(T), offset_elems * sizeof(T));
  return v;
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

// Elements of a strided [rows][ld] buffer outside the first `width` of each row
// (and past the last row) must still be NaN: nothing wrote there.
size_t pads_written(const std::vector<float>& y, int64_t rows, int64_t width, int64_t ld) {
  size_t bad = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    const int64_t r = static_cast<int64_t>(i) / ld, c = static_cast<int64_t>(i) % ld;
    if ((r >= rows || c >= width) && !std::isnan(y[i])) ++bad;
  }
  return bad;
}

void check_elementwise(std::mt19937_64& rng) {
  {  // add
    const size_t n = 10007;
    const auto x = random_f32(rng, n, 1.0f), r = random_f32(rng, n, 1.0f);
    DeviceBuffer dx = upload(x), dr = upload(r);
    add(dx.as<float>(), dr.as<float>(), static_cast<int64_t>(n), nullptr);
    synchronize();
    const auto y = download<float>(dx, n);
    size_t bad = 0;
    for (size_t i = 0; i < n; ++i) bad += !same_bits(y[i], x[i] + r[i]);
    CHECK(bad == 0, "add: %zu of %zu elements differ", bad, n);
  }
  {  // add_bias: rows 5 of width 70, 75 apart; the pads keep their values
    const int64_t rows = 5, width = 70, ld = 75;
    const auto y0 = random_f32(rng, static_cast<size_t>(rows * ld), 1.0f), b = random_f32(rng, width, 1.0f);
    DeviceBuffer dy = upload(y0), db = upload(b);
    add_bias(dy.as<float>(), rows, width, ld, db.as<float>(), nullptr);
    synchronize();
    const auto y = download<float>(dy, y0.size());
    size_t bad = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < ld; ++i) {
        const size_t at = static_cast<size_t>(r * ld + i);
        bad += !same_bits(y[at], i < width ? y0[at] + b[static_cast<size_t>(i)] : y0[at]);
      }
    CHECK(bad == 0, "add_bias: %zu elements differ", bad);
  }
  {  // clamp: std::clamp, NaN stays NaN
    const size_t n = 3001;
    auto x = random_f32(rng, n, 3.0f);
    x[3] = kNaN;
    x[4] = INFINITY;
    x[5] = -INFINITY;
    const float limit = 2.5f;
    DeviceBuffer dx = upload(x);
    clamp(dx.as<float>(), static_cast<int64_t>(n), limit, nullptr);
    synchronize();
    const auto y = download<float>(dx, n);
    size_t bad = 0;
    for (size_t i = 0; i < n; ++i) {
      const float ref = std::isnan(x[i]) ? x[i] : std::clamp(x[i], -limit, limit);
      bad += !(same_bits(y[i], ref) || (std::isnan(ref) && std::isnan(y[i])));
    }
    CHECK(bad == 0, "clamp: %zu of %zu elements differ", bad, n);
  }
  {  // copy_rows: 6 rows of 50, 64 apart into 57 apart
    const int64_t rows = 6, width = 50, lds = 64, ldd = 57;
    const auto src = random_f32(rng, static_cast<size_t>(rows * lds), 1.0f);
    DeviceBuffer ds = upload(src), dd = nan_buffer(static_cast<size_t>(rows * ldd));
    copy_rows(ds.as<float>(), lds, dd.as<float>(), ldd, rows, width, nullptr);
    synchronize();
    const auto d = download<float>(dd, static_cast<size_t>(rows * ldd));
    size_t bad = pads_written(d, rows, width, ldd);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < width; ++i)
        bad += !same_bits(d[static_cast<size_t>(r * ldd + i)], src[static_cast<size_t>(r * lds + i)]);
    CHECK(bad == 0, "copy_rows: %zu elements differ", bad);
  }
  CHECK(throws_invalid([] { copy_rows(nullptr, 4, nullptr, 8, 2, 5, nullptr); }), "copy_rows accepted lds < width");
  CHECK(throws_invalid([] { add(nullptr, nullptr, -1, nullptr); }), "add accepted a negative size");
}

void check_rmsnorm(std::mt19937_64& rng) {
  struct Case {
    int64_t rows, n, ldx, ldy;
    bool in_place;
  };
  // Scalar path (odd strides), the float4 path, per-head norms in place, n = 1.
  const Case cases[] = {{5, 1000, 1003, 1010, false}, {7, 4096, 4096, 4096, false}, {24, 128, 128, 128, true},
                        {2, 1, 1, 1, false},           {3, 576, 600, 600, true}};
  const float eps = 1e-6f;
  for (const auto& c : cases) {
    const auto x = random_f32(rng, static_cast<size_t>(c.rows * c.ldx), 1.0f);
    const auto w = random_f32(rng, static_cast<size_t>(c.n), 0.2f, 1.0f);
    DeviceBuffer dx = upload(x), dw = upload(w), dy = nan_buffer(static_cast<size_t>(c.rows * c.ldy));
    float* out = c.in_place ? dx.as<float>() : dy.as<float>();
    const int64_t ldy = c.in_place ? c.ldx : c.ldy;
    rmsnorm(dx.as<float>(), c.ldx, dw.as<float>(), out, ldy, c.rows, c.n, eps, nullptr);
    synchronize();
    const auto y = download<float>(c.in_place ? dx : dy, static_cast<size_t>(c.rows * ldy));
    size_t bad = c.in_place ? 0 : pads_written(y, c.rows, c.n, ldy);
    double worst = 0;
    for (int64_t r = 0; r < c.rows; ++r) {
      double ss = 0;
      for (int64_t i = 0; i < c.n; ++i) ss += static_cast<double>(x[r * c.ldx + i]) * x[r * c.ldx + i];
      const double inv = 1.0 / std::sqrt(ss / static_cast<double>(c.n) + eps);
      for (int64_t i = 0; i < ldy; ++i) {
        const float got = y[static_cast<size_t>(r * ldy + i)];
        if (i >= c.n) {
          if (c.in_place) bad += !same_bits(got, x[static_cast<size_t>(r * c.ldx + i)]);
          continue;
        }
        const double ref = x[r * c.ldx + i] * inv * w[i];
        const double err = std::fabs(got - ref);
        if (!(err <= 1e-5 * std::fabs(ref) + 1e-6)) ++bad;
        worst = std::max(worst, err);
      }
    }
    CHECK(bad == 0, "rmsnorm %lld rows of %lld (ldx %lld, ldy %lld, %s): %zu elements off (worst %.3g)",
          (long long)c.rows, (long long)c.n, (long long)c.ldx, (long long)ldy, c.in_place ? "in place" : "out of place",
          bad, worst);
  }
  CHECK(throws_invalid([] { rmsnorm(nullptr, 10, nullptr, nullptr, 20, 1, 16, 1e-6f, nullptr); }),
        "rmsnorm accepted ldx < n");
}

void check_rope(std::mt19937_64& rng) {
  const int64_t rows = 4, heads = 3, hd = 64, rd = 32, half = rd / 2, ld = heads * hd + 5, P = 50;
  std::vector<float> cs(static_cast<size_t>(P * half)), sn(cs.size());
  for (int64_t p = 0; p < P; ++p)
    for (int64_t i = 0; i < half; ++i) {
      const double a = p * std::pow(10000.0, -2.0 * i / rd);
      cs[static_cast<size_t>(p * half + i)] = static_cast<float>(std::cos(a));
      sn[static_cast<size_t>(p * half + i)] = static_cast<float>(std::sin(a));
    }
  std::vector<int32_t> pos(rows);
  std::uniform_int_distribution<int32_t> pd(0, static_cast<int32_t>(P - 1));
  for (auto& p : pos) p = pd(rng);
  DeviceBuffer dc = upload(cs), ds = upload(sn), dp = upload(pos);
  for (bool inter : {false, true}) {
    const auto x = random_f32(rng, static_cast<size_t>(rows * ld), 1.0f);
    DeviceBuffer dx = upload(x);
    rope(dx.as<float>(), rows, ld, heads, hd, rd, inter, dc.as<float>(), ds.as<float>(), dp.as<int32_t>(), nullptr);
    synchronize();
    const auto y = download<float>(dx, x.size());
    size_t bad = 0;
    for (int64_t r = 0; r < rows; ++r) {
      std::vector<float> ref(x.begin() + r * ld, x.begin() + (r + 1) * ld);  // unrotated parts unchanged
      for (int64_t h = 0; h < heads; ++h) {
        const float* v = x.data() + r * ld + h * hd;
        for (int64_t i = 0; i < half; ++i) {
          const double a = inter ? v[2 * i] : v[i], b = inter ? v[2 * i + 1] : v[i + half];
          const double c = cs[static_cast<size_t>(pos[r] * half + i)], s = sn[static_cast<size_t>(pos[r] * half + i)];
          ref[static_cast<size_t>(h * hd + i)] = static_cast<float>(a * c - b * s);
          ref[static_cast<size_t>(h * hd + i + half)] = static_cast<float>(b * c + a * s);
        }
      }
      for (int64_t i = 0; i < ld; ++i) {
        const float got = y[static_cast<size_t>(r * ld + i)], want = ref[static_cast<size_t>(i)];
        const int64_t in_head = i % hd;
        if (i < heads * hd && in_head < rd) bad += !(std::fabs(got - want) <= 1e-6f * (std::fabs(want) + 2.0f));
        else bad += !same_bits(got, want);
      }
    }
    CHECK(bad == 0, "rope (%s, %lld heads, rd %lld of %lld): %zu elements off", inter ? "interleaved" : "half",
          (long long)heads, (long long)rd, (long long)hd, bad);
  }
  CHECK(throws_invalid([] { rope(nullptr, 1, 64, 1, 64, 33, false, nullptr, nullptr, nullptr, nullptr); }),
        "rope accepted an odd rotary width");
}

float half_to_float(uint16_t h) {
  const int sign = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  const float v = e == 0 ? std::ldexp(static_cast<float>(m), -24) : std::ldexp(1.0f + m / 1024.0f, e - 15);
  return sign ? -v : v;
}

// A stored 16-bit value (dtype 1: f16, 2: bf16) widened to f32.
float widen_16(uint16_t h, int dt) { return dt == 1 ? half_to_float(h) : f32_of(h); }

// Whether h is x rounded to the nearest value of its type, ties to even (finite
// x within the type's range). bf16 against bf16_of; f16 by comparing with both
// neighbours of h, so that no second implementation of the rounding is trusted.
bool nearest_16(float x, uint16_t h, int dt) {
  if (dt == 2) return h == bf16_of(x);
  if (((h >> 10) & 31) == 31) return false;  // no infinity or NaN for finite inputs in range
  const uint16_t sign = h & 0x8000, m = h & 0x7fff;
  if (m == 0) return std::fabs(static_cast<double>(x)) <= std::ldexp(1.0, -25);  // zero: at most half the least subnormal
  if ((x < 0) != (sign != 0)) return false;
  const double ax = std::fabs(static_cast<double>(x));
  const double d = std::fabs(ax - std::fabs(static_cast<double>(half_to_float(m))));
  const double dlo = std::fabs(ax - std::fabs(static_cast<double>(half_to_float(static_cast<uint16_t>(m - 1)))));
  const double dhi = m + 1 < 0x7c00 ? std::fabs(ax - std::fabs(static_cast<double>(half_to_float(static_cast<uint16_t>(m + 1)))))
                                    : INFINITY;
  if (d > dlo || d > dhi) return false;
  return (d < dlo && d < dhi) || (m & 1) == 0;  // a tie goes to the even one
}

void check_embed(std::mt19937_64& rng) {
  const int64_t vocab = 37, hidden = 72, rows = 9;
  std::vector<int32_t> tok(rows);
  std::uniform_int_distribution<int32_t> td(0, static_cast<int32_t>(vocab - 1));
  for (auto& t : tok) t = td(rng);
  tok[1] = tok[0];  // a repeat
  DeviceBuffer dt = upload(tok);
  const size_t n = static_cast<size_t>(vocab * hidden);
  for (int dtype = 0; dtype < 3; ++dtype) {
    std::vector<float> ref_table(n);
    DeviceBuffer table;
    if (dtype == 0) {
      ref_table = random_f32(rng, n, 1.0f);
      table = upload(ref_table);
    } else {
      std::vector<uint16_t> t(n);
      std::uniform_int_distribution<int> bits(0, 0xffff);
      for (size_t i = 0; i < n; ++i) {
        uint16_t b = static_cast<uint16_t>(bits(rng));
        if (dtype == 1 && ((b >> 10) & 31) == 31) b &= 0xbfff;  // no inf / NaN halves
        if (dtype == 2) b = bf16_of(random_f32(rng, 1, 1.0f)[0]);
        t[i] = b;
        ref_table[i] = dtype == 1 ? half_to_float(b) : f32_of(b);
      }
      table = upload(t);
    }
    DeviceBuffer dout = nan_buffer(static_cast<size_t>(rows * hidden));
    embed(table.get(), dtype, dt.as<int32_t>(), rows, hidden, dout.as<float>(), nullptr);
    synchronize();
    const auto out = download<float>(dout, static_cast<size_t>(rows * hidden));
    size_t bad = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < hidden; ++i)
        bad += !same_bits(out[static_cast<size_t>(r * hidden + i)], ref_table[static_cast<size_t>(tok[r] * hidden + i)]);
    CHECK(bad == 0, "embed (dtype %d): %zu of %lld elements differ", dtype, bad, (long long)(rows * hidden));
  }
  CHECK(throws_invalid([] { embed(nullptr, 3, nullptr, 1, 8, nullptr, nullptr); }), "embed accepted dtype 3");
}

// Attention against a double-precision CPU softmax over the same cache.
// Sequences s < lens.size() hold positions [0, lens[s]) in the cache (written
// by kv_store); the query rows are (seqs[r], pos[r]).
struct AttnLayout {
  const char* name;
  int64_t heads, kv_heads, dk, dv;  // GQA: dk == dv == head_dim, group heads / kv_heads
  bool mla;                         // latent: one cache row [latent (dv) | rotary (dk - dv)], k = v
  int64_t window;
  bool sinks;
  bool half = false;  // also the 16-bit caches (f16, bf16)
};

void check_attention_case(std::mt19937_64& rng, const AttnLayout& L, const std::vector<int32_t>& lens,
                          const std::vector<int32_t>& seqs, const std::vector<int32_t>& pos) {
  const int64_t S = static_cast<int64_t>(lens.size()), C = 320, rows = static_cast<int64_t>(seqs.size());
  // Cache rows: GQA keeps K and V separately, [kv_heads][dk] each; MLA one [dk] row.
  const int64_t width = L.mla ? L.dk : L.kv_heads * L.dk;
  std::vector<float> kh(static_cast<size_t>(S * C * width), kNaN), vh(kh.size(), kNaN);
  // kv_store of every filled position, the source rows 3 floats apart more than width.
  const int64_t lds = width + 3;
  std::vector<int32_t> st_seq, st_pos;
  std::vector<float> ksrc, vsrc;
  for (int64_t s = 0; s < S; ++s)
    for (int32_t t = 0; t < lens[static_cast<size_t>(s)]; ++t) {
      st_seq.push_back(static_cast<int32_t>(s));
      st_pos.push_back(t);
      const auto kr = random_f32(rng, static_cast<size_t>(lds), 1.0f), vr = random_f32(rng, static_cast<size_t>(lds), 1.0f);
      ksrc.insert(ksrc.end(), kr.begin(), kr.end());
      vsrc.insert(vsrc.end(), vr.begin(), vr.end());
      std::copy(kr.begin(), kr.begin() + width, kh.begin() + (s * C + t) * width);
      std::copy(vr.begin(), vr.begin() + width, vh.begin() + (s * C + t) * width);
    }
  const int64_t stored = static_cast<int64_t>(st_seq.size());
  DeviceBuffer dkc = nan_buffer(kh.size()), dvc = nan_buffer(L.mla ? 1 : vh.size());
  {
    DeviceBuffer dks = upload(ksrc), dvs = upload(vsrc), dss = upload(st_seq), dps = upload(st_pos);
    kv_store(dks.as<float>(), lds, stored, width, dkc.as<float>(), KvLayout{C}, dss.as<int32_t>(), dps.as<int32_t>(), nullptr);
    if (!L.mla)
      kv_store(dvs.as<float>(), lds, stored, width, dvc.as<float>(), KvLayout{C}, dss.as<int32_t>(), dps.as<int32_t>(), nullptr);
    synchronize();
    const auto kc = download<float>(dkc, kh.size());
    size_t bad = 0;
    for (size_t i = 0; i < kh.size(); ++i) bad += !(same_bits(kc[i], kh[i]) || (std::isnan(kc[i]) && std::isnan(kh[i])));
    if (!L.mla) {
      const auto vc = download<float>(dvc, vh.size());
      for (size_t i = 0; i < vh.size(); ++i) bad += !(same_bits(vc[i], vh[i]) || (std::isnan(vc[i]) && std::isnan(vh[i])));
    }
    CHECK(bad == 0, "kv_store (%s): %zu cache elements differ", L.name, bad);
  }
  const int64_t group = L.mla ? L.heads : L.heads / L.kv_heads;
  const int64_t qhs = L.dk, ldq = L.heads * qhs + 3, ohs = L.dv + 1, ldo = L.heads * ohs + 2;
  const auto q = random_f32(rng, static_cast<size_t>(rows * ldq), 1.0f);
  std::vector<float> sinks = random_f32(rng, static_cast<size_t>(L.heads), 1.0f, 1.0f);
  DeviceBuffer dq = upload(q), dsk = upload(sinks), dseq = upload(seqs), dpos = upload(pos),
               dout = nan_buffer(static_cast<size_t>(rows * ldo));
  AttentionArgs a;
  a.q = dq.as<float>(), a.ldq = ldq, a.q_head_stride = qhs;
  a.k = dkc.as<float>(), a.v = L.mla ? dkc.as<float>() : dvc.as<float>();
  a.k_stride = width, a.v_stride = width, a.max_ctx = C;
  a.k_head_offset = L.mla ? 0 : L.dk, a.v_head_offset = L.mla ? 0 : L.dv;
  a.heads = L.heads, a.group = group, a.dk = L.dk, a.dv = L.dv;
  a.seqs = dseq.as<int32_t>(), a.pos = dpos.as<int32_t>(), a.rows = rows, a.window = L.window;
  a.scale = 1.0f / std::sqrt(static_cast<float>(L.dk));
  a.sinks = L.sinks ? dsk.as<float>() : nullptr;
  a.out = dout.as<float>(), a.ldo = ldo, a.o_head_stride = ohs;
  attention(a, nullptr);
  synchronize();
  const auto out = download<float>(dout, static_cast<size_t>(rows * ldo));
  size_t bad = 0;
  double worst = 0;
  for (size_t i = 0; i < out.size(); ++i) {  // nothing written between heads or past the rows
    const int64_t c = static_cast<int64_t>(i) % ldo;
    if ((c >= L.heads * ohs || c % ohs >= L.dv) && !std::isnan(out[i])) ++bad;
  }
  std::vector<double> sc, o(static_cast<size_t>(L.dv));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < L.heads; ++h) {
      const int64_t s = seqs[static_cast<size_t>(r)], p = pos[static_cast<size_t>(r)], kvh = h / group;
      const int64_t start = L.window > 0 ? std::max<int64_t>(0, p - L.window + 1) : 0;
      const float* qv = q.data() + r * ldq + h * qhs;
      sc.assign(static_cast<size_t>(p - start + 1), 0.0);
      double mx = L.sinks ? sinks[static_cast<size_t>(h)] : -INFINITY;
      for (int64_t t = start; t <= p; ++t) {
        const float* kr = kh.data() + (s * C + t) * width + (L.mla ? 0 : kvh * L.dk);
        double d = 0;
        for (int64_t i = 0; i < L.dk; ++i) d += static_cast<double>(qv[i]) * kr[i];
        sc[static_cast<size_t>(t - start)] = d * a.scale;
        mx = std::max(mx, d * a.scale);
      }
      double sum = L.sinks ? std::exp(sinks[static_cast<size_t>(h)] - mx) : 0.0;
      for (double& v : sc) sum += (v = std::exp(v - mx));
      std::fill(o.begin(), o.end(), 0.0);
      double mag = 0;
      for (int64_t t = start; t <= p; ++t) {
        const float* vr = (L.mla ? kh.data() : vh.data()) + (s * C + t) * width + (L.mla ? 0 : kvh * L.dv);
        const double pt = sc[static_cast<size_t>(t - start)] / sum;
        for (int64_t i = 0; i < L.dv; ++i) o[static_cast<size_t>(i)] += pt * vr[i], mag += pt * std::fabs(vr[i]);
      }
      mag /= static_cast<double>(L.dv);
      for (int64_t i = 0; i < L.dv; ++i) {
        const double got = out[static_cast<size_t>(r * ldo + h * ohs + i)], err = std::fabs(got - o[static_cast<size_t>(i)]);
        if (!(err <= 5e-5 * mag + 1e-6)) ++bad;
        worst = std::max(worst, err / (mag + 1e-30));
      }
    }
  CHECK(bad == 0, "attention %s (%lld rows, %lld heads, group %lld, dk %lld, dv %lld, window %lld%s): %zu elements off "
        "(worst relative %.3g)", L.name, (long long)rows, (long long)L.heads, (long long)group, (long long)L.dk,
        (long long)L.dv, (long long)L.window, L.sinks ? ", sinks" : "", bad, worst);

  // The same rows in a paged cache (coordinator/kv_cache.h): blocks of 16
  // positions anywhere in a pool with spare blocks, a random block table; the
  // outputs are bitwise those of the contiguous cache.
  const int64_t B = 16, bps = (C + B - 1) / B, pool = S * bps + 7;
  std::vector<int32_t> perm(static_cast<size_t>(pool));
  for (int64_t i = 0; i < pool; ++i) perm[static_cast<size_t>(i)] = static_cast<int32_t>(i);
  std::shuffle(perm.begin(), perm.end(), rng);
  const std::vector<int32_t> table(perm.begin(), perm.begin() + S * bps);
  DeviceBuffer dtab = upload(table);
  DeviceBuffer pkc = nan_buffer(static_cast<size_t>(pool * B * width)), pvc = nan_buffer(L.mla ? 1 : static_cast<size_t>(pool * B * width));
  KvLayout kl{C, dtab.as<int32_t>(), bps, B};
  {
    DeviceBuffer dks = upload(ksrc), dvs = upload(vsrc), dss = upload(st_seq), dps = upload(st_pos);
    kv_store(dks.as<float>(), lds, stored, width, pkc.as<float>(), kl, dss.as<int32_t>(), dps.as<int32_t>(), nullptr);
    if (!L.mla) kv_store(dvs.as<float>(), lds, stored, width, pvc.as<float>(), kl, dss.as<int32_t>(), dps.as<int32_t>(), nullptr);
  }
  DeviceBuffer pout = nan_buffer(static_cast<size_t>(rows * ldo));
  AttentionArgs pa = a;
  pa.k = pkc.as<float>(), pa.v = L.mla ? pkc.as<float>() : pvc.as<float>();
  pa.blocks = dtab.as<int32_t>(), pa.blocks_per_seq = bps, pa.block_tokens = B;
  pa.out = pout.as<float>();
  attention(pa, nullptr);
  synchronize();
  const auto pgot = download<float>(pout, static_cast<size_t>(rows * ldo));
  size_t pbad = 0;
  for (size_t i = 0; i < pgot.size(); ++i) pbad += !(same_bits(pgot[i], out[i]) || (std::isnan(pgot[i]) && std::isnan(out[i])));
  CHECK(pbad == 0, "attention %s over a paged cache: %zu of %zu elements differ from the contiguous cache's", L.name,
        pbad, pgot.size());

  // The same paged cache in f16 (dtype 1) and bf16 (2): kv_store rounds every
  // value to the nearest 16-bit value, ties to even, and attention over it is
  // bitwise attention over an f32 cache that holds the widened values. (The
  // layouts marked `half`: the emulator runs attention slowly.)
  for (int dt = 1; dt <= 2 && L.half; ++dt) {
    const size_t cells = static_cast<size_t>(pool * B * width);
    DeviceBuffer hkc = upload(std::vector<uint16_t>(cells, 0xffff)),  // NaN in both types
        hvc = upload(std::vector<uint16_t>(L.mla ? 1 : cells, 0xffff));
    const KvLayout hl{C, dtab.as<int32_t>(), bps, B, dt};
    {
      DeviceBuffer dks = upload(ksrc), dvs = upload(vsrc), dss = upload(st_seq), dps = upload(st_pos);
      kv_store(dks.as<float>(), lds, stored, width, hkc.get(), hl, dss.as<int32_t>(), dps.as<int32_t>(), nullptr);
      if (!L.mla) kv_store(dvs.as<float>(), lds, stored, width, hvc.get(), hl, dss.as<int32_t>(), dps.as<int32_t>(), nullptr);
    }
    synchronize();
    const auto hk = download<uint16_t>(hkc, cells);
    const auto hv = L.mla ? std::vector<uint16_t>() : download<uint16_t>(hvc, cells);
    std::vector<float> kwid(ksrc), vwid(vsrc);  // the stored values widened: the f32 reference cache's
    size_t hbad = 0;
    for (int64_t j = 0; j < stored; ++j) {
      const int64_t s = st_seq[static_cast<size_t>(j)], t = st_pos[static_cast<size_t>(j)];
      const int64_t row = table[static_cast<size_t>(s * bps + t / B)] * B + t % B;
      for (int64_t i = 0; i < width; ++i) {
        const size_t src = static_cast<size_t>(j * lds + i), dst = static_cast<size_t>(row * width + i);
        hbad += !nearest_16(ksrc[src], hk[dst], dt);
        kwid[src] = widen_16(hk[dst], dt);
        if (!L.mla) {
          hbad += !nearest_16(vsrc[src], hv[dst], dt);
          vwid[src] = widen_16(hv[dst], dt);
        }
      }
    }
    CHECK(hbad == 0, "kv_store %s into a %s cache: %zu values not rounded to nearest even", L.name,
          dt == 1 ? "f16" : "bf16", hbad);
    DeviceBuffer wkc = nan_buffer(cells), wvc = nan_buffer(L.mla ? 1 : cells);
    {
      DeviceBuffer dks = upload(kwid), dvs = upload(vwid), dss = upload(st_seq), dps = upload(st_pos);
      kv_store(dks.as<float>(), lds, stored, width, wkc.as<float>(), kl, dss.as<int32_t>(), dps.as<int32_t>(), nullptr);
      if (!L.mla) kv_store(dvs.as<float>(), lds, stored, width, wvc.as<float>(), kl, dss.as<int32_t>(), dps.as<int32_t>(), nullptr);
    }
    DeviceBuffer wout = nan_buffer(static_cast<size_t>(rows * ldo)), hout = nan_buffer(static_cast<size_t>(rows * ldo));
    AttentionArgs wa = pa, ha = pa;
    wa.k = wkc.as<float>(), wa.v = L.mla ? wkc.as<float>() : wvc.as<float>(), wa.out = wout.as<float>();
    ha.k = hkc.get(), ha.v = L.mla ? hkc.get() : hvc.get(), ha.kv_dtype = dt, ha.out = hout.as<float>();
    attention(wa, nullptr);
    attention(ha, nullptr);
    synchronize();
    const auto wgot = download<float>(wout, static_cast<size_t>(rows * ldo));
    const auto hgot = download<float>(hout, static_cast<size_t>(rows * ldo));
    size_t dbad = 0, finite = 0;
    for (size_t i = 0; i < hgot.size(); ++i) {
      dbad += !(same_bits(hgot[i], wgot[i]) || (std::isnan(hgot[i]) && std::isnan(wgot[i])));
      finite += std::isfinite(hgot[i]);
    }
    CHECK(dbad == 0 && finite == static_cast<size_t>(rows * L.heads * L.dv),
          "attention %s over a %s cache: %zu of %zu elements differ from the widened f32 cache's (%zu finite)", L.name,
          dt == 1 ? "f16" : "bf16", dbad, hgot.size(), finite);
  }
}

void check_attention(std::mt19937_64& rng) {
  // Three sequences of 300, 17 and 1 positions. Decode rows: the last position of
  // each; prefill-like rows: one sequence's positions in a run.
  const std::vector<int32_t> lens = {300, 17, 1};
  std::vector<int32_t> seqs = {0, 1, 2}, pos = {299, 16, 0};
  for (int32_t t = 0; t < 17; ++t) seqs.push_back(1), pos.push_back(t);
  const std::vector<int32_t> dseqs = {2, 0, 1}, dpos = {0, 299, 16};
  std::vector<int32_t> pseqs = dseqs, ppos = dpos;  // + a long prefill: 2400 (row, head) pairs with 8 heads
  for (int32_t t = 0; t < 300; ++t) pseqs.push_back(0), ppos.push_back(t);
  //                     name              heads kv  dk   dv   mla    window sinks
  check_attention_case(rng, {"gqa g1", 4, 4, 64, 64, false, 0, false}, lens, seqs, pos);
  check_attention_case(rng, {"gqa g4 window", 8, 2, 128, 128, false, 8, true}, lens, seqs, pos);
  check_attention_case(rng, {"gqa g4 prefill", 8, 2, 128, 128, false, 0, true}, lens, pseqs, ppos);
  check_attention_case(rng, {"gqa g2 hd80", 4, 2, 80, 80, false, 0, true}, lens, seqs, pos);
  check_attention_case(rng, {"gqa window 1", 4, 2, 32, 32, false, 1, false, true}, lens, dseqs, dpos);
  check_attention_case(rng, {"gqa hd256", 2, 1, 256, 256, false, 50, false}, lens, seqs, pos);
  check_attention_case(rng, {"mla small", 4, 1, 96, 64, true, 0, false, true}, lens, seqs, pos);
  check_attention_case(rng, {"mla v3", 16, 1, 576, 512, true, 0, false}, lens, seqs, pos);
  check_attention_case(rng, {"mla 1024", 2, 1, 1024, 960, true, 0, false}, lens, dseqs, dpos);
  {  // a position outside the context yields NaN, and nothing is read
    DeviceBuffer dq = upload(std::vector<float>(64, 1.0f)), dc = nan_buffer(64), dout = upload(std::vector<float>(64, 0.0f));
    DeviceBuffer ds = upload(std::vector<int32_t>{0}), dp = upload(std::vector<int32_t>{1});
    AttentionArgs a;
    a.q = dq.as<float>(), a.ldq = 64, a.k = dc.as<float>(), a.v = dc.as<float>(), a.k_stride = 64, a.v_stride = 64;
    a.max_ctx = 1, a.heads = 1, a.dk = 64, a.dv = 64, a.seqs = ds.as<int32_t>(), a.pos = dp.as<int32_t>(), a.rows = 1;
    a.out = dout.as<float>(), a.ldo = 64;
    attention(a, nullptr);
    synchronize();
    const auto o = download<float>(dout, 64);
    size_t bad = 0;
    for (float v : o) bad += !std::isnan(v);
    CHECK(bad == 0, "attention at a position past the context: %zu outputs not NaN", bad);
    a.dk = 1025;
    CHECK(throws_invalid([&] { attention(a, nullptr); }), "attention accepted dk 1025");
    a.dk = 64, a.dv = 0;
    CHECK(throws_invalid([&] { attention(a, nullptr); }), "attention accepted dv 0");
  }
}

// The router on the CPU: coordinator/router.cpp's route() (same float
// arithmetic and order), plus the smallest positive gap between the chosen and
// the best rejected candidate in any of the row's decisions (a row whose choice
// could flip with the last bit of exp).
struct RouteCfg {
  RouteScoring scoring = RouteScoring::Softmax;
  RouteGroups groups = RouteGroups::None;
  int64_t n_group = 1, topk_group = 1;
  bool norm = false;
  float scaling = 1.0f;
};

void cpu_route(const RouteCfg& cfg, const float* logits, int64_t rows, int64_t E, int64_t k, const float* score_bias,
               int32_t* experts, float* weights, std::vector<double>& margin) {
  const bool grouped = cfg.groups != RouteGroups::None;
  const int64_t G = grouped ? cfg.n_group : 1, per = E / G;
  std::vector<float> p(static_cast<size_t>(E)), choice(p.size()), gscore(static_cast<size_t>(G));
  std::vector<uint8_t> allowed(p.size()), taken(p.size()), gkeep(gscore.size());
  margin.assign(static_cast<size_t>(rows), INFINITY);
  // The best of `cand` over values v, and the gap to the best strictly below it.
  auto note_gap = [](double& m, const std::vector<float>& v, const std::vector<uint8_t>& cand, int64_t best) {
    float second = -INFINITY;
    for (size_t i = 0; i < v.size(); ++i)
      if (cand[i] && v[i] < v[static_cast<size_t>(best)]) second = std::max(second, v[i]);
    if (second > -INFINITY) {
      const double gap = (static_cast<double>(v[static_cast<size_t>(best)]) - second) /
                         std::max(1e-30, std::fabs(static_cast<double>(v[static_cast<size_t>(best)])));
      m = std::min(m, gap);
    }
  };
  for (int64_t r = 0; r < rows; ++r) {
    const float* l = logits + r * E;
    if (cfg.scoring == RouteScoring::Softmax) {
      float mx = l[0];
      for (int64_t e = 1; e < E; ++e) mx = std::max(mx, l[e]);
      float sum = 0.f;
      for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(l[e] - mx));
      for (int64_t e = 0; e < E; ++e) p[e] /= sum;
    } else if (cfg.scoring == RouteScoring::Sigmoid) {
      for (int64_t e = 0; e < E; ++e) p[e] = 1.0f / (1.0f + std::exp(-l[e]));
    } else {
      for (int64_t e = 0; e < E; ++e) p[e] = l[e];
    }
    for (int64_t e = 0; e < E; ++e) choice[e] = p[e] + (score_bias ? score_bias[e] : 0.0f);
    std::fill(allowed.begin(), allowed.end(), 1);
    if (grouped) {
      for (int64_t g = 0; g < G; ++g) {
        const float* c = choice.data() + g * per;
        if (cfg.groups == RouteGroups::Max) {
          float m = c[0];
          for (int64_t i = 1; i < per; ++i) m = std::max(m, c[i]);
          gscore[g] = m;
        } else {
          int64_t a = 0;
          for (int64_t i = 1; i < per; ++i)
            if (c[i] > c[a]) a = i;
          int64_t b = -1;
          for (int64_t i = 0; i < per; ++i)
            if (i != a && (b < 0 || c[i] > c[b])) b = i;
          gscore[g] = c[a] + c[b];
        }
      }
      std::fill(gkeep.begin(), gkeep.end(), 0);
      for (int64_t j = 0; j < cfg.topk_group; ++j) {
        int64_t best = -1;
        for (int64_t g = 0; g < G; ++g)
          if (!gkeep[g] && (best < 0 || gscore[g] > gscore[best])) best = g;
        std::vector<uint8_t> cand(gkeep.size());
        for (size_t g = 0; g < cand.size(); ++g) cand[g] = !gkeep[g];
        note_gap(margin[static_cast<size_t>(r)], gscore, cand, best);
        gkeep[best] = 1;
      }
      for (int64_t e = 0; e < E; ++e) allowed[e] = gkeep[e / per];
    }
    int32_t* ex = experts + r * k;
    float* w = weights + r * k;
    std::fill(taken.begin(), taken.end(), 0);
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e)
        if (allowed[e] && !taken[e] && (best < 0 || choice[e] > choice[best])) best = e;
      std::vector<uint8_t> cand(allowed.size());
      for (size_t e = 0; e < cand.size(); ++e) cand[e] = allowed[e] && !taken[e];
      note_gap(margin[static_cast<size_t>(r)], choice, cand, best);
      taken[best] = 1;
      ex[j] = static_cast<int32_t>(best);
      w[j] = p[best];
    }
    if (cfg.scoring == RouteScoring::TopkSoftmax) {
      float mx = w[0];
      for (int64_t j = 1; j < k; ++j) mx = std::max(mx, w[j]);
      float sum = 0.f;
      for (int64_t j = 0; j < k; ++j) sum += (w[j] = std::exp(w[j] - mx));
      for (int64_t j = 0; j < k; ++j) w[j] /= sum;
    } else if (cfg.norm) {
      float s = 0.f;
      for (int64_t j = 0; j < k; ++j) s += w[j];
      if (cfg.scoring == RouteScoring::Sigmoid) s += 1e-20f;
      for (int64_t j = 0; j < k; ++j) w[j] /= s;
    }
    if (cfg.scaling != 1.0f)
      for (int64_t j = 0; j < k; ++j) w[j] *= cfg.scaling;
  }
}

RouteArgs route_args(const RouteCfg& c, int64_t rows, int64_t E, int64_t k) {
  RouteArgs a;
  a.rows = rows, a.num_experts = E, a.k = k, a.scoring = c.scoring, a.groups = c.groups;
  a.n_group = c.n_group, a.topk_group = c.topk_group, a.norm_topk_prob = c.norm, a.routed_scaling_factor = c.scaling;
  return a;
}

// quant > 0: logits are multiples of 1/quant (exact ties where equal, else far apart).
void check_route_case(std::mt19937_64& rng, const char* name, const RouteCfg& cfg, int64_t rows, int64_t E, int64_t k,
                      bool bias, float quant, float spread = 2.0f) {
  auto logits = random_f32(rng, static_cast<size_t>(rows * E), spread);
  auto sb = random_f32(rng, static_cast<size_t>(E), 0.05f);
  if (quant > 0) {
    for (auto& v : logits) v = std::round(v * quant) / quant;
    for (auto& v : sb) v = std::round(v * quant * 16) / (quant * 16);
  }
  std::vector<int32_t> ref_e(static_cast<size_t>(rows * k));
  std::vector<float> ref_w(ref_e.size());
  std::vector<double> margin;
  cpu_route(cfg, logits.data(), rows, E, k, bias ? sb.data() : nullptr, ref_e.data(), ref_w.data(), margin);
  DeviceBuffer dl = upload(logits), db = upload(sb), de = upload(std::vector<int32_t>(ref_e.size(), -7)),
               dw = nan_buffer(ref_w.size());
  RouteArgs a = route_args(cfg, rows, E, k);
  a.logits = dl.as<float>(), a.score_bias = bias ? db.as<float>() : nullptr;
  a.experts = de.as<int32_t>(), a.weights = dw.as<float>();
  route(a, nullptr);
  synchronize();
  const auto ge = download<int32_t>(de, ref_e.size());
  const auto gw = download<float>(dw, ref_w.size());
  size_t bad_rows = 0, near_ties = 0, bad_w = 0;
  double worst = 0;
  for (int64_t r = 0; r < rows; ++r) {
    bool same = true;
    for (int64_t j = 0; j < k; ++j) same &= ge[static_cast<size_t>(r * k + j)] == ref_e[static_cast<size_t>(r * k + j)];
    if (!same) {
      // A choice between candidates within a few ulps (GPU expf against the CPU's)
      // may go either way; exact ties and real gaps may not.
      if (margin[static_cast<size_t>(r)] > 0 && margin[static_cast<size_t>(r)] < 2e-6) {
        ++near_ties;
      } else {
        if (bad_rows++ < 3) {
          std::printf("  route %s row %lld: got", name, (long long)r);
          for (int64_t j = 0; j < k; ++j) std::printf(" %d", ge[static_cast<size_t>(r * k + j)]);
          std::printf(", want");
          for (int64_t j = 0; j < k; ++j) std::printf(" %d", ref_e[static_cast<size_t>(r * k + j)]);
          std::printf("\n");
        }
      }
      continue;
    }
    for (int64_t j = 0; j < k; ++j) {
      const double got = gw[static_cast<size_t>(r * k + j)], want = ref_w[static_cast<size_t>(r * k + j)];
      const double err = std::fabs(got - want);
      if (!(err <= 5e-6 * std::fabs(want) + 1e-30)) ++bad_w;
      worst = std::max(worst, err / (std::fabs(want) + 1e-30));
    }
  }
  CHECK(bad_rows == 0 && bad_w == 0, "route %s (E %lld, k %lld, %lld rows): %zu rows with other experts, %zu weights off "
        "(worst relative %.3g)", name, (long long)E, (long long)k, (long long)rows, bad_rows, bad_w, worst);
  if (near_ties) std::printf("note: route %s: %zu rows chose differently between candidates within 2e-6\n", name, near_ties);
}

void check_route(std::mt19937_64& rng) {
  using S = RouteScoring;
  using Gs = RouteGroups;
  RouteCfg mixtral{S::Softmax, Gs::None, 1, 1, true, 1.0f};
  RouteCfg qwen2{S::Softmax, Gs::None, 1, 1, false, 1.0f};
  RouteCfg v3{S::Sigmoid, Gs::Top2Sum, 8, 4, true, 2.5f};
  RouteCfg v2{S::Softmax, Gs::Max, 8, 3, false, 16.0f};
  RouteCfg oss{S::TopkSoftmax, Gs::None, 1, 1, false, 1.0f};
  check_route_case(rng, "mixtral softmax+norm", mixtral, 37, 8, 2, false, 64);
  check_route_case(rng, "qwen2 softmax", qwen2, 37, 60, 4, false, 64);
  check_route_case(rng, "qwen3 softmax+norm", mixtral, 37, 128, 8, false, 64);
  check_route_case(rng, "deepseek-v3 sigmoid+bias top2_sum", v3, 203, 256, 8, true, 64);
  check_route_case(rng, "deepseek-v2 softmax groups max", v2, 37, 160, 6, false, 64);
  check_route_case(rng, "gpt-oss topk_softmax", oss, 37, 32, 4, false, 0);
  check_route_case(rng, "gpt-oss-120b topk_softmax", oss, 37, 128, 4, false, 0);
  check_route_case(rng, "softmax E 1024 k 32", mixtral, 9, 1024, 32, false, 64);
  check_route_case(rng, "sigmoid+bias E 512", {S::Sigmoid, Gs::None, 1, 1, true, 1.0f}, 9, 512, 8, true, 64);
  check_route_case(rng, "E 1", mixtral, 3, 1, 1, false, 0);
  // Selection exactness on raw logits (no exp): every group variant, random data.
  check_route_case(rng, "raw top2_sum", {S::TopkSoftmax, Gs::Top2Sum, 8, 4, false, 1.0f}, 64, 256, 8, true, 0);
  check_route_case(rng, "raw max groups", {S::TopkSoftmax, Gs::Max, 4, 2, false, 1.0f}, 64, 96, 6, false, 0);
  // Ties: small integers, so many experts (and groups) score exactly the same.
  check_route_case(rng, "ties softmax", mixtral, 64, 64, 8, false, 1, 1.0f);
  check_route_case(rng, "ties sigmoid top2_sum", v3, 64, 64, 6, false, 1, 1.0f);
  check_route_case(rng, "ties softmax max groups", {S::Softmax, Gs::Max, 8, 3, true, 1.0f}, 64, 64, 6, false, 1, 1.0f);
  check_route_case(rng, "ties topk_softmax", oss, 64, 32, 4, false, 1, 1.0f);
  RouteArgs bad = route_args(mixtral, 1, 1025, 2);
  CHECK(throws_invalid([&] { route(bad, nullptr); }), "route accepted 1025 experts");
  bad = route_args(mixtral, 1, 8, 9);
  CHECK(throws_invalid([&] { route(bad, nullptr); }), "route accepted k > experts");
  bad = route_args(v3, 1, 256, 8);
  bad.topk_group = 9;
  CHECK(throws_invalid([&] { route(bad, nullptr); }), "route accepted topk_group > n_group");
  bad = route_args(v3, 1, 16, 8);
  bad.n_group = 8, bad.topk_group = 2;  // 2 groups of 2 experts cannot give 8
  CHECK(throws_invalid([&] { route(bad, nullptr); }), "route accepted k above the kept groups' experts");
}

// Stable counting sort of assignments by expert.
void cpu_plan(const std::vector<int32_t>& ex, int64_t E, std::vector<int32_t>& order, std::vector<int32_t>& inverse,
              std::vector<int32_t>& offsets) {
  const size_t n = ex.size();
  offsets.assign(static_cast<size_t>(E + 1), 0);
  for (int32_t e : ex) ++offsets[static_cast<size_t>(e + 1)];
  for (int64_t e = 0; e < E; ++e) offsets[static_cast<size_t>(e + 1)] += offsets[static_cast<size_t>(e)];
  std::vector<int32_t> next(offsets.begin(), offsets.end() - 1);
  order.assign(n, -1);
  inverse.assign(n, -1);
  for (size_t a = 0; a < n; ++a) {
    const int32_t j = next[static_cast<size_t>(ex[a])]++;
    order[static_cast<size_t>(j)] = static_cast<int32_t>(a);
    inverse[a] = j;
  }
}

void check_permute(std::mt19937_64& rng) {
  struct Case {
    int64_t rows, k, E, hidden, ldx;
  };
  // Few experts busy; most empty; many tiles for CUB; E 1; odd widths (scalar copy).
  const Case cases[] = {{100, 4, 16, 256, 256}, {5, 2, 64, 100, 103}, {2048, 8, 256, 64, 64}, {7, 3, 1, 33, 40},
                        {64, 8, 257, 128, 132}};
  for (const auto& c : cases) {
    const int64_t n = c.rows * c.k;
    std::vector<int32_t> ex(static_cast<size_t>(n));
    std::uniform_int_distribution<int32_t> ed(0, static_cast<int32_t>(c.E - 1));
    for (auto& e : ex) e = ed(rng);
    std::vector<int32_t> order, inverse, offsets;
    cpu_plan(ex, c.E, order, inverse, offsets);
    const size_t scratch = permute_scratch_bytes(n, c.E);
    DeviceBuffer dex = upload(ex), dord(static_cast<size_t>(n) * 4), dinv(static_cast<size_t>(n) * 4),
                 doff(static_cast<size_t>(c.E + 1) * 4), dscr(scratch + 4);
    COLIBRI_CUDA_CHECK(cudaMemset(dord.get(), 0xff, dord.bytes()));
    COLIBRI_CUDA_CHECK(cudaMemset(dinv.get(), 0xff, dinv.bytes()));
    COLIBRI_CUDA_CHECK(cudaMemset(doff.get(), 0xff, doff.bytes()));
    // The scratch 4 bytes into its buffer: the plan aligns it itself.
    permute_plan(dex.as<int32_t>(), c.rows, c.k, c.E, dord.as<int32_t>(), dinv.as<int32_t>(), doff.as<int32_t>(),
                 static_cast<char*>(dscr.get()) + 4, scratch, nullptr);
    synchronize();
    const auto go = download<int32_t>(dord, static_cast<size_t>(n)), gi = download<int32_t>(dinv, static_cast<size_t>(n)),
               gof = download<int32_t>(doff, static_cast<size_t>(c.E + 1));
    CHECK(go == order && gi == inverse && gof == offsets,
          "permute_plan (%lld rows, k %lld, %lld experts): order %s, inverse %s, offsets %s", (long long)c.rows,
          (long long)c.k, (long long)c.E, go == order ? "ok" : "differs", gi == inverse ? "ok" : "differs",
          gof == offsets ? "ok" : "differs");
    CHECK(throws_invalid([&] {
            permute_plan(dex.as<int32_t>(), c.rows, c.k, c.E, dord.as<int32_t>(), dinv.as<int32_t>(),
                         doff.as<int32_t>(), dscr.get(), 64, nullptr);
          }),
          "permute_plan accepted a 64-byte scratch");
    // permute_rows: x rows ldx apart; xp packed.
    const auto x = random_f32(rng, static_cast<size_t>(c.rows * c.ldx), 1.0f);
    DeviceBuffer dx = upload(x), dxp = nan_buffer(static_cast<size_t>(n * c.hidden));
    permute_rows(dx.as<float>(), c.ldx, dord.as<int32_t>(), c.rows, c.k, c.hidden, dxp.as<float>(), nullptr);
    synchronize();
    const auto xp = download<float>(dxp, static_cast<size_t>(n * c.hidden));
    size_t bad = 0;
    for (int64_t j = 0; j < n; ++j)
      for (int64_t i = 0; i < c.hidden; ++i)
        bad += !same_bits(xp[static_cast<size_t>(j * c.hidden + i)],
                          x[static_cast<size_t>(order[static_cast<size_t>(j)] / c.k * c.ldx + i)]);
    CHECK(bad == 0, "permute_rows (%lld rows, k %lld, hidden %lld, ldx %lld): %zu elements differ", (long long)c.rows,
          (long long)c.k, (long long)c.hidden, (long long)c.ldx, bad);
    // unpermute_combine, both modes: bitwise the CPU's fma sequence in slot order.
    const auto yp = random_f32(rng, static_cast<size_t>(n * c.hidden), 1.0f);
    const auto w = random_f32(rng, static_cast<size_t>(n), 0.5f);
    const auto y0 = random_f32(rng, static_cast<size_t>(c.rows * c.hidden), 1.0f);
    DeviceBuffer dyp = upload(yp), dw = upload(w);
    for (bool acc : {false, true}) {
      DeviceBuffer dy = acc ? upload(y0) : nan_buffer(y0.size());
      unpermute_combine(dyp.as<float>(), dinv.as<int32_t>(), dw.as<float>(), c.rows, c.k, c.hidden, dy.as<float>(), acc,
                        nullptr);
      synchronize();
      const auto y = download<float>(dy, y0.size());
      size_t badc = 0;
      for (int64_t r = 0; r < c.rows; ++r)
        for (int64_t i = 0; i < c.hidden; ++i) {
          float ref = acc ? y0[static_cast<size_t>(r * c.hidden + i)] : 0.0f;
          for (int64_t s = 0; s < c.k; ++s)
            ref = std::fma(w[static_cast<size_t>(r * c.k + s)],
                           yp[static_cast<size_t>(inverse[static_cast<size_t>(r * c.k + s)] * c.hidden + i)], ref);
          badc += !same_bits(y[static_cast<size_t>(r * c.hidden + i)], ref);
        }
      CHECK(badc == 0, "unpermute_combine (%s, %lld rows, k %lld, hidden %lld): %zu elements differ from the CPU's "
            "fma order", acc ? "accumulate" : "overwrite", (long long)c.rows, (long long)c.k, (long long)c.hidden, badc);
    }
  }
  {  // zero assignments: every expert empty
    DeviceBuffer doff(9 * 4);
    COLIBRI_CUDA_CHECK(cudaMemset(doff.get(), 0xff, doff.bytes()));
    permute_plan(nullptr, 0, 4, 8, nullptr, nullptr, doff.as<int32_t>(), nullptr, 0, nullptr);
    synchronize();
    const auto off = download<int32_t>(doff, 9);
    CHECK(off == std::vector<int32_t>(9, 0), "permute_plan of 0 rows: offsets not all 0");
  }
  {  // permute_rows with k = 1 as a row gather (rows of x beyond the gathered count)
    const int64_t hidden = 48;
    const auto x = random_f32(rng, static_cast<size_t>(10 * hidden), 1.0f);
    const std::vector<int32_t> want = {7, 2, 2, 9};
    DeviceBuffer dx = upload(x), dwant = upload(want), dg = nan_buffer(4 * hidden);
    permute_rows(dx.as<float>(), hidden, dwant.as<int32_t>(), 4, 1, hidden, dg.as<float>(), nullptr);
    synchronize();
    const auto g = download<float>(dg, 4 * hidden);
    size_t bad = 0;
    for (int64_t j = 0; j < 4; ++j)
      for (int64_t i = 0; i < hidden; ++i)
        bad += !same_bits(g[static_cast<size_t>(j * hidden + i)], x[static_cast<size_t>(want[static_cast<size_t>(j)] * hidden + i)]);
    CHECK(bad == 0, "permute_rows as a gather (k 1): %zu elements differ", bad);
  }
}

void check_sigmoid_gate(std::mt19937_64& rng) {
  const int64_t rows = 9, hidden = 1000;
  const auto x = random_f32(rng, static_cast<size_t>(rows * hidden), 1.0f);
  const auto w = random_f32(rng, static_cast<size_t>(hidden), 1.0f / std::sqrt(static_cast<float>(hidden)));
  const auto t = random_f32(rng, x.size(), 1.0f);
  DeviceBuffer dx = upload(x), dw = upload(w), dt = upload(t);
  sigmoid_gate(dx.as<float>(), dw.as<float>(), dt.as<float>(), rows, hidden, nullptr);
  synchronize();
  const auto y = download<float>(dt, t.size());
  size_t bad = 0;
  for (int64_t r = 0; r < rows; ++r) {
    double d = 0;
    for (int64_t i = 0; i < hidden; ++i) d += static_cast<double>(x[r * hidden + i]) * w[i];
    const double g = 1.0 / (1.0 + std::exp(-d));
    for (int64_t i = 0; i < hidden; ++i) {
      const size_t at = static_cast<size_t>(r * hidden + i);
      if (!(std::fabs(y[at] - t[at] * g) <= 1e-5 * std::fabs(t[at]) + 1e-7)) ++bad;
    }
  }
  CHECK(bad == 0, "sigmoid_gate: %zu of %zu elements off", bad, y.size());
}

// Gemm::run with row strides, and run_f32 (f32 throughout: TF32 would miss 1e-5).
void check_gemm_strided(std::mt19937_64& rng) {
  Gemm gemm;
  {
    const int64_t rows = 5, in = 96, out = 80, ldx = 100, ldy = 90;
    const auto x = random_bf16(rng, static_cast<size_t>(rows * ldx), 1.0f);
    const auto w = random_bf16(rng, static_cast<size_t>(out * in), 0.1f);
    DeviceBuffer dx = upload(x), dw = upload(w), dy = nan_buffer(static_cast<size_t>(rows * ldy));
    gemm.run(dw.as<uint16_t>(), out, in, dx.as<uint16_t>(), rows, dy.as<float>(), ldx, ldy);
    synchronize();
    const auto y = download<float>(dy, static_cast<size_t>(rows * ldy));
    size_t bad = pads_written(y, rows, out, ldy);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t o = 0; o < out; ++o) {
        double ref = 0, mag = 0;
        for (int64_t k = 0; k < in; ++k) {
          const double p = static_cast<double>(f32_of(x[r * ldx + k])) * f32_of(w[o * in + k]);
          ref += p, mag += std::fabs(p);
        }
        if (!(std::fabs(y[static_cast<size_t>(r * ldy + o)] - ref) <= 1e-3 * mag + 1e-6)) ++bad;
      }
    CHECK(bad == 0, "Gemm with ldx %lld, ldy %lld: %zu elements off", (long long)ldx, (long long)ldy, bad);
  }
  const int64_t shapes[][5] = {{7, 300, 64, 310, 70}, {33, 512, 256, 0, 0}, {1, 4096, 8, 0, 0}, {64, 128, 60, 128, 61}};
  for (const auto& s : shapes) {
    const int64_t rows = s[0], in = s[1], out = s[2], ldx = s[3] ? s[3] : in, ldy = s[4] ? s[4] : out;
    const auto x = random_f32(rng, static_cast<size_t>(rows * ldx), 1.0f);
    const auto w = random_f32(rng, static_cast<size_t>(out * in), 1.0f / std::sqrt(static_cast<float>(in)));
    DeviceBuffer dx = upload(x), dw = upload(w), dy = nan_buffer(static_cast<size_t>(rows * ldy));
    gemm.run_f32(dw.as<float>(), out, in, dx.as<float>(), rows, dy.as<float>(), s[3], s[4]);
    synchronize();
    const auto y = download<float>(dy, static_cast<size_t>(rows * ldy));
    size_t bad = pads_written(y, rows, out, ldy);
    double worst = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t o = 0; o < out; ++o) {
        double ref = 0, mag = 0;
        for (int64_t k = 0; k < in; ++k) {
          const double p = static_cast<double>(x[r * ldx + k]) * w[o * in + k];
          ref += p, mag += std::fabs(p);
        }
        const double err = std::fabs(y[static_cast<size_t>(r * ldy + o)] - ref);
        if (!(err <= 1e-5 * mag + 1e-7)) ++bad;
        worst = std::max(worst, err / (mag + 1e-30));
      }
    CHECK(bad == 0, "Gemm::run_f32 %lld x %lld . (%lld x %lld)^T (ldx %lld, ldy %lld): %zu elements off (worst "
          "relative %.3g)", (long long)rows, (long long)in, (long long)out, (long long)in, (long long)ldx,
          (long long)ldy, bad, worst);
  }
  // Strided batches, as MLA uses them: per head, the weights one after another,
  // x and y interleaved by head within each row (odd strides: alignment 2 bytes).
  for (const auto& s : {std::array<int64_t, 5>{5, 24, 16, 3, 26}, std::array<int64_t, 5>{1, 64, 32, 4, 67}}) {
    const int64_t rows = s[0], in = s[1], out = s[2], batch = s[3], xs = s[4];
    const int64_t ldx = batch * xs, ys = out + 3, ldy = batch * ys;
    const auto x = random_bf16(rng, static_cast<size_t>(rows * ldx), 1.0f);
    const auto w = random_bf16(rng, static_cast<size_t>(batch * out * in), 0.1f);
    DeviceBuffer dx = upload(x), dw = upload(w), dy = nan_buffer(static_cast<size_t>(rows * ldy));
    gemm.run_batched(dw.as<uint16_t>(), out * in, out, in, dx.as<uint16_t>(), xs, rows, dy.as<float>(), ys, batch, ldx,
                     ldy);
    synchronize();
    const auto y = download<float>(dy, static_cast<size_t>(rows * ldy));
    size_t bad = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t o = 0; o < ys; ++o) {
          const float got = y[static_cast<size_t>(r * ldy + b * ys + o)];
          if (o >= out) {  // the gap between heads is not written
            if (!std::isnan(got)) ++bad;
            continue;
          }
          double ref = 0, mag = 0;
          for (int64_t k = 0; k < in; ++k) {
            const double p =
                static_cast<double>(f32_of(x[r * ldx + b * xs + k])) * f32_of(w[(b * out + o) * in + k]);
            ref += p, mag += std::fabs(p);
          }
          if (!(std::fabs(got - ref) <= 1e-3 * mag + 1e-6)) ++bad;
        }
    CHECK(bad == 0, "Gemm::run_batched %lld x %lld by %lld heads of %lld x %lld: %zu elements off", (long long)rows,
          (long long)in, (long long)batch, (long long)out, (long long)in, bad);
  }
  CHECK(throws_invalid([&] { gemm.run_f32(nullptr, 8, 16, nullptr, 1, nullptr, 8, 0); }), "run_f32 accepted ldx < in");
  CHECK(throws_invalid([&] { gemm.run(nullptr, 8, 16, nullptr, 1, nullptr, 0, 4); }), "Gemm::run accepted ldy < out");
}

// The checks of the expert FFN's pieces and of the dense kernels, as cuda_check
// (on a GPU) and cuda_emu_check (on the CPU emulator) run them.
void check_ffn_kernels(std::mt19937_64& rng) {
  check_to_bf16(rng);
  check_gemm(rng);
  check_ffn(rng, false);
  check_ffn(rng, true);
  check_ffn(rng, false, 200, 136, 1);  // rows inside a block: x, y 800 bytes past 256-byte alignment
  check_gemm_strided(rng);
}
void check_dense_kernels(std::mt19937_64& rng) {
  check_elementwise(rng);
  check_rmsnorm(rng);
  check_rope(rng);
  check_embed(rng);
  check_attention(rng);
  check_route(rng);
  check_permute(rng);
  check_sigmoid_gate(rng);
}

}  // namespace
