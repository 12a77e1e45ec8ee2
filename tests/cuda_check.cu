// cuda_check.cu: the CUDA kernels checked against CPU references, and their
// speed, in one standalone program that needs only the CUDA toolkit (the GPU
// machine lent to some sessions has no Colibri build dependencies):
//   nvcc -O2 -std=c++17 -arch=sm_90 -I. -Iinclude tests/cuda_check.cu kernels/cuda/ffn.cu -lcublasLt -o cuda_check
// Also built by CMake when CUDA is found, and run by ctest as `cuda.check`,
// which exits 77 (skipped) on a machine without a GPU.
//
//   cuda_check            the checks (exit 0 all passed, 1 a failure, 77 no GPU)
//   cuda_check --bench    the checks, then the benchmark table (scripts/gpu_check.sh)
//
// Checks (random inputs; the seed is printed; every output element is checked,
// outputs start as NaN so an unwritten element fails):
// - Gemm: y = x . w^T for bf16 x, w against a double-precision CPU product of the
//   same bf16 values, several shapes (1..512 rows); error <= 1e-3 of sum |x w| + 1e-6.
// - FfnRunner: SiLU, and gpt-oss's clamped SwiGLU with all three biases, against a
//   double-precision CPU FFN of the same bf16 weights (x and h rounded to bf16 as
//   the GPU does, so the bound is f32-accumulation tight: 2e-3 of max |y| + 1e-5);
//   once more with x and y one row into their buffers and hidden 200 (not 256-byte
//   aligned, as a worker's rows inside its block are).
// - to_bf16 rounds to nearest even exactly as the CPU (model/dtype.h) does.
// - Bad calls throw colibri::Error(InvalidArgument): rows over the runner's size,
//   a null pointer; a DeviceBuffer copy past its end.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_check.h"
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

// ---- benchmark ------------------------------------------------------------------

double time_ms(const std::function<void()>& f, int reps) {
  cudaEvent_t a, b;
  COLIBRI_CUDA_CHECK(cudaEventCreate(&a));
  COLIBRI_CUDA_CHECK(cudaEventCreate(&b));
  f();  // warm-up (plans, clocks)
  COLIBRI_CUDA_CHECK(cudaDeviceSynchronize());
  COLIBRI_CUDA_CHECK(cudaEventRecord(a));
  for (int i = 0; i < reps; ++i) f();
  COLIBRI_CUDA_CHECK(cudaEventRecord(b));
  COLIBRI_CUDA_CHECK(cudaEventSynchronize(b));
  float ms = 0;
  COLIBRI_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms / reps;
}

void bench() {
  cudaDeviceProp p{};
  COLIBRI_CUDA_CHECK(cudaGetDeviceProperties(&p, 0));
  std::printf("\n== benchmark on %s (%d SMs, %.0f MiB)\n", p.name, p.multiProcessorCount, p.totalGlobalMem / 1048576.0);
  // Measured peaks: a device-to-device copy (bytes read + written) and a large bf16 GEMM.
  const size_t big = size_t{2} << 30;
  DeviceBuffer a(big), b(big);
  const double copy_ms = time_ms([&] { COLIBRI_CUDA_CHECK(cudaMemcpyAsync(b.get(), a.get(), big, cudaMemcpyDeviceToDevice)); }, 10);
  const double peak_gbs = 2.0 * big / (copy_ms * 1e-3) / 1e9;
  std::mt19937_64 rng(7);
  const int64_t N = 8192;
  DeviceBuffer ga = upload(random_bf16(rng, static_cast<size_t>(N * N), 0.01f));
  DeviceBuffer gb = upload(random_bf16(rng, static_cast<size_t>(N * N), 0.01f));
  DeviceBuffer gc(static_cast<size_t>(N * N) * 4);
  Gemm gemm;
  const double gemm_ms = time_ms([&] { gemm.run(ga.as<uint16_t>(), N, N, gb.as<uint16_t>(), N, gc.as<float>()); }, 10);
  const double peak_tflops = 2.0 * N * N * N / (gemm_ms * 1e-3) / 1e12;
  std::printf("measured peaks: device copy %.0f GB/s (read + write), bf16 GEMM 8192^3 %.0f TFLOP/s (f32 output)\n",
              peak_gbs, peak_tflops);
  // Mixtral-8x7B's expert: hidden 4096, inter 14336, bf16 (352 MB); 8 experts so
  // that each call reads its weights from HBM (60 MB of L2).
  FfnShape s;
  s.hidden = 4096, s.inter = 14336;
  const PackedFfnLayout l = PackedFfnLayout::of(s, false);
  const int E = 8;
  DeviceBuffer experts(l.bytes * E);
  {
    std::vector<uint16_t> w = random_bf16(rng, l.bytes / 2, 0.01f);
    for (int e = 0; e < E; ++e) experts.upload(w.data(), l.bytes, l.bytes * e);
  }
  const int64_t max_rows = 8192;
  FfnRunner runner(s, max_rows);
  DeviceBuffer x(static_cast<size_t>(max_rows * s.hidden) * 4), y(static_cast<size_t>(max_rows * s.hidden) * 4);
  {
    std::vector<float> xv(static_cast<size_t>(max_rows * s.hidden));
    std::normal_distribution<float> d(0.0f, 1.0f);
    for (auto& v : xv) v = d(rng);
    x.upload(xv.data(), xv.size() * 4);
  }
  const double wbytes = 3.0 * s.hidden * s.inter * 2;
  std::printf("\nexpert FFN (Mixtral-8x7B expert: hidden 4096, inter 14336, bf16 weights %.0f MB), %d experts in turn\n",
              wbytes / 1e6, E);
  std::printf("%8s %10s %10s %10s %12s %12s\n", "rows", "ms", "GB/s", "of peak", "TFLOP/s", "of peak");
  int next = 0;
  for (int64_t rows : {1, 2, 4, 8, 16, 32, 64, 1024, 2048, 4096, 8192}) {
    const double ms = time_ms(
        [&] {
          runner.run(DeviceFfn::at(static_cast<char*>(experts.get()) + l.bytes * (next++ % E), l), x.as<float>(), rows,
                     y.as<float>());
        },
        rows >= 1024 ? 5 : 40);
    const double gbs = wbytes / (ms * 1e-3) / 1e9, tf = 6.0 * s.hidden * s.inter * rows / (ms * 1e-3) / 1e12;
    std::printf("%8lld %10.3f %10.0f %9.0f%% %12.1f %11.0f%%\n", (long long)rows, ms, gbs, 100 * gbs / peak_gbs, tf,
                100 * tf / peak_tflops);
  }
  // Host to device: one expert from pinned memory, and from pageable memory.
  void* pinned = nullptr;
  COLIBRI_CUDA_CHECK(cudaMallocHost(&pinned, l.bytes));
  std::memset(pinned, 1, l.bytes);
  const double h2d_ms = time_ms([&] { COLIBRI_CUDA_CHECK(cudaMemcpyAsync(experts.get(), pinned, l.bytes, cudaMemcpyHostToDevice)); }, 5);
  std::vector<char> pageable(l.bytes, 1);
  const double pg_ms = time_ms([&] { COLIBRI_CUDA_CHECK(cudaMemcpy(experts.get(), pageable.data(), l.bytes, cudaMemcpyHostToDevice)); }, 3);
  std::printf("\nexpert load host -> device (%.0f MB): pinned %.1f GB/s, pageable %.1f GB/s\n", l.bytes / 1e6,
              l.bytes / (h2d_ms * 1e-3) / 1e9, l.bytes / (pg_ms * 1e-3) / 1e9);
  cudaFreeHost(pinned);
  std::printf("not measured yet: router and permute kernels (not written)\n");
}

}  // namespace

int main(int argc, char** argv) {
  const bool do_bench = argc > 1 && std::strcmp(argv[1], "--bench") == 0;
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("SKIP: no CUDA device\n");
    return 77;
  }
  const uint64_t seed = std::random_device{}();
  std::printf("cuda_check: %d device(s), seed %llu\n", n, (unsigned long long)seed);
  std::mt19937_64 rng(seed);
  try {
    check_to_bf16(rng);
    check_gemm(rng);
    check_ffn(rng, false);
    check_ffn(rng, true);
    check_ffn(rng, false, 200, 136, 1);  // rows inside a block: x, y 800 bytes past 256-byte alignment
  } catch (const std::exception& e) {
    std::printf("FAIL: %s\n", e.what());
    return 1;
  }
  std::printf("%d checks, %d failed\n", checks, failures);
  if (failures) return 1;
  if (do_bench) {
    try {
      bench();
    } catch (const std::exception& e) {
      std::printf("benchmark failed: %s\n", e.what());
      return 1;
    }
  }
  return 0;
}
