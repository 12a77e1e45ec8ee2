// cuda_check.cu: the CUDA kernels checked against CPU references, and their
// speed, in one standalone program that needs only the CUDA toolkit (the GPU
// machine lent to some sessions has no Colibri build dependencies):
//   nvcc -O2 -std=c++17 -arch=sm_90 -I. -Iinclude tests/cuda_check.cu kernels/cuda/ffn.cu
//        kernels/cuda/dense.cu -lcublasLt -o cuda_check
// Also built by CMake when CUDA is found, and run by ctest as `cuda.check`,
// which exits 77 (skipped) on a machine without a GPU.
//
//   cuda_check            the checks (exit 0 all passed, 1 a failure, 77 no GPU)
//   cuda_check --bench    the checks, then the benchmark table (scripts/gpu_check.sh)
//
// Checks (tests/cuda_checks.h, shared with the CPU emulation of the kernels,
// tests/cuda_emu: ctest cuda.emulated.*) (random inputs; the seed is printed; every output element is checked,
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
// - Gemm::run with row strides (the pads stay unwritten); Gemm::run_f32 (f32 inputs,
//   no TF32) within 1e-5 of sum |x w| of a double product, strided and packed.
// - Dense layers (kernels/cuda/dense.h): add, add_bias, clamp (NaN kept), copy_rows and
//   embed (f32, f16 with subnormals, bf16 tables) bitwise; rmsnorm (strided, float4
//   path, per-head in place) and rope (both layouts, rd < head_dim, several heads)
//   against double references; kv_store bitwise, then attention against a double
//   softmax: GQA with group 1, 2 and 4, windows (1 and longer), sinks, head dims 32 to
//   256, three sequences at different positions, decode rows and prefill-like runs of
//   consecutive positions (2400 (row, head) pairs, so every warp count is used), the
//   MLA layout (dk 96 / 576 / 1024, dv the latent), a position past the context gives
//   NaN; route against router.cpp's algorithm (copied here, same float order) for
//   Mixtral, Qwen2/3, DeepSeek-V3 (sigmoid, score bias, top2_sum groups, scaling),
//   DeepSeek-V2 (groups max), gpt-oss (topk_softmax), E up to 1024, k up to 32, and
//   exact ties (lower index wins): experts exactly (a row whose CPU choice was within
//   2e-6 of a flip is noted, not failed), weights within 5e-6; permute_plan (order,
//   inverse, offsets exactly a stable counting sort's; empty experts; 16k assignments;
//   misaligned scratch), permute_rows (and as a k = 1 gather), unpermute_combine
//   (bitwise the CPU's fma order, overwrite and accumulate); sigmoid_gate.
// The benchmark adds the dense kernels: route (Mixtral, DeepSeek-V3) at 1, 64 and 8192
// rows, permute_plan / permute_rows / unpermute_combine at 64 and 8192 rows (hidden
// 4096, k 8), attention at decode (64 sequences and 1 at 4096, 32 heads, 8 kv heads,
// hd 128) and prefill (2048 rows), kv_store, rmsnorm, add, sigmoid_gate, rope and embed
// at 8192 x 4096; medians of timed repetitions.
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
#include "kernels/cuda/dense.h"
#include "kernels/cuda/ffn.h"
#include "model/error.h"

using namespace colibri;
using namespace colibri::cuda;

#include "tests/cuda_checks.h"  // the checks: check_gemm, check_ffn, check_attention, ...

namespace {

// ---- dense benchmark ---------------------------------------------------------------

double median_ms(const std::function<void()>& f, int reps) {
  cudaEvent_t a, b;
  COLIBRI_CUDA_CHECK(cudaEventCreate(&a));
  COLIBRI_CUDA_CHECK(cudaEventCreate(&b));
  f();  // warm-up
  COLIBRI_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> t(static_cast<size_t>(reps));
  for (auto& ms : t) {
    COLIBRI_CUDA_CHECK(cudaEventRecord(a));
    f();
    COLIBRI_CUDA_CHECK(cudaEventRecord(b));
    COLIBRI_CUDA_CHECK(cudaEventSynchronize(b));
    COLIBRI_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

void bench_dense() {
  std::mt19937_64 rng(11);
  std::printf("\ndense kernels (median of timed reps)\n");
  std::printf("%-64s %10s %10s\n", "kernel", "ms", "GB/s");
  auto row = [](const std::string& what, double ms, double bytes) {
    if (bytes > 0) std::printf("%-64s %10.4f %10.0f\n", what.c_str(), ms, bytes / (ms * 1e-3) / 1e9);
    else std::printf("%-64s %10.4f %10s\n", what.c_str(), ms, "-");
  };
  {  // router
    const int64_t max_rows = 8192;
    DeviceBuffer logits = upload(random_f32(rng, static_cast<size_t>(max_rows * 256), 1.0f));
    DeviceBuffer bias = upload(random_f32(rng, 256, 0.05f));
    DeviceBuffer ex(static_cast<size_t>(max_rows * 8) * 4), w(static_cast<size_t>(max_rows * 8) * 4);
    struct R {
      const char* name;
      RouteCfg cfg;
      int64_t E, k;
      bool bias;
    } rs[] = {{"mixtral softmax E 8 k 2", {RouteScoring::Softmax, RouteGroups::None, 1, 1, true, 1.0f}, 8, 2, false},
              {"deepseek-v3 sigmoid top2_sum E 256 k 8",
               {RouteScoring::Sigmoid, RouteGroups::Top2Sum, 8, 4, true, 2.5f}, 256, 8, true}};
    for (const auto& r : rs)
      for (int64_t rows : {1, 64, 8192}) {
        RouteArgs a = route_args(r.cfg, rows, r.E, r.k);
        a.logits = logits.as<float>(), a.score_bias = r.bias ? bias.as<float>() : nullptr;
        a.experts = ex.as<int32_t>(), a.weights = w.as<float>();
        const double ms = median_ms([&] { route(a, nullptr); }, 50);
        row(std::string("route ") + r.name + ", rows " + std::to_string(rows), ms,
            static_cast<double>(rows) * r.E * 4);
      }
  }
  {  // permute_plan + permute_rows + unpermute_combine
    const int64_t hidden = 4096, k = 8, E = 256, max_rows = 8192, n = max_rows * k;
    std::vector<int32_t> exv(static_cast<size_t>(n));
    std::uniform_int_distribution<int32_t> ed(0, static_cast<int32_t>(E - 1));
    for (auto& e : exv) e = ed(rng);
    DeviceBuffer ex = upload(exv), order(static_cast<size_t>(n) * 4), inv(static_cast<size_t>(n) * 4),
                 off(static_cast<size_t>(E + 1) * 4), scratch(permute_scratch_bytes(n, E));
    DeviceBuffer w = upload(random_f32(rng, static_cast<size_t>(n), 0.1f));
    DeviceBuffer x(static_cast<size_t>(max_rows * hidden) * 4), y(static_cast<size_t>(max_rows * hidden) * 4);
    DeviceBuffer xp(static_cast<size_t>(n * hidden) * 4);
    COLIBRI_CUDA_CHECK(cudaMemset(x.get(), 0, x.bytes()));
    COLIBRI_CUDA_CHECK(cudaMemset(xp.get(), 0, xp.bytes()));
    for (int64_t rows : {64, 8192}) {
      const double plan_ms = median_ms(
          [&] {
            permute_plan(ex.as<int32_t>(), rows, k, E, order.as<int32_t>(), inv.as<int32_t>(), off.as<int32_t>(),
                         scratch.get(), scratch.bytes(), nullptr);
          },
          20);
      const double rows_ms = median_ms(
          [&] { permute_rows(x.as<float>(), hidden, order.as<int32_t>(), rows, k, hidden, xp.as<float>(), nullptr); },
          20);
      const double comb_ms = median_ms(
          [&] {
            unpermute_combine(xp.as<float>(), inv.as<int32_t>(), w.as<float>(), rows, k, hidden, y.as<float>(), false,
                              nullptr);
          },
          20);
      const double moved = static_cast<double>(rows) * k * hidden * 4;  // the permuted rows, each way
      const std::string tag = " (rows " + std::to_string(rows) + ", k 8, E 256, hidden 4096)";
      row("permute_plan" + tag, plan_ms, 0);
      row("permute_rows" + tag, rows_ms, moved + static_cast<double>(rows) * hidden * 4);
      row("unpermute_combine" + tag, comb_ms, moved + static_cast<double>(rows) * hidden * 4);
      row("  the three" + tag, plan_ms + rows_ms + comb_ms, 0);
    }
  }
  {  // decode attention: 64 sequences at position 4095, 32 heads, 8 kv heads, head dim 128
    const int64_t rows = 64, nh = 32, nkv = 8, hd = 128, ctx = 4096, KV = nkv * hd;
    DeviceBuffer kc(static_cast<size_t>(rows * ctx * KV) * 4), vc(static_cast<size_t>(rows * ctx * KV) * 4);
    COLIBRI_CUDA_CHECK(cudaMemset(kc.get(), 0x3c, kc.bytes()));  // 0x3c3c3c3c: about 0.0115
    COLIBRI_CUDA_CHECK(cudaMemset(vc.get(), 0x3c, vc.bytes()));
    DeviceBuffer q = upload(random_f32(rng, static_cast<size_t>(rows * nh * hd), 1.0f));
    DeviceBuffer out(static_cast<size_t>(rows * nh * hd) * 4);
    std::vector<int32_t> sv(static_cast<size_t>(rows)), pv(static_cast<size_t>(rows), static_cast<int32_t>(ctx - 1));
    for (int64_t r = 0; r < rows; ++r) sv[static_cast<size_t>(r)] = static_cast<int32_t>(r);
    DeviceBuffer ds = upload(sv), dp = upload(pv);
    AttentionArgs a;
    a.q = q.as<float>(), a.ldq = nh * hd, a.q_head_stride = hd;
    a.k = kc.as<float>(), a.v = vc.as<float>(), a.k_stride = KV, a.v_stride = KV, a.max_ctx = ctx;
    a.k_head_offset = hd, a.v_head_offset = hd, a.heads = nh, a.group = nh / nkv, a.dk = hd, a.dv = hd;
    a.seqs = ds.as<int32_t>(), a.pos = dp.as<int32_t>(), a.rows = rows, a.scale = 0.088f;
    a.out = out.as<float>(), a.ldo = nh * hd, a.o_head_stride = hd;
    const double ms = median_ms([&] { attention(a, nullptr); }, 10);
    row("attention decode (64 seqs x ctx 4096, 32/8 heads, hd 128)", ms, 2.0 * rows * ctx * KV * 4);
    a.rows = 1;
    const double ms1 = median_ms([&] { attention(a, nullptr); }, 10);
    row("attention decode (1 seq x ctx 4096, 32/8 heads, hd 128)", ms1, 2.0 * ctx * KV * 4);
    // Prefill: one sequence's positions 0..2047 as rows (causal), the cache rows of sequence 0.
    const int64_t prows = 2048;
    std::vector<int32_t> ps(static_cast<size_t>(prows), 0), pp(static_cast<size_t>(prows));
    for (int64_t r = 0; r < prows; ++r) pp[static_cast<size_t>(r)] = static_cast<int32_t>(r);
    DeviceBuffer dps = upload(ps), dpp = upload(pp);
    DeviceBuffer pq = upload(random_f32(rng, static_cast<size_t>(prows * nh * hd), 1.0f));
    DeviceBuffer pout(static_cast<size_t>(prows * nh * hd) * 4);
    a.q = pq.as<float>(), a.out = pout.as<float>(), a.seqs = dps.as<int32_t>(), a.pos = dpp.as<int32_t>(), a.rows = prows;
    const double pms = median_ms([&] { attention(a, nullptr); }, 3);
    row("attention prefill (2048 rows at 0..2047, 32/8 heads, hd 128)", pms, 0);
    // kv_store of 8192 rows of K (8 kv heads x 128) into the cache.
    const int64_t srows = 2048;
    DeviceBuffer src = upload(random_f32(rng, static_cast<size_t>(srows * KV), 1.0f));
    const double kms = median_ms(
        [&] { kv_store(src.as<float>(), KV, srows, KV, kc.as<float>(), KvLayout{ctx}, dps.as<int32_t>(), dpp.as<int32_t>(), nullptr); },
        20);
    row("kv_store (2048 rows of 1024)", kms, 2.0 * srows * KV * 4);
  }
  {  // element-wise and small kernels at 8192 x 4096
    const int64_t rows = 8192, H = 4096, nh = 32, hd = 128;
    DeviceBuffer x = upload(random_f32(rng, static_cast<size_t>(rows * H), 1.0f)), y(static_cast<size_t>(rows * H) * 4);
    DeviceBuffer w = upload(random_f32(rng, static_cast<size_t>(H), 0.02f));
    COLIBRI_CUDA_CHECK(cudaMemset(y.get(), 0, y.bytes()));
    const double bytes = static_cast<double>(rows) * H * 4;
    row("add 8192 x 4096", median_ms([&] { add(y.as<float>(), x.as<float>(), rows * H, nullptr); }, 20), 3 * bytes);
    row("sigmoid_gate 8192 x 4096",
        median_ms([&] { sigmoid_gate(x.as<float>(), w.as<float>(), y.as<float>(), rows, H, nullptr); }, 20), 3 * bytes);
    std::vector<float> cs(static_cast<size_t>(rows * hd / 2), 0.5f);
    std::vector<int32_t> pv(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) pv[static_cast<size_t>(r)] = static_cast<int32_t>(r);
    DeviceBuffer dc = upload(cs), dp = upload(pv);
    for (int64_t n : {64, 8192})
      row("rope " + std::to_string(n) + " rows x 32 heads x 128",
          median_ms([&] { rope(y.as<float>(), n, H, nh, hd, hd, false, dc.as<float>(), dc.as<float>(), dp.as<int32_t>(), nullptr); },
                    20),
          2.0 * n * H * 4);
    std::vector<int32_t> tok(static_cast<size_t>(rows));
    std::uniform_int_distribution<int32_t> td(0, 4095);
    for (auto& t : tok) t = td(rng);
    DeviceBuffer dt = upload(tok), table(static_cast<size_t>(4096 * H) * 2);
    COLIBRI_CUDA_CHECK(cudaMemset(table.get(), 0x3c, table.bytes()));
    row("embed 8192 rows x 4096 (bf16 table)",
        median_ms([&] { embed(table.get(), 2, dt.as<int32_t>(), rows, H, y.as<float>(), nullptr); }, 20), 1.5 * bytes);
  }
  {  // rmsnorm 8192 x 4096
    const int64_t rows = 8192, n = 4096;
    DeviceBuffer x = upload(random_f32(rng, static_cast<size_t>(rows * n), 1.0f)), y(static_cast<size_t>(rows * n) * 4);
    DeviceBuffer w = upload(random_f32(rng, static_cast<size_t>(n), 0.1f, 1.0f));
    const double ms = median_ms([&] { rmsnorm(x.as<float>(), n, w.as<float>(), y.as<float>(), n, rows, n, 1e-6f, nullptr); }, 20);
    row("rmsnorm 8192 x 4096", ms, 2.0 * rows * n * 4);
  }
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
    check_ffn_kernels(rng);
    check_dense_kernels(rng);
  } catch (const std::exception& e) {
    std::printf("FAIL: %s\n", e.what());
    return 1;
  }
  std::printf("%d checks, %d failed\n", checks, failures);
  if (failures) return 1;
  if (do_bench) {
    try {
      bench();
      bench_dense();
    } catch (const std::exception& e) {
      std::printf("benchmark failed: %s\n", e.what());
      return 1;
    }
  }
  return 0;
}
