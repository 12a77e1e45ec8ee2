// cublasLt.h of the CPU emulator: the part of cuBLASLt that kernels/cuda/ffn.cu
// uses. Descriptors, layouts and preferences are plain structs; the heuristic
// offers one algorithm when the types are a combination cuBLASLt supports (A and
// B both bf16, f16 or f32; C and D f32; compute CUBLAS_COMPUTE_32F*, scale f32),
// recording the pointer alignments it was promised; cublasLtMatmul is a plain
// GEMM in f32:
//   D = alpha * op(A) . op(B) + beta * C   (column-major; C not read when beta == 0)
// with op(A) m x k, op(B) k x n, D m x n, each matrix `ld` elements per column,
// checked like cuBLASLt checks them (shapes agree, ld >= rows, C and D the same
// layout when they are one buffer, pointers at least as aligned as promised, the
// workspace), and every operand inside a device allocation (else it aborts);
// strided batches (BATCH_COUNT, STRIDED_BATCH_OFFSET) as that many GEMMs.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "library_types.h"

enum cublasStatus_t {
  CUBLAS_STATUS_SUCCESS = 0,
  CUBLAS_STATUS_NOT_INITIALIZED = 1,
  CUBLAS_STATUS_ALLOC_FAILED = 3,
  CUBLAS_STATUS_INVALID_VALUE = 7,
  CUBLAS_STATUS_ARCH_MISMATCH = 8,
  CUBLAS_STATUS_MAPPING_ERROR = 11,
  CUBLAS_STATUS_EXECUTION_FAILED = 13,
  CUBLAS_STATUS_INTERNAL_ERROR = 14,
  CUBLAS_STATUS_NOT_SUPPORTED = 15,
};
enum cublasOperation_t { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1, CUBLAS_OP_C = 2 };
enum cublasComputeType_t {
  CUBLAS_COMPUTE_16F = 64,
  CUBLAS_COMPUTE_32F = 68,
  CUBLAS_COMPUTE_32F_FAST_16F = 74,
  CUBLAS_COMPUTE_32F_FAST_16BF = 75,
  CUBLAS_COMPUTE_32F_FAST_TF32 = 77,
};
enum cublasLtMatmulDescAttributes_t {
  CUBLASLT_MATMUL_DESC_COMPUTE_TYPE = 0,
  CUBLASLT_MATMUL_DESC_SCALE_TYPE = 1,
  CUBLASLT_MATMUL_DESC_POINTER_MODE = 2,
  CUBLASLT_MATMUL_DESC_TRANSA = 3,
  CUBLASLT_MATMUL_DESC_TRANSB = 4,
  CUBLASLT_MATMUL_DESC_TRANSC = 5,
};
enum cublasLtMatmulPreferenceAttributes_t {
  CUBLASLT_MATMUL_PREF_SEARCH_MODE = 0,
  CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1,
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES = 5,
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES = 6,
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES = 7,
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES = 8,
};

struct cublasLtContext {};
struct cublasLtMatmulDescOpaque_t {
  cublasComputeType_t compute;
  cudaDataType_t scale;
  int32_t transa = CUBLAS_OP_N, transb = CUBLAS_OP_N;
};
struct cublasLtMatrixLayoutOpaque_t {
  cudaDataType_t type;
  uint64_t rows, cols;
  int64_t ld;
  int32_t batch = 1;         // CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT
  int64_t batch_stride = 0;  // CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, in elements
};
enum cublasLtMatrixLayoutAttribute_t {
  CUBLASLT_MATRIX_LAYOUT_TYPE = 0,
  CUBLASLT_MATRIX_LAYOUT_ORDER = 1,
  CUBLASLT_MATRIX_LAYOUT_ROWS = 2,
  CUBLASLT_MATRIX_LAYOUT_COLS = 3,
  CUBLASLT_MATRIX_LAYOUT_LD = 4,
  CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT = 5,
  CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET = 6,
};
struct cublasLtMatmulPreferenceOpaque_t {
  uint64_t max_workspace = 0;
  uint32_t align[4] = {256, 256, 256, 256};  // A, B, C, D: the default promise is 256 bytes
};
typedef cublasLtContext* cublasLtHandle_t;
typedef cublasLtMatmulDescOpaque_t* cublasLtMatmulDesc_t;
typedef cublasLtMatrixLayoutOpaque_t* cublasLtMatrixLayout_t;
typedef cublasLtMatmulPreferenceOpaque_t* cublasLtMatmulPreference_t;
struct cublasLtMatmulAlgo_t {
  uint64_t data[8];  // [0] 1 when chosen by the heuristic, [1..4] the alignments it relies on
};
struct cublasLtMatmulHeuristicResult_t {
  cublasLtMatmulAlgo_t algo;
  size_t workspaceSize;
  cublasStatus_t state;
  float wavesCount;
  int reserved[4];
};

inline const char* cublasLtGetStatusName(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
  }
  return "CUBLAS_STATUS_UNKNOWN";
}
inline const char* cublasLtGetStatusString(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "success";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "the library was not initialized";
    case CUBLAS_STATUS_ALLOC_FAILED: return "the resource allocation failed";
    case CUBLAS_STATUS_INVALID_VALUE: return "an invalid numeric value was used as an argument";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "the functionality requested is not supported";
    default: return "an error occurred";
  }
}

inline cublasStatus_t cublasLtCreate(cublasLtHandle_t* h) {
  emu::RuntimeScope emu_runtime_scope_;
  *h = new cublasLtContext;
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) {
  emu::RuntimeScope emu_runtime_scope_;
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete h;
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* d, cublasComputeType_t compute,
                                               cudaDataType_t scale) {
  emu::RuntimeScope emu_runtime_scope_;
  *d = new cublasLtMatmulDescOpaque_t{compute, scale};
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) {
  emu::RuntimeScope emu_runtime_scope_;
  delete d;
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t a,
                                                     const void* buf, size_t bytes) {
  emu::RuntimeScope emu_runtime_scope_;
  if (!d || !buf) return CUBLAS_STATUS_INVALID_VALUE;
  int32_t v;
  if (bytes != sizeof v) return CUBLAS_STATUS_INVALID_VALUE;  // all of these are 32-bit
  std::memcpy(&v, buf, sizeof v);
  switch (a) {
    case CUBLASLT_MATMUL_DESC_TRANSA: d->transa = v; break;
    case CUBLASLT_MATMUL_DESC_TRANSB: d->transb = v; break;
    case CUBLASLT_MATMUL_DESC_COMPUTE_TYPE: d->compute = static_cast<cublasComputeType_t>(v); break;
    case CUBLASLT_MATMUL_DESC_SCALE_TYPE: d->scale = static_cast<cudaDataType_t>(v); break;
    default: return CUBLAS_STATUS_NOT_SUPPORTED;  // not emulated
  }
  if ((a == CUBLASLT_MATMUL_DESC_TRANSA || a == CUBLASLT_MATMUL_DESC_TRANSB) && v != CUBLAS_OP_N && v != CUBLAS_OP_T)
    return CUBLAS_STATUS_INVALID_VALUE;  // (CUBLAS_OP_C is T for real types; not emulated)
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* l, cudaDataType_t type, uint64_t rows,
                                                 uint64_t cols, int64_t ld) {
  emu::RuntimeScope emu_runtime_scope_;
  *l = new cublasLtMatrixLayoutOpaque_t{type, rows, cols, ld};
  return CUBLAS_STATUS_SUCCESS;
}
// Only the batch attributes (int32 count, int64 stride), with cuBLASLt's size checks.
inline cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t l, cublasLtMatrixLayoutAttribute_t attr,
                                                       const void* buf, size_t size) {
  emu::RuntimeScope emu_runtime_scope_;
  if (!l || !buf) return CUBLAS_STATUS_INVALID_VALUE;
  if (attr == CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT) {
    if (size != sizeof(int32_t)) return CUBLAS_STATUS_INVALID_VALUE;
    std::memcpy(&l->batch, buf, size);
    return l->batch >= 1 ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_INVALID_VALUE;
  }
  if (attr == CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET) {
    if (size != sizeof(int64_t)) return CUBLAS_STATUS_INVALID_VALUE;
    std::memcpy(&l->batch_stride, buf, size);
    return CUBLAS_STATUS_SUCCESS;
  }
  return CUBLAS_STATUS_NOT_SUPPORTED;  // not emulated
}
inline cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) {
  emu::RuntimeScope emu_runtime_scope_;
  delete l;
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* p) {
  emu::RuntimeScope emu_runtime_scope_;
  *p = new cublasLtMatmulPreferenceOpaque_t;
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
  emu::RuntimeScope emu_runtime_scope_;
  delete p;
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                           cublasLtMatmulPreferenceAttributes_t a, const void* buf,
                                                           size_t bytes) {
  emu::RuntimeScope emu_runtime_scope_;
  if (!p || !buf) return CUBLAS_STATUS_INVALID_VALUE;
  if (a == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES) {
    if (bytes != sizeof(uint64_t)) return CUBLAS_STATUS_INVALID_VALUE;
    std::memcpy(&p->max_workspace, buf, bytes);
    return CUBLAS_STATUS_SUCCESS;
  }
  if (a >= CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES && a <= CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES) {
    if (bytes != sizeof(uint32_t)) return CUBLAS_STATUS_INVALID_VALUE;
    std::memcpy(&p->align[a - CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES], buf, bytes);
    return CUBLAS_STATUS_SUCCESS;
  }
  return CUBLAS_STATUS_NOT_SUPPORTED;  // not emulated
}

namespace emu {
inline size_t type_bytes(cudaDataType_t t) {
  switch (t) {
    case CUDA_R_32F: return 4;
    case CUDA_R_16F:
    case CUDA_R_16BF: return 2;
    default: return 0;
  }
}
inline bool blas_types_ok(cublasLtMatmulDesc_t op, cudaDataType_t a, cudaDataType_t b, cudaDataType_t c,
                          cudaDataType_t d) {
  const bool f32_compute = op->compute == CUBLAS_COMPUTE_32F || op->compute == CUBLAS_COMPUTE_32F_FAST_TF32 ||
                           op->compute == CUBLAS_COMPUTE_32F_FAST_16BF || op->compute == CUBLAS_COMPUTE_32F_FAST_16F;
  return f32_compute && op->scale == CUDA_R_32F && a == b && type_bytes(a) && c == CUDA_R_32F && d == CUDA_R_32F;
}
inline float load(const void* p, cudaDataType_t t, size_t i) {
  switch (t) {
    case CUDA_R_32F: return static_cast<const float*>(p)[i];
    case CUDA_R_16BF: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case CUDA_R_16F: return __half2float(static_cast<const __half*>(p)[i]);
    default: return 0.0f;
  }
}
// The bytes a column-major rows x cols matrix with leading dimension ld spans.
inline size_t span_bytes(const cublasLtMatrixLayoutOpaque_t& l) {
  if (!l.rows || !l.cols) return 0;
  return ((l.batch - 1) * static_cast<size_t>(l.batch_stride) + (l.cols - 1) * static_cast<size_t>(l.ld) + l.rows) *
         type_bytes(l.type);
}
inline uint32_t align_of(const void* p) {
  const uintptr_t v = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && v % a) a >>= 1;
  return a;
}
}  // namespace emu

inline cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t op,
                                                     cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                                     cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                                     cublasLtMatmulPreference_t pref, int requested,
                                                     cublasLtMatmulHeuristicResult_t* results, int* found) {
  emu::RuntimeScope emu_runtime_scope_;
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!op || !a || !b || !c || !d || !pref || requested < 1 || !results || !found) return CUBLAS_STATUS_INVALID_VALUE;
  *found = 0;
  if (!emu::blas_types_ok(op, a->type, b->type, c->type, d->type)) return CUBLAS_STATUS_NOT_SUPPORTED;
  // Element alignment is the least the GEMM needs; it takes any larger promise as given.
  for (uint32_t al : pref->align)
    if (al == 0 || (al & (al - 1))) return CUBLAS_STATUS_INVALID_VALUE;
  results[0] = cublasLtMatmulHeuristicResult_t{};
  results[0].algo.data[0] = 1;
  for (int i = 0; i < 4; ++i) results[0].algo.data[1 + i] = pref->align[i];
  results[0].workspaceSize = 0;
  results[0].state = CUBLAS_STATUS_SUCCESS;
  results[0].wavesCount = 1.0f;
  *found = 1;
  return CUBLAS_STATUS_SUCCESS;
}

inline cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t op, const void* alpha, const void* A,
                                     cublasLtMatrixLayout_t Adesc, const void* B, cublasLtMatrixLayout_t Bdesc,
                                     const void* beta, const void* C, cublasLtMatrixLayout_t Cdesc, void* D,
                                     cublasLtMatrixLayout_t Ddesc, const cublasLtMatmulAlgo_t* algo, void* workspace,
                                     size_t workspace_bytes, cudaStream_t stream) {
  emu::RuntimeScope emu_runtime_scope_;
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!op || !alpha || !beta || !Adesc || !Bdesc || !Cdesc || !Ddesc) return CUBLAS_STATUS_INVALID_VALUE;
  if (!emu::valid_stream(stream)) return CUBLAS_STATUS_EXECUTION_FAILED;
  (void)workspace;
  if (!emu::blas_types_ok(op, Adesc->type, Bdesc->type, Cdesc->type, Ddesc->type)) return CUBLAS_STATUS_NOT_SUPPORTED;
  const cublasLtMatrixLayoutOpaque_t la = *Adesc, lb = *Bdesc, lc = *Cdesc, ld = *Ddesc;
  const bool ta = op->transa == CUBLAS_OP_T, tb = op->transb == CUBLAS_OP_T;
  const uint64_t m = ta ? la.cols : la.rows, k = ta ? la.rows : la.cols;
  const uint64_t kb = tb ? lb.cols : lb.rows, n = tb ? lb.rows : lb.cols;
  if (k != kb || ld.rows != m || ld.cols != n || lc.rows != m || lc.cols != n) return CUBLAS_STATUS_INVALID_VALUE;
  for (const auto* l : {&la, &lb, &lc, &ld})
    if (l->ld < 1 || static_cast<uint64_t>(l->ld) < l->rows) return CUBLAS_STATUS_INVALID_VALUE;
  if (C == D && (lc.type != ld.type || lc.ld != ld.ld)) return CUBLAS_STATUS_INVALID_VALUE;
  // Batched: every layout the same count (cuBLASLt also broadcasts a count of 1; not needed here).
  const int32_t batches = ld.batch;
  for (const auto* l : {&la, &lb, &lc})
    if (l->batch != batches) return CUBLAS_STATUS_INVALID_VALUE;
  if (algo) {
    if (algo->data[0] != 1) return CUBLAS_STATUS_INVALID_VALUE;  // not from the heuristic
    const void* ptrs[4] = {A, B, C, D};
    for (int i = 0; i < 4; ++i)
      if (ptrs[i] && emu::align_of(ptrs[i]) < algo->data[1 + i]) return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (workspace_bytes && !workspace) return CUBLAS_STATUS_INVALID_VALUE;
  if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
  const float al = *static_cast<const float*>(alpha), be = *static_cast<const float*>(beta);
  for (const void* p : {A, B, static_cast<const void*>(D)})
    if (!p) return CUBLAS_STATUS_INVALID_VALUE;
  if (k) {
    emu::require_device(A, emu::span_bytes(la), "cublasLtMatmul A");
    emu::require_device(B, emu::span_bytes(lb), "cublasLtMatmul B");
  }
  if (be != 0.0f) emu::require_device(C, emu::span_bytes(lc), "cublasLtMatmul C");
  emu::require_device(D, emu::span_bytes(ld), "cublasLtMatmul D");
  // Runs in stream order (the descriptors and scalars are taken now, as cuBLASLt does).
  const void *A0 = A, *B0 = B, *C0 = C;
  void* D0 = D;
  emu::enqueue(stream, [=] {
    for (int32_t bi = 0; bi < batches; ++bi) {
      const void* A = static_cast<const char*>(A0) + bi * la.batch_stride * emu::type_bytes(la.type);
      const void* B = static_cast<const char*>(B0) + bi * lb.batch_stride * emu::type_bytes(lb.type);
      const void* C = C0 ? static_cast<const char*>(C0) + bi * lc.batch_stride * 4 : nullptr;
      void* D = static_cast<char*>(D0) + bi * ld.batch_stride * 4;
      // op(A) as [m][k] and op(B) as [n][k], in f32 (exact for bf16 and f16).
      std::vector<float> a(m * k), b(n * k);
      for (uint64_t i = 0; i < m; ++i)
        for (uint64_t p = 0; p < k; ++p) a[i * k + p] = emu::load(A, la.type, ta ? p + i * la.ld : i + p * la.ld);
      for (uint64_t j = 0; j < n; ++j)
        for (uint64_t p = 0; p < k; ++p) b[j * k + p] = emu::load(B, lb.type, tb ? j + p * lb.ld : p + j * lb.ld);
      float* d = static_cast<float*>(D);
      const float* c = static_cast<const float*>(C);
      for (uint64_t j = 0; j < n; ++j)
        for (uint64_t i = 0; i < m; ++i) {
          float acc = 0.0f;
          const float* x = &a[i * k];
          const float* y = &b[j * k];
          for (uint64_t p = 0; p < k; ++p) acc += x[p] * y[p];
          float v = al * acc;
          if (be != 0.0f) v += be * c[i + j * lc.ld];
          d[i + j * ld.ld] = v;
        }
    }
  });
  return CUBLAS_STATUS_SUCCESS;
}
