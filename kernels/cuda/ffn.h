// ffn.h: a gated feed-forward block (a routed expert) on the GPU: bf16 weights
// in device memory, f32 activations in and out, the two products through
// cuBLASLt (bf16 inputs, f32 accumulation and output) and the activation
// (SiLU, or gpt-oss's clamped SwiGLU with biases) in a kernel between them:
//   gu = x_bf16 . [gate; up]^T          (one GEMM, [rows][2 * inter] f32)
//   h  = act(gu (+ biases)) as bf16     ([rows][inter])
//   y  = h . down^T (+ down bias)       ([rows][hidden] f32)
// The CPU reference is worker/expert_ffn.cpp's ffn(); the GPU rounds x and h
// to bf16 before each product (the CPU keeps them f32), so results agree to
// bf16 precision, not bitwise. No CUDA types here: streams are void*.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>

#include "model/ffn.h"

namespace colibri::cuda {

using colibri::FfnShape;  // model/ffn.h

// The device layout of one FFN, packed in one block (each part 256-byte aligned):
//   [gate; up]  bf16 [2 * inter][hidden]
//   down        bf16 [hidden][inter]
//   biases      f32 gate [inter], up [inter], down [hidden]   (only with biases)
struct PackedFfnLayout {
  size_t gate_up = 0, down = 0, gate_bias = 0, up_bias = 0, down_bias = 0;  // byte offsets
  size_t bytes = 0;                                                       // the whole block
  bool biases = false;
  static PackedFfnLayout of(const FfnShape& s, bool biases);
};
// Packing host weights into this layout: kernels/cuda/ffn_pack.h.

// Device pointers into a packed block at `dev`.
struct DeviceFfn {
  const uint16_t *gate_up = nullptr, *down = nullptr;  // bf16
  const float *gate_bias = nullptr, *up_bias = nullptr, *down_bias = nullptr;
  static DeviceFfn at(const void* dev, const PackedFfnLayout& layout);
};

// y[rows][out] (f32, row-major) = x[rows][in] (bf16) . w[out][in]^T (bf16), on
// `stream`, through cuBLASLt (f32 accumulation). Device pointers. Rows of x and
// y are ldx and ldy elements apart (0: in and out, packed).
class Gemm {
 public:
  explicit Gemm(void* stream = nullptr, size_t workspace_bytes = size_t{32} << 20);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;
  void run(const uint16_t* w, int64_t out, int64_t in, const uint16_t* x, int64_t rows, float* y, int64_t ldx = 0,
           int64_t ldy = 0);
  // The same product in f32 throughout (f32 inputs, CUBLAS_COMPUTE_32F, no
  // TF32): for the router, whose choices should not move with bf16 rounding.
  void run_f32(const float* w, int64_t out, int64_t in, const float* x, int64_t rows, float* y, int64_t ldx = 0,
               int64_t ldy = 0);
  // `batch` such products in one call (strided batched): product b takes
  // w + b * w_stride, x + b * x_stride and writes y + b * y_stride (strides in
  // elements), e.g. one per attention head (MLA's absorbed query and value).
  void run_batched(const uint16_t* w, int64_t w_stride, int64_t out, int64_t in, const uint16_t* x, int64_t x_stride,
                   int64_t rows, float* y, int64_t y_stride, int64_t batch, int64_t ldx = 0, int64_t ldy = 0);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Runs FFNs of one shape on one stream; scratch for up to max_rows rows.
class FfnRunner {
 public:
  FfnRunner(const FfnShape& s, int64_t max_rows, void* stream = nullptr);
  ~FfnRunner();
  FfnRunner(const FfnRunner&) = delete;
  FfnRunner& operator=(const FfnRunner&) = delete;
  // x, y: device [rows][hidden] f32 (may not alias). Asynchronous on the stream.
  void run(const DeviceFfn& w, const float* x, int64_t rows, float* y);
  const FfnShape& shape() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// f32 -> bf16 (round to nearest even) of n elements on the stream; device pointers.
void to_bf16(const float* x, uint16_t* y, int64_t n, void* stream = nullptr);

// Device memory with RAII (no CUDA types in the interface).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return p_; }
  size_t bytes() const { return bytes_; }
  template <class T>
  T* as() const { return static_cast<T*>(p_); }
  void upload(const void* src, size_t bytes, size_t offset = 0);  // synchronous
  void download(void* dst, size_t bytes, size_t offset = 0) const;

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

void synchronize(void* stream = nullptr);  // waits for the stream; checks for errors

}  // namespace colibri::cuda
