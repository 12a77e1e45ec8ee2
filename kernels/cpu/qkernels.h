// qkernels.h: matrix products on quantised weights (model/quant.h: int8 or
// int4 codes, one f16 scale per group of G inputs) without expanding them.
//
// The activation rows are quantised on the fly to int8 in blocks of
// B = min(G, 32) inputs (symmetric: d = max|x| / 127 in f32, q = round_half_even(x / d),
// computed as x * (1 / d)); each block's integer dot product with the weight
// codes is exact in int32, then
//     y[r][o] = sum_b (w_scale[o][b*B / G] * d[r][b]) * isum[r][o][b]   (f32).
// The scalar reference ("generic") and the SIMD versions ("avx2":
// maddubs/madd; "avx512": VNNI dpbusd) compute the same integers and the same
// per-block factors; they differ only in the order of the f32 accumulation
// (documented tolerance in docs/quantization.md). Every version gives a row the
// same bits whatever the number of rows in the batch. A non-finite input in a
// block makes that row's outputs NaN.
#pragma once
#include <cstdint>
#include <vector>

#include "model/quant.h"

namespace colibri::qkernels {

// A quantised matrix [out, in] (in a multiple of group).
struct QMatrix {
  QuantType type = QuantType::Int8;
  int64_t group = 32;
  int64_t in = 0;
  const uint8_t* codes = nullptr;    // [out][quant_row_bytes(type, in)]
  const uint16_t* scales = nullptr;  // [out][in / group] f16
};

// Activation rows quantised for one weight type and group size.
struct QActs {
  int64_t rows = 0, in = 0, block = 32, nb = 0;  // nb = in / block
  int64_t q_stride = 0;                          // bytes per row of q (a multiple of 64)
  const int8_t* q = nullptr;                     // [rows][q_stride] codes
  const float* d = nullptr;                      // [rows][nb] block scales
  // [rows][nb][8] int32: lane k is -offset * (q[4k] + ... + q[4k+3]) of the
  // block (zero past the block), offset 128 for int8 weights and 8 for int4:
  // the SIMD kernels feed the weights as unsigned codes + offset and start each
  // block's 8 int32 lanes here, so every lane holds the exact signed partial dot
  // product of its 4 elements.
  const int32_t* corr = nullptr;
  const float* d8 = nullptr;  // [rows][nb][8]: d broadcast to 8 lanes (the AVX2 kernels' loads)
  // The same codes and corrections by quads of 4 blocks of 32 (block == 32 only;
  // the AVX-512 kernels' layout): one 512-bit dot product covers 4 blocks. In a
  // last, partial quad the entries past nb are not written (stale values); the
  // kernels zero the weight codes and scales there, so they add nothing.
  int64_t nquads = 0;                  // (nb + 3) / 4
  const int8_t* quad_q = nullptr;      // [rows][nquads][128]: codes 0-15 of its 4 blocks, then codes 16-31
  const int32_t* quad_corr = nullptr;  // [rows][nquads][16] int32: lane 4j + k is corr lane k + corr lane k+4 of block j
};

// Owns the memory of a QActs (64-byte aligned; grows, never shrinks).
class QActBuffer {
 public:
  QActBuffer() = default;
  QActBuffer(const QActBuffer&) = delete;  // acts() points into the buffer
  QActBuffer& operator=(const QActBuffer&) = delete;
  QActBuffer(QActBuffer&&) noexcept = default;
  QActBuffer& operator=(QActBuffer&&) noexcept = default;
  // Sizes the buffer for `rows` rows of `in` inputs in blocks of `block`; the
  // pointers stay valid until the next prepare().
  void prepare(int64_t rows, int64_t in, int64_t block);
  const QActs& acts() const { return acts_; }
  int8_t* q() { return const_cast<int8_t*>(acts_.q); }
  float* d() { return const_cast<float*>(acts_.d); }
  int32_t* corr() { return const_cast<int32_t*>(acts_.corr); }
  float* d8() { return const_cast<float*>(acts_.d8); }
  int8_t* quad_q() { return const_cast<int8_t*>(acts_.quad_q); }
  int32_t* quad_corr() { return const_cast<int32_t*>(acts_.quad_corr); }

 private:
  std::vector<uint8_t> mem_;
  QActs acts_;
};

struct QKernelTable {
  const char* name;
  // Quantises rows [r_begin, r_end) of x (row r at x + r * ldx) for weights of
  // type t into rows [r_begin, r_end) of a buffer prepared for (rows, in, quant_unit(group)).
  void (*quantize)(const float* x, int64_t ldx, int64_t r_begin, int64_t r_end, QuantType t, QActBuffer& buf);
  // The same for blocks [b_begin, b_end) of those rows only (x: the rows' start).
  void (*quantize_blocks)(const float* x, int64_t ldx, int64_t r_begin, int64_t r_end, int64_t b_begin, int64_t b_end,
                          QuantType t, QActBuffer& buf);
  // y[r * ldy + o] = sum_i x[r][i] * W[o][i] for r < a.rows, o in [o_begin, o_end).
  void (*gemm)(const QActs& a, const QMatrix& w, int64_t o_begin, int64_t o_end, float* y, int64_t ldy);
};

const QKernelTable& generic_table();
const QKernelTable& avx2_table();
const QKernelTable& avx512_table();
bool cpu_has_avx2();    // AVX2, FMA, F16C
bool cpu_has_avx512();  // AVX-512 F, BW, VL and VNNI (plus the AVX2 set)

// The table in use: avx512, else avx2, else generic, as the CPU allows; the
// environment variable COLIBRI_QKERNELS=generic|avx2|avx512 picks a lower one.
const QKernelTable& active();
// Forces "generic", "avx2" or "avx512" (tests, benchmarks); false when unavailable.
bool select(const char* name);

// One table's product with KernelTable::gemm's contract: quantises the rows of x
// (in a thread-local buffer), then y[r * ldy + o] for o in [o_begin, o_end).
void gemm_with(const QKernelTable& k, const float* x, int64_t ldx, int64_t rows, const QMatrix& w, int64_t o_begin,
               int64_t o_end, float* y, int64_t ldy);

// Threaded (OpenMP over blocks of 16 outputs; results independent of the thread
// count), with the active table: quantise once, then the product.
void gemm(const float* x, int64_t ldx, int64_t rows, const QMatrix& w, int64_t out, float* y, int64_t ldy);
// The same in two steps, to share one quantisation between several matrices
// of the same type, group and width (an expert's gate and up).
const QActs& quantize(const float* x, int64_t ldx, int64_t rows, int64_t in, QuantType t, int64_t group,
                      QActBuffer& buf);
void gemm(const QActs& a, const QMatrix& w, int64_t out, float* y, int64_t ldy);

// Several products of the same rows (attention's q, k and v) in one parallel
// region, as kernels::gemm_many: x quantised once, every job's blocks of 16
// outputs in one loop; each result is bitwise what gemm() gives for it alone.
// The matrices must share type, group and width; at most kMaxGemmMany jobs.
struct QGemmJob {
  QMatrix w;
  int64_t out;
  float* y;
  int64_t ldy;
};
inline constexpr int kMaxGemmMany = 8;
void gemm_many(const float* x, int64_t ldx, int64_t rows, const QGemmJob* jobs, int n);

}  // namespace colibri::qkernels
