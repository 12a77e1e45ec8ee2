// ffn.cu: the GPU expert FFN (see ffn.h): packing, the cuBLASLt GEMM, the
// activation kernels, and the CUDA error checks.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ffn.h"
#include "model/error.h"

namespace colibri::cuda {

void fail_cuda(cudaError_t e, const char* call, const char* file, int line) {
  const Status st = e == cudaErrorMemoryAllocation ? Status::OutOfMemory : Status::Internal;
  cudaGetLastError();  // clear a non-sticky error so the next call does not report it again
  throw Error(st, std::string("CUDA: ") + call + " failed at " + file + ":" + std::to_string(line) + ": " +
                      cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

void fail_cublas(cublasStatus_t s, const char* call, const char* file, int line) {
  const Status st = s == CUBLAS_STATUS_ALLOC_FAILED ? Status::OutOfMemory
                    : s == CUBLAS_STATUS_NOT_SUPPORTED ? Status::Unsupported
                                                       : Status::Internal;
  throw Error(st, std::string("cuBLASLt: ") + call + " failed at " + file + ":" + std::to_string(line) + ": " +
                      cublasLtGetStatusName(s) + " (" + cublasLtGetStatusString(s) + ")");
}

namespace {

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

constexpr int kThreads = 256;

int blocks_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<int>(b < 65535 * 32 ? b : 65535 * 32);
}

__global__ void to_bf16_kernel(const float* __restrict__ x, __nv_bfloat16* __restrict__ y, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    y[i] = __float2bfloat16_rn(x[i]);
}

// gu: [rows][2 * inter] f32 (gate columns, then up columns) -> h: [rows][inter] bf16.
__global__ void activation_kernel(const float* __restrict__ gu, int64_t rows, int64_t inter,
                                  const float* __restrict__ gate_bias, const float* __restrict__ up_bias, bool oai,
                                  float alpha, float limit, __nv_bfloat16* __restrict__ h) {
  const int64_t n = rows * inter;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / inter, c = i - r * inter;
    float g = gu[r * 2 * inter + c], u = gu[r * 2 * inter + inter + c];
    if (gate_bias) g += gate_bias[c];
    if (up_bias) u += up_bias[c];
    float v;
    if (oai) {
      // gpt-oss: g = min(g, limit), u = clamp(u, -limit, limit), (u + 1) * g * sigmoid(alpha * g)
      const float gv = fminf(g, limit);
      const float uv = fminf(fmaxf(u, -limit), limit);
      v = (uv + 1.0f) * (gv / (1.0f + expf(-(gv * alpha))));
    } else {
      v = g / (1.0f + expf(-g)) * u;  // silu(g) * u
    }
    h[i] = __float2bfloat16_rn(v);
  }
}

__global__ void add_bias_kernel(float* __restrict__ y, int64_t rows, int64_t cols, const float* __restrict__ bias) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    y[i] += bias[i % cols];
}

}  // namespace

// ---- layout -----------------------------------------------------------------

PackedFfnLayout PackedFfnLayout::of(const FfnShape& s, bool biases) {
  if (s.hidden < 1 || s.inter < 1) throw Error(Status::InvalidArgument, "FFN shape must be positive");
  PackedFfnLayout l;
  l.biases = biases;
  const size_t H = static_cast<size_t>(s.hidden), I = static_cast<size_t>(s.inter);
  size_t off = 0;
  l.gate_up = off;
  off = align256(off + 2 * I * H * 2);
  l.down = off;
  off = align256(off + H * I * 2);
  if (biases) {
    l.gate_bias = off;
    off = align256(off + I * 4);
    l.up_bias = off;
    off = align256(off + I * 4);
    l.down_bias = off;
    off = align256(off + H * 4);
  }
  l.bytes = off;
  return l;
}

DeviceFfn DeviceFfn::at(const void* dev, const PackedFfnLayout& l) {
  const char* b = static_cast<const char*>(dev);
  DeviceFfn d;
  d.gate_up = reinterpret_cast<const uint16_t*>(b + l.gate_up);
  d.down = reinterpret_cast<const uint16_t*>(b + l.down);
  if (l.biases) {
    d.gate_bias = reinterpret_cast<const float*>(b + l.gate_bias);
    d.up_bias = reinterpret_cast<const float*>(b + l.up_bias);
    d.down_bias = reinterpret_cast<const float*>(b + l.down_bias);
  }
  return d;
}

// ---- GEMM ----------------------------------------------------------------------

struct Gemm::Impl {
  cudaStream_t stream = nullptr;
  cublasLtHandle_t handle = nullptr;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  // Per shape (out, in, rows), row strides (ldx, ldy), data type (bf16 or f32
  // inputs) and pointer alignments (w, x, y): the layouts and the heuristic's
  // algorithm. NOTE: the heuristic assumes 256-byte aligned pointers unless
  // told otherwise, and rows inside a block (x + at * hidden) need not be; an
  // algorithm chosen for aligned data may refuse them.
  struct Plan {
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  // Batched products add (batch, w, x and y strides) to the key.
  using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int, uint32_t, uint32_t, uint32_t, int64_t, int64_t,
                         int64_t, int64_t>;
  std::map<Key, Plan> plans;

  ~Impl() {
    for (auto& [k, p] : plans) {
      cublasLtMatrixLayoutDestroy(p.a);
      cublasLtMatrixLayoutDestroy(p.b);
      cublasLtMatrixLayoutDestroy(p.c);
    }
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (op) cublasLtMatmulDescDestroy(op);
    if (handle) cublasLtDestroy(handle);
    if (workspace) cudaFree(workspace);
  }

  // f32: f32 inputs (the descriptor's compute type is CUBLAS_COMPUTE_32F for
  // both, which never uses TF32); else bf16 inputs. The output is f32 either way.
  struct Batch {
    int64_t count = 1, w = 0, x = 0, y = 0;  // products and their strides in elements
  };
  const Plan& plan(int64_t out, int64_t in, int64_t rows, int64_t ldx, int64_t ldy, bool f32, uint32_t aw,
                   uint32_t ax, uint32_t ay, const Batch& bt) {
    const Key key{out, in, rows, ldx, ldy, f32 ? 1 : 0, aw, ax, ay, bt.count, bt.w, bt.x, bt.y};
    auto it = plans.find(key);
    if (it != plans.end()) return it->second;
    // Column-major view: D[out x rows] = op(A)[out x in] . B[in x rows], where A is
    // the row-major weight [out][in] seen as [in x out] (transposed by the op), B
    // the row-major activations [rows][in] (rows ldx apart) seen as [in x rows],
    // and D the row-major output [rows][out] (rows ldy apart) seen as [out x rows].
    struct Guard {  // destroys the layouts made so far if a later call throws
      Plan p;
      bool keep = false;
      ~Guard() {
        if (keep) return;
        if (p.a) cublasLtMatrixLayoutDestroy(p.a);
        if (p.b) cublasLtMatrixLayoutDestroy(p.b);
        if (p.c) cublasLtMatrixLayoutDestroy(p.c);
      }
    } g;
    Plan& p = g.p;
    const cudaDataType_t in_type = f32 ? CUDA_R_32F : CUDA_R_16BF;
    COLIBRI_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, in_type, in, out, in));
    COLIBRI_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, in_type, in, rows, ldx));
    COLIBRI_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, CUDA_R_32F, out, rows, ldy));
    if (bt.count > 1) {
      const int32_t count = static_cast<int32_t>(bt.count);
      const std::pair<cublasLtMatrixLayout_t, int64_t> strided[] = {{p.a, bt.w}, {p.b, bt.x}, {p.c, bt.y}};
      for (const auto& [l, stride] : strided) {
        COLIBRI_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count));
        COLIBRI_CUBLAS_CHECK(
            cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride));
      }
    }
    const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> aligns[] = {
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, aw}, {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, ax},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, ay}, {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, ay}};
    for (const auto& [attr, v] : aligns)
      COLIBRI_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &v, sizeof v));
    cublasLtMatmulHeuristicResult_t r{};
    int found = 0;
    COLIBRI_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle, op, p.a, p.b, p.c, p.c, pref, 1, &r, &found));
    if (found < 1)
      throw Error(Status::Unsupported, std::string("cuBLASLt has no algorithm for a ") + (f32 ? "f32" : "bf16") +
                                           " GEMM of " + std::to_string(rows) + " x " + std::to_string(in) + " by " +
                                           std::to_string(out) + " x " + std::to_string(in) + " (row strides " +
                                           std::to_string(ldx) + ", " + std::to_string(ldy) + ")");
    p.algo = r.algo;
    g.keep = true;
    return plans.emplace(key, p).first->second;
  }

  void run(const void* w, int64_t out, int64_t in, const void* x, int64_t rows, float* y, int64_t ldx, int64_t ldy,
           bool f32, const Batch& bt) {
    const char* what = f32 ? "GEMM (f32)" : "GEMM";
    if (out < 1 || in < 1 || rows < 0)
      throw Error(Status::InvalidArgument, std::string(what) + ": shape must be positive");
    if (ldx == 0) ldx = in;
    if (ldy == 0) ldy = out;
    if (ldx < in || ldy < out)
      throw Error(Status::InvalidArgument, std::string(what) + ": row strides " + std::to_string(ldx) + ", " +
                                               std::to_string(ldy) + " below the widths " + std::to_string(in) + ", " +
                                               std::to_string(out));
    if (rows == 0) return;
    if (!w || !x || !y) throw Error(Status::InvalidArgument, std::string(what) + ": null device pointer");
    if (bt.count < 1 || bt.count > INT32_MAX || bt.w < 0 || bt.x < 0 || bt.y < 0)
      throw Error(Status::InvalidArgument, std::string(what) + ": bad batch");
    // NOTE: every product of a batch must be as aligned as promised: its pointer's
    // alignment is the base's and the stride's, whichever is smaller.
    const size_t es = f32 ? 4 : 2;
    const auto al = [&](const void* ptr, int64_t stride, size_t bytes) {
      uint32_t a = alignment(ptr);
      if (bt.count > 1) a = std::min(a, alignment(reinterpret_cast<const void*>(static_cast<uintptr_t>(stride) * bytes)));
      return a;
    };
    const auto& p = plan(out, in, rows, ldx, ldy, f32, al(w, bt.w, es), al(x, bt.x, es), al(y, bt.y, 4), bt);
    const float alpha = 1.0f, beta = 0.0f;
    COLIBRI_CUBLAS_CHECK(cublasLtMatmul(handle, op, &alpha, w, p.a, x, p.b, &beta, y, p.c, y, p.c, &p.algo,
                                        workspace, workspace_bytes, stream));
  }

  // The largest power of two up to 256 that divides the address.
  static uint32_t alignment(const void* ptr) {
    const uintptr_t v = reinterpret_cast<uintptr_t>(ptr);
    uint32_t a = 256;
    while (a > 1 && v % a) a >>= 1;
    return a;
  }
};

Gemm::Gemm(void* stream, size_t workspace_bytes) : impl_(std::make_unique<Impl>()) {
  impl_->stream = as_stream(stream);
  impl_->workspace_bytes = workspace_bytes;
  COLIBRI_CUBLAS_CHECK(cublasLtCreate(&impl_->handle));
  if (workspace_bytes) COLIBRI_CUDA_CHECK(cudaMalloc(&impl_->workspace, workspace_bytes));
  COLIBRI_CUBLAS_CHECK(cublasLtMatmulDescCreate(&impl_->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  COLIBRI_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(impl_->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  COLIBRI_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(impl_->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  COLIBRI_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&impl_->pref));
  COLIBRI_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(impl_->pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                            &workspace_bytes, sizeof workspace_bytes));
}

Gemm::~Gemm() = default;

void Gemm::run(const uint16_t* w, int64_t out, int64_t in, const uint16_t* x, int64_t rows, float* y, int64_t ldx,
               int64_t ldy) {
  impl_->run(w, out, in, x, rows, y, ldx, ldy, false, {1, 0, 0, 0});
}

void Gemm::run_f32(const float* w, int64_t out, int64_t in, const float* x, int64_t rows, float* y, int64_t ldx,
                   int64_t ldy) {
  impl_->run(w, out, in, x, rows, y, ldx, ldy, true, {1, 0, 0, 0});
}

void Gemm::run_batched(const uint16_t* w, int64_t w_stride, int64_t out, int64_t in, const uint16_t* x,
                       int64_t x_stride, int64_t rows, float* y, int64_t y_stride, int64_t batch, int64_t ldx,
                       int64_t ldy) {
  impl_->run(w, out, in, x, rows, y, ldx, ldy, false, {batch, w_stride, x_stride, y_stride});
}

// ---- the FFN -----------------------------------------------------------------------

struct FfnRunner::Impl {
  FfnShape spec;
  int64_t max_rows = 0;
  cudaStream_t stream = nullptr;
  Gemm gemm;
  DeviceBuffer xb, gu, h;  // x as bf16 [rows][hidden], gate|up f32 [rows][2 * inter], h bf16 [rows][inter]
  Impl(const FfnShape& s, int64_t rows, void* st) : spec(s), max_rows(rows), stream(as_stream(st)), gemm(st) {}
};

FfnRunner::FfnRunner(const FfnShape& s, int64_t max_rows, void* stream)
    : impl_(std::make_unique<Impl>(s, max_rows, stream)) {
  if (max_rows < 1) throw Error(Status::InvalidArgument, "FfnRunner: max rows must be >= 1");
  const size_t R = static_cast<size_t>(max_rows), H = static_cast<size_t>(s.hidden), I = static_cast<size_t>(s.inter);
  impl_->xb = DeviceBuffer(R * H * 2);
  impl_->gu = DeviceBuffer(R * 2 * I * 4);
  impl_->h = DeviceBuffer(R * I * 2);
}

FfnRunner::~FfnRunner() = default;

const FfnShape& FfnRunner::shape() const { return impl_->spec; }

void FfnRunner::run(const DeviceFfn& w, const float* x, int64_t rows, float* y) {
  Impl& m = *impl_;
  if (rows < 0 || rows > m.max_rows)
    throw Error(Status::InvalidArgument, "FfnRunner: " + std::to_string(rows) + " rows, sized for " +
                                             std::to_string(m.max_rows));
  if (rows == 0) return;
  if (!w.gate_up || !w.down || !x || !y) throw Error(Status::InvalidArgument, "FfnRunner: null device pointer");
  const int64_t H = m.spec.hidden, I = m.spec.inter;
  to_bf16(x, m.xb.as<uint16_t>(), rows * H, m.stream);
  m.gemm.run(w.gate_up, 2 * I, H, m.xb.as<uint16_t>(), rows, m.gu.as<float>());
  activation_kernel<<<blocks_for(rows * I), kThreads, 0, m.stream>>>(
      m.gu.as<float>(), rows, I, w.gate_bias, w.up_bias, m.spec.oai, m.spec.alpha, m.spec.limit,
      m.h.as<__nv_bfloat16>());
  COLIBRI_CUDA_LAUNCH_CHECK("activation_kernel");
  m.gemm.run(w.down, H, I, m.h.as<uint16_t>(), rows, y);
  if (w.down_bias) {
    add_bias_kernel<<<blocks_for(rows * H), kThreads, 0, m.stream>>>(y, rows, H, w.down_bias);
    COLIBRI_CUDA_LAUNCH_CHECK("add_bias_kernel");
  }
}

void to_bf16(const float* x, uint16_t* y, int64_t n, void* stream) {
  if (n <= 0) return;
  to_bf16_kernel<<<blocks_for(n), kThreads, 0, as_stream(stream)>>>(x, reinterpret_cast<__nv_bfloat16*>(y), n);
  COLIBRI_CUDA_LAUNCH_CHECK("to_bf16_kernel");
}

// ---- memory ---------------------------------------------------------------------------

DeviceBuffer::DeviceBuffer(size_t bytes) : bytes_(bytes) {
  if (bytes) COLIBRI_CUDA_CHECK(cudaMalloc(&p_, bytes));
}

DeviceBuffer::~DeviceBuffer() {
  if (p_) cudaFree(p_);
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept : p_(o.p_), bytes_(o.bytes_) {
  o.p_ = nullptr;
  o.bytes_ = 0;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (p_) cudaFree(p_);
    p_ = o.p_;
    bytes_ = o.bytes_;
    o.p_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

void DeviceBuffer::upload(const void* src, size_t bytes, size_t offset) {
  if (offset + bytes > bytes_) throw Error(Status::InvalidArgument, "DeviceBuffer::upload past the end");
  COLIBRI_CUDA_CHECK(cudaMemcpy(static_cast<char*>(p_) + offset, src, bytes, cudaMemcpyHostToDevice));
}

void DeviceBuffer::download(void* dst, size_t bytes, size_t offset) const {
  if (offset + bytes > bytes_) throw Error(Status::InvalidArgument, "DeviceBuffer::download past the end");
  COLIBRI_CUDA_CHECK(cudaMemcpy(dst, static_cast<const char*>(p_) + offset, bytes, cudaMemcpyDeviceToHost));
}

void synchronize(void* stream) {
  COLIBRI_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream)));
  COLIBRI_CUDA_CHECK(cudaGetLastError());
}

}  // namespace colibri::cuda
