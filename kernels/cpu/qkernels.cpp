// qkernels.cpp: run-time ISA selection and the threaded wrappers of the
// quantised-weight kernels.
#include "kernels/cpu/qkernels.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "kernels/cpu/kernels.h"
#include "model/error.h"

namespace colibri::qkernels {

namespace generic { const QKernelTable& table(); }
const QKernelTable& generic_table() { return generic::table(); }

#if COLIBRI_X86_KERNELS
namespace avx2 { const QKernelTable& table(); }
namespace avx512 { const QKernelTable& table(); }

const QKernelTable& avx2_table() { return avx2::table(); }
const QKernelTable& avx512_table() { return avx512::table(); }

bool cpu_has_avx2() { return kernels::cpu_has_avx2(); }

// The float kernels' AVX-512 set, and VNNI for the integer dot products.
bool cpu_has_avx512() { return kernels::cpu_has_avx512() && __builtin_cpu_supports("avx512vnni"); }
#else
// Not x86-64: only the generic table is compiled (see kernels/cpu/kernels.h).
const QKernelTable& avx2_table() {
  throw Error(Status::Unsupported, "the AVX2 quantised kernels exist only in an x86-64 build");
}
const QKernelTable& avx512_table() {
  throw Error(Status::Unsupported, "the AVX-512 quantised kernels exist only in an x86-64 build");
}
bool cpu_has_avx2() { return false; }
bool cpu_has_avx512() { return false; }
#endif

namespace {

const QKernelTable* table_by_name(const char* name) {
  if (std::strcmp(name, "generic") == 0) return &generic_table();
  if (std::strcmp(name, "avx2") == 0 && cpu_has_avx2()) return &avx2_table();
  if (std::strcmp(name, "avx512") == 0 && cpu_has_avx512()) return &avx512_table();
  return nullptr;
}

const QKernelTable* default_table() {
  const QKernelTable* best = cpu_has_avx512() ? &avx512_table() : cpu_has_avx2() ? &avx2_table() : &generic_table();
  if (const char* env = std::getenv("COLIBRI_QKERNELS")) {
    // NOTE: only a table the CPU runs, and never a "higher" one than it supports.
    if (const QKernelTable* t = table_by_name(env)) return t;
  }
  return best;
}

// NOTE: chosen once at start-up (static initialisation), as kernels::active().
std::atomic<const QKernelTable*> g_active{nullptr};
[[maybe_unused]] const bool g_init = (g_active.store(default_table()), true);

constexpr uint64_t align64(uint64_t v) { return (v + 63) / 64 * 64; }

}  // namespace

const QKernelTable& active() {
  const QKernelTable* t = g_active.load(std::memory_order_acquire);
  if (!t) {
    t = default_table();
    g_active.store(t);
  }
  return *t;
}

bool select(const char* name) {
  const QKernelTable* t = table_by_name(name);
  if (!t) return false;
  g_active = t;
  return true;
}

void QActBuffer::prepare(int64_t rows, int64_t in, int64_t block) {
  if (block <= 0 || in % block != 0)
    throw Error(Status::Internal, "quantised product: width " + std::to_string(in) + " is not a multiple of the block " +
                                      std::to_string(block));
  QActs& a = acts_;
  a.rows = rows;
  a.in = in;
  a.block = block;
  a.nb = in / block;
  a.q_stride = static_cast<int64_t>(align64(static_cast<uint64_t>(in)));
  const uint64_t r = static_cast<uint64_t>(rows);
  const uint64_t qb = align64(r * static_cast<uint64_t>(a.q_stride));
  const uint64_t db = align64(r * static_cast<uint64_t>(a.nb) * sizeof(float));
  const uint64_t cb = align64(r * static_cast<uint64_t>(a.nb) * 8 * sizeof(int32_t));
  a.nquads = (a.nb + 3) / 4;
  const uint64_t quads = r * static_cast<uint64_t>(a.nquads);
  const uint64_t qqb = quads * 128, qcb = quads * 16 * sizeof(int32_t);  // multiples of 64
  if (mem_.size() < qb + db + 2 * cb + qqb + qcb + 64) mem_.resize(qb + db + 2 * cb + qqb + qcb + 64);
  uint8_t* base = mem_.data();
  base += (64 - reinterpret_cast<uintptr_t>(base) % 64) % 64;
  a.q = reinterpret_cast<const int8_t*>(base);
  a.d = reinterpret_cast<const float*>(base + qb);
  a.corr = reinterpret_cast<const int32_t*>(base + qb + db);
  a.d8 = reinterpret_cast<const float*>(base + qb + db + cb);
  a.quad_q = reinterpret_cast<const int8_t*>(base + qb + db + 2 * cb);
  a.quad_corr = reinterpret_cast<const int32_t*>(base + qb + db + 2 * cb + qqb);
}

namespace {
// NOTE: one per thread that calls the wrappers (workers may run in threads);
// the OpenMP team of one call only reads it.
QActBuffer& scratch() {
  thread_local QActBuffer b;
  return b;
}
}  // namespace

void gemm_with(const QKernelTable& k, const float* x, int64_t ldx, int64_t rows, const QMatrix& w, int64_t o_begin,
               int64_t o_end, float* y, int64_t ldy) {
  QActBuffer& b = scratch();
  b.prepare(rows, w.in, quant_unit(w.group));
  k.quantize(x, ldx, 0, rows, w.type, b);
  k.gemm(b.acts(), w, o_begin, o_end, y, ldy);
}

const QActs& quantize(const float* x, int64_t ldx, int64_t rows, int64_t in, QuantType t, int64_t group,
                      QActBuffer& buf) {
  const QKernelTable& k = active();
  buf.prepare(rows, in, quant_unit(group));
  // NOTE: rows are independent; big batches quantise in parallel.
  if (rows >= 8 && rows * in >= (1 << 16) && omp_get_max_threads() > 1 && !omp_in_parallel()) {
    const int64_t chunks = std::min<int64_t>(rows, 4 * omp_get_max_threads());
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) k.quantize(x, ldx, rows * c / chunks, rows * (c + 1) / chunks, t, buf);
  } else {
    k.quantize(x, ldx, 0, rows, t, buf);
  }
  return buf.acts();
}

void gemm(const QActs& a, const QMatrix& w, int64_t out, float* y, int64_t ldy) {
  const QKernelTable& k = active();
  // NOTE: as kernels::gemm: blocks of 16 outputs, small products stay serial.
  const int64_t work = a.rows * a.in * out;
  if (work < (1 << 15) || omp_get_max_threads() == 1 || omp_in_parallel()) {
    k.gemm(a, w, 0, out, y, ldy);
    return;
  }
  const int64_t blocks = (out + 15) / 16;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) k.gemm(a, w, b * 16, std::min(out, b * 16 + 16), y, ldy);
}

void gemm(const float* x, int64_t ldx, int64_t rows, const QMatrix& w, int64_t out, float* y, int64_t ldy) {
  const QActs& a = quantize(x, ldx, rows, w.in, w.type, w.group, scratch());
  gemm(a, w, out, y, ldy);
}

void gemm_many(const float* x, int64_t ldx, int64_t rows, const QGemmJob* jobs, int n) {
  if (n < 1) return;
  if (n > kMaxGemmMany) throw Error(Status::Internal, "quantised gemm_many: more than 8 products");
  const QMatrix& w0 = jobs[0].w;
  // first[j]: job j's first block of 16 outputs in the shared loop.
  int64_t first[kMaxGemmMany + 1] = {0};
  for (int j = 0; j < n; ++j) {
    if (jobs[j].w.type != w0.type || jobs[j].w.group != w0.group || jobs[j].w.in != w0.in)
      throw Error(Status::Internal, "quantised gemm_many: the products differ in type, group or width");
    first[j + 1] = first[j] + (jobs[j].out + 15) / 16;
  }
  const QActs& a = quantize(x, ldx, rows, w0.in, w0.type, w0.group, scratch());
  const QKernelTable& k = active();
  const int64_t blocks = first[n];
#pragma omp parallel for schedule(static) if (omp_get_max_threads() > 1 && !omp_in_parallel())
  for (int64_t b = 0; b < blocks; ++b) {
    int j = 0;
    while (b >= first[j + 1]) ++j;
    const QGemmJob& job = jobs[j];
    const int64_t o = (b - first[j]) * 16;
    k.gemm(a, job.w, o, std::min(job.out, o + 16), job.y, job.ldy);
  }
}

}  // namespace colibri::qkernels
