// backend.h: the operations the model definition (coordinator/model.h) is
// written in, and the two backends that execute them: the CPU
// (coordinator/backend_cpu.cpp) and a CUDA GPU (coordinator/backend_cuda.cpp).
// Like llama.cpp's graph and its backends: the model definition says what a
// layer computes, once for every family and every backend; a backend says how
// one operation runs and where its memory lives.
//
// Pointers: activations are the backend's own buffers (act()), in host memory
// on the CPU and device memory on a GPU; the model definition only offsets
// them, never reads them. Weights are named (layer, which) and resolved by
// the backend (host views into the mapped file, or uploaded bf16 copies).
// Each operation works on `rows` rows `ld` elements apart.
//
// Hot-path rules (docs/architecture.md): no operation allocates memory or
// compares a name; on the CPU every result is bitwise independent of the
// batch's other rows, the thread count and the world size.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <vector>

#include "coordinator/layer_weights.h"
#include "coordinator/model_plan.h"
#include "model/colibri_file.h"
#include "model/stage_clock.h"

namespace colibri {

// Activation buffers, each sized for the engine's most rows per pass.
enum class Act : uint8_t {
  X,         // the residual stream [rows][hidden]
  Xn,        // the normalised stream [rows][hidden]
  Tmp,       // attention output, shared expert output [rows][hidden]
  Moe,       // feed-forward output [rows][hidden]
  Gathered,  // the rows that want logits, normalised [rows][hidden]
  Q,         // queries [rows][q_width]
  K,         // keys [rows][kv_width] (Latent: the compressed KV)
  V,         // values [rows][kv_width] (Grouped only)
  Att,       // attention output before the output projection [rows][att_width]
  Qa,        // Latent: the queries' low-rank projection [rows][q_lora_rank]
  Qcat,      // Latent: absorbed queries per head [rows][heads][kv_width] = [latent q | rotary q]
  LatO,      // Latent: attention output in latent space [rows][heads][kv_lora_rank]
  Count
};

// Per-layer weight vectors (f32) and matrices. LmHead and FinalNorm take layer -1.
enum class Vec : uint8_t {
  AttnNorm, FfnNorm, BiasQ, BiasK, BiasV, BiasO, QNorm, KNorm, Sinks, QaNorm, KvaNorm, SharedGate, RouterBias, FinalNorm
};
enum class Mat : uint8_t { Q, K, V, O, Qa, Qb, Kva, Kb, Vb, LmHead };
struct MatRef {
  int layer;
  Mat m;
};

// One product of a projection group: y[r][0, out) = x[r] . W^T.
struct Projection {
  MatRef w;
  int64_t out;
  float* y;
};

// Attention of every (row, head) over the cached positions of the row's
// sequence up to its position (within the layer's window).
struct AttentionOp {
  const float* q = nullptr;
  int64_t ldq = 0, q_head_stride = 0;
  int64_t heads = 0, group = 1;  // query heads per cached head
  int64_t dk = 0, dv = 0;        // query/key and value widths per head
  // Latent: the cache holds one [latent | rotary key] row per position and the
  // values are its first dv elements; the score is q[0, dv) . latent +
  // q[dv, dk) . rotary key. Grouped: cached K and V, `group` heads per KV head.
  bool latent = false;
  float* out = nullptr;
  int64_t ldo = 0, o_head_stride = 0;
  int64_t window = 0;
  float scale = 1.0f;
  bool sinks = false;  // the layer's Vec::Sinks logits join the softmax denominator
};

// What the model definition hands the engine at each MoE layer: the rows
// (xn), the router's choices (host memory, the hook may replace them) and
// where the combined routed output goes. stream null: xn and out are host
// memory; else device memory with the work queued on that stream.
struct MoeIo {
  const float* xn = nullptr;
  int32_t* experts = nullptr;
  float* weights = nullptr;
  float* out = nullptr;
  void* stream = nullptr;
};

class DenseBackend {
 public:
  virtual ~DenseBackend() = default;
  virtual float* act(Act a) = 0;
  virtual uint64_t kv_cache_bytes() const = 0;

  // A forward pass of n rows begins: the token, sequence slot, position and
  // wants-logits flag of each row (host memory, valid until end()).
  virtual void begin(int64_t n, const int32_t* tokens, const int32_t* seqs, const int32_t* pos,
                     const uint8_t* want) = 0;
  // x = the embedding rows of the pass's tokens.
  virtual void embed(float* x) = 0;
  // y = rmsnorm(x) * w over `width` elements of each of `rows` rows.
  virtual void rmsnorm(const float* x, int64_t ldx, int layer, Vec w, float* y, int64_t ldy, int64_t rows,
                       int64_t width, float eps) = 0;
  // y = x . W^T (in: W's inputs).
  virtual void linear(const float* x, int64_t ldx, int64_t rows, int64_t in, MatRef w, int64_t out, float* y,
                      int64_t ldy) = 0;
  // Several products of the same rows (each bitwise what linear gives alone).
  virtual void linear_many(const float* x, int64_t ldx, int64_t rows, int64_t in,
                           std::initializer_list<Projection> jobs) = 0;
  // Per head h < heads: y[r][h] = x[r][h][0, in) . W[h]^T, W a [heads][out][in] matrix.
  virtual void linear_heads(const float* x, int64_t ldx, int64_t x_head_stride, int64_t rows, MatRef w,
                            int64_t heads, int64_t in, int64_t out, float* y, int64_t ldy, int64_t y_head_stride) = 0;
  virtual void add_bias(float* y, int64_t ldy, int64_t rows, int64_t width, int layer, Vec b) = 0;
  // x[i] = clamp(x[i], -limit, limit) for `count` contiguous elements.
  virtual void clamp(float* x, int64_t count, float limit) = 0;
  // Rotary embedding of the first rope_dim elements of `heads` vectors
  // head_stride apart in each row, at the row's position.
  virtual void rope(float* x, int64_t ldx, int64_t rows, int64_t heads, int64_t head_stride, int64_t rope_dim,
                    bool interleaved) = 0;
  // Rows [0, width) of k (and v, when non-null) into the cache at each row's
  // sequence and position.
  virtual void kv_store(int layer, const float* k, int64_t ldk, const float* v, int64_t ldv) = 0;
  virtual void attention(int layer, const AttentionOp& a) = 0;
  // dst[r][0, width) = src[r][0, width).
  virtual void copy_rows(const float* src, int64_t lds, float* dst, int64_t ldd, int64_t rows, int64_t width) = 0;
  // y += x for `count` contiguous elements.
  virtual void add(float* y, const float* x, int64_t count) = 0;
  // A dense MLP (shared = false) or the layer's shared expert: y = ffn(x).
  virtual void ffn(int layer, bool shared, const float* x, int64_t rows, float* y) = 0;
  // y[r] *= sigmoid(x[r] . w) with the layer's Vec::SharedGate w.
  virtual void sigmoid_gate(const float* x, int layer, float* y, int64_t rows) = 0;
  // The router of MoE layer `layer` on xn: its logits (plus bias) and the
  // family's top-k, the choices on their way to the host.
  virtual void route(int layer, const float* xn, int64_t rows) = 0;
  // The rows and choices for the routed experts, once they are on the host.
  virtual MoeIo moe_inputs(int layer, int64_t rows) = 0;
  // The routed experts' combined output (MoeIo::out) is in place: into Act::Moe.
  virtual void moe_output(int64_t rows) = 0;
  // dst[j] = x[i] (hidden wide, dst rows contiguous) for the j-th row i that
  // wants logits; returns their count.
  virtual int64_t gather_wanted(const float* x, int64_t ldx, float* dst) = 0;
  // logits[j] (host memory, [m][vocab]) = LM head of normalised rows x[0, m);
  // ends the pass.
  virtual void lm_head(const float* x, int64_t m, float* logits) = 0;
  // A stage of the pass ends (the time since the last lap is charged to it).
  virtual void lap(Stage s) = 0;
  // Host memory of an activation for checks (--check-numerics), or null when
  // the backend's activations are not host memory.
  virtual const float* host(const float* p) const = 0;
};

class KvBlockPool;

struct BackendOptions {
  int rank = 0;  // for messages
  int64_t rows_cap = 0, max_batch = 0, max_ctx = 0;
  // The engine's rotary tables, [max_ctx][rope_dim / 2] (host).
  const float* rope_cos = nullptr;
  const float* rope_sin = nullptr;
  StageClock* clock = nullptr;  // required
  // GPU: the device; stages synchronised (bench); the MoE hook takes device rows.
  int device = -1;
  bool sync_stages = false;
  bool device_moe = false;
  int threads = 1;  // CPU: OpenMP threads of the attention
  // The KV cache's blocks and tables (the engine's; required). Slot s's
  // position p is in row table(s)[p / block_tokens] * block_tokens + p % block_tokens
  // of each backend's storage (host memory, or the device's).
  const KvBlockPool* kv_pool = nullptr;
  // The type the cache stores: F32, BF16 or F16 (EngineOptions::kv_dtype).
  DType kv_dtype = DType::F32;
};

std::unique_ptr<DenseBackend> make_cpu_backend(std::shared_ptr<const ColibriFile> file, const ModelPlan& plan,
                                               std::vector<LayerWeights> layers, const BackendOptions& o);
// Throws Error(Unsupported) without CUDA, without that GPU or for quantised
// dense matrices, Error(OutOfMemory) with the sizes when they do not fit.
std::unique_ptr<DenseBackend> make_cuda_backend(std::shared_ptr<const ColibriFile> file, const ModelPlan& plan,
                                                const std::vector<LayerWeights>& layers, const BackendOptions& o);

}  // namespace colibri
