// kernels.cpp: run-time ISA selection and the threaded wrappers.
#include "kernels/cpu/kernels.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>

#include "model/error.h"

namespace colibri::kernels {

namespace generic { const KernelTable& table(); }
const KernelTable& generic_table() { return generic::table(); }

#if COLIBRI_X86_KERNELS
namespace avx2 { const KernelTable& table(); }
namespace avx512 { const KernelTable& table(); }

const KernelTable& avx2_table() { return avx2::table(); }
const KernelTable& avx512_table() { return avx512::table(); }

bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

bool cpu_has_avx512() {
  __builtin_cpu_init();
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}
#else
// Not x86-64: only the generic table is compiled (see kernels.h).
const KernelTable& avx2_table() {
  throw Error(Status::Unsupported, "the AVX2 kernels exist only in an x86-64 build");
}
const KernelTable& avx512_table() {
  throw Error(Status::Unsupported, "the AVX-512 kernels exist only in an x86-64 build");
}
bool cpu_has_avx2() { return false; }
bool cpu_has_avx512() { return false; }
#endif

const KernelTable* table_named(const char* name) {
  if (std::strcmp(name, "generic") == 0) return &generic_table();
  if (std::strcmp(name, "avx2") == 0 && cpu_has_avx2()) return &avx2_table();
  if (std::strcmp(name, "avx512") == 0 && cpu_has_avx512()) return &avx512_table();
  return nullptr;
}

namespace {
// NOTE: chosen once at start-up (static initialisation), so concurrent
// readers never race with the lazy choice; select() changes it for tests.
std::atomic<const KernelTable*> g_active{nullptr};
// The widest the CPU supports, unless COLIBRI_KERNELS names another it supports.
const KernelTable* default_table() {
  if (const char* env = std::getenv("COLIBRI_KERNELS"))
    if (const KernelTable* t = table_named(env)) return t;
  return cpu_has_avx512() ? &avx512_table() : cpu_has_avx2() ? &avx2_table() : &generic_table();
}
[[maybe_unused]] const bool g_init = (g_active.store(default_table()), true);
}  // namespace

const KernelTable& active() {
  const KernelTable* t = g_active.load(std::memory_order_acquire);
  if (!t) {
    t = default_table();
    g_active.store(t);
  }
  return *t;
}

bool select(const char* name) {
  const KernelTable* t = table_named(name);
  if (t) g_active = t;
  return t != nullptr;
}

const KernelTable& default_kernels() { return *default_table(); }

namespace {
std::atomic<bool> g_stats_on{false};
std::atomic<uint64_t> g_stats_flops{0}, g_stats_ns{0}, g_stats_calls{0};
}  // namespace

void enable_gemm_stats(bool on) { g_stats_on.store(on, std::memory_order_relaxed); }
void reset_gemm_stats() {
  g_stats_flops = 0;
  g_stats_ns = 0;
  g_stats_calls = 0;
}
GemmStats gemm_stats() {
  return {g_stats_flops.load() * 1.0, g_stats_ns.load() * 1e-9, g_stats_calls.load()};
}

static void gemm_impl(const float* x, int64_t ldx, int64_t rows, const void* w, DType wt, int64_t in, int64_t out,
                      float* y, int64_t ldy);

void gemm(const float* x, int64_t ldx, int64_t rows, const void* w, DType wt, int64_t in, int64_t out, float* y,
          int64_t ldy) {
  if (!g_stats_on.load(std::memory_order_relaxed) || omp_in_parallel()) {
    gemm_impl(x, ldx, rows, w, wt, in, out, y, ldy);
    return;
  }
  const auto t0 = std::chrono::steady_clock::now();
  gemm_impl(x, ldx, rows, w, wt, in, out, y, ldy);
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  g_stats_flops += static_cast<uint64_t>(2 * rows * in * out);
  g_stats_ns += static_cast<uint64_t>(ns);
  ++g_stats_calls;
}

static void gemm_impl(const float* x, int64_t ldx, int64_t rows, const void* w, DType wt, int64_t in, int64_t out,
                      float* y, int64_t ldy) {
  const KernelTable& k = active();
  // NOTE: threads split the output columns in blocks of 16; work per thread is
  // tiny below a few thousand multiply-adds, so small products stay serial.
  const int64_t work = rows * in * out;
  if (work < (1 << 15) || omp_get_max_threads() == 1 || omp_in_parallel()) {
    k.gemm(x, ldx, rows, w, wt, in, 0, out, y, ldy);
    return;
  }
  // Each thread one contiguous range of outputs (a multiple of 16 wide), so a
  // kernel call can block its weights for the caches across all the rows.
  const int64_t blocks = (out + 15) / 16;
#pragma omp parallel
  {
    const int64_t nt = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t b0 = blocks * me / nt, b1 = blocks * (me + 1) / nt;
    if (b1 > b0) k.gemm(x, ldx, rows, w, wt, in, b0 * 16, std::min(out, b1 * 16), y, ldy);
  }
}

void gemm_many(const GemmJob* jobs, int n) {
  int64_t work = 0;
  for (int j = 0; j < n; ++j) work += jobs[j].rows * jobs[j].in * jobs[j].out;
  if (n == 1 || work < (1 << 15) || omp_get_max_threads() == 1 || omp_in_parallel()) {
    for (int j = 0; j < n; ++j) {
      const GemmJob& g = jobs[j];
      gemm(g.x, g.ldx, g.rows, g.w, g.wt, g.in, g.out, g.y, g.ldy);
    }
    return;
  }
  const bool stats = g_stats_on.load(std::memory_order_relaxed);
  const auto t0 = std::chrono::steady_clock::now();
  const KernelTable& k = active();
#pragma omp parallel
  {
    // Every thread takes its contiguous share of every job's outputs.
    const int64_t nt = omp_get_num_threads(), me = omp_get_thread_num();
    for (int j = 0; j < n; ++j) {
      const GemmJob& g = jobs[j];
      const int64_t blocks = (g.out + 15) / 16, b0 = blocks * me / nt, b1 = blocks * (me + 1) / nt;
      if (b1 > b0) k.gemm(g.x, g.ldx, g.rows, g.w, g.wt, g.in, b0 * 16, std::min(g.out, b1 * 16), g.y, g.ldy);
    }
  }
  if (stats) {
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    uint64_t flops = 0;
    for (int j = 0; j < n; ++j) flops += static_cast<uint64_t>(2 * jobs[j].rows * jobs[j].in * jobs[j].out);
    g_stats_flops += flops;
    g_stats_ns += static_cast<uint64_t>(ns);
    g_stats_calls += static_cast<uint64_t>(n);
  }
}

void to_f32(const void* src, DType t, int64_t n, float* dst) {
  convert_elements(src, t, dst, DType::F32, static_cast<size_t>(n));
}

int set_threads(int n) {
  if (n < 0 || n > kMaxThreads)
    throw Error(Status::InvalidArgument, "thread count " + std::to_string(n) + " is out of range [0, " +
                                             std::to_string(kMaxThreads) + "] (0 = all cores)");
  if (n > 0) omp_set_num_threads(n);
  return omp_get_max_threads();
}

}  // namespace colibri::kernels
