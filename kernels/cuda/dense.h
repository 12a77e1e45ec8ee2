// dense.h: the coordinator's dense layers on the GPU: RMSNorm, rotary embedding,
// attention over a device KV cache (prefill and decode alike), the router's
// scores and top-k for every routing variant the CPU router supports, the
// permutation of token rows by expert and back, the weighted combine, and the
// small element-wise pieces between them. Host launchers take device pointers,
// counts and a stream (void*: no CUDA types here, so that C++ sources include
// this); every launch is checked (kernels/cuda/cuda_check.h) and a failure
// throws colibri::Error. Zero rows is a no-op. Each kernel's CPU reference is
// named next to it; the GPU follows the same formula in f32 (expf and rsqrtf
// may differ from the CPU's in the last place).
#pragma once
#include <cstddef>
#include <cstdint>

namespace colibri::cuda {

// y[r][i] = x[r][i] * rsqrt(mean_i(x[r][i]^2) + eps) * w[i] for r < rows, i < n;
// rows ldx and ldy elements apart (x == y allowed). CPU: KernelTable::rmsnorm.
// Per-head norms are rows * heads rows of head_dim.
void rmsnorm(const float* x, int64_t ldx, const float* w, float* y, int64_t ldy, int64_t rows, int64_t n, float eps,
             void* stream);

// x[i] += r[i] for i < n.
void add(float* x, const float* r, int64_t n, void* stream);
// y[r * ldy + i] += b[i] for r < rows, i < width.
void add_bias(float* y, int64_t rows, int64_t width, int64_t ldy, const float* b, void* stream);
// x[i] = clamp(x[i], -limit, limit) for i < n (clip_qkv).
void clamp(float* x, int64_t n, float limit, void* stream);
// dst[r * ldd + i] = src[r * lds + i] for r < rows, i < width.
void copy_rows(const float* src, int64_t lds, float* dst, int64_t ldd, int64_t rows, int64_t width, void* stream);

// Rotary embedding, as KernelTable::rope, of `heads` vectors per row: vector h
// of row r starts at x + r * ldx + h * head_stride and its first rd elements
// rotate by the angles of position pos[r]: cos/sin are [positions][rd / 2]
// tables (device), row pos[r]. Not interleaved: element i pairs with i + rd/2;
// interleaved: 2i with 2i+1, written back in half layout (i and i + rd/2).
void rope(float* x, int64_t rows, int64_t ldx, int64_t heads, int64_t head_stride, int64_t rd, bool interleaved,
          const float* cos, const float* sin, const int32_t* pos, void* stream);

// Embedding rows: out[r][i] = table[tokens[r]][i] as f32, i < hidden; the table
// stores f32 (dtype 0), f16 (1) or bf16 (2). Token ids must be in range (the
// caller validates them: the table's size is not known here).
void embed(const void* table, int dtype, const int32_t* tokens, int64_t rows, int64_t hidden, float* out, void* stream);

// Where position t of sequence (slot) s lives in a layer's cache of `width`-value
// rows (values of `dtype`: f32 (0), f16 (1) or bf16 (2), as embed's tables): without a block table the cache holds [max_seqs][max_ctx] rows, row
// s * max_ctx + t; with one (a paged cache, coordinator/kv_cache.h: blocks of
// block_tokens rows, blocks [max_seqs][blocks_per_seq] block ids on the
// device), row blocks[s * blocks_per_seq + t / block_tokens] * block_tokens +
// t % block_tokens.
struct KvLayout {
  int64_t max_ctx = 0;
  const int32_t* blocks = nullptr;
  int64_t blocks_per_seq = 0, block_tokens = 0;
  int dtype = 0;  // f16 and bf16 values are rounded to nearest even when stored, widened exactly when read
};

// Writes rows of keys (or values) into one layer's cache; row r goes to
// (seqs[r], pos[r]). A row with a negative sequence or a position outside
// [0, max_ctx) is skipped (the caller validates them; sequences must be below
// max_seqs, their blocks allocated).
void kv_store(const float* src, int64_t lds, int64_t rows, int64_t width, void* cache, const KvLayout& kv,
              const int32_t* seqs, const int32_t* pos, void* stream);

// Attention of each (row, head) over positions [start, pos[row]] of its
// sequence's cache (start = max(0, pos - window + 1) with a window, else 0):
//   out = sum_t softmax_t(scale * q . k_t) v_t
// with a non-null sinks[head] joining the softmax denominator only (gpt-oss).
// CPU: KernelTable::attend (grouped-query) and the CPU backend's latent attention (coordinator/backend_cpu.cpp;
// q is [absorbed query | rotary query], k the cached [latent | rotary key], v
// the latent itself: k with v_offset 0, dv = kv_lora_rank, group = heads).
// The cache rows of the layer must already hold every position attended to
// (kv_store first), the row being computed included. A row whose position is
// outside [0, max_ctx) or whose sequence is negative gets NaN outputs.
// Deterministic: the same inputs give bitwise the same outputs.
struct AttentionArgs {
  const float* q = nullptr;  // head h of row r at q + r * ldq + h * q_head_stride, dk floats
  int64_t ldq = 0, q_head_stride = 0;
  const void* k = nullptr;  // this layer's cache: position t of sequence s at k + row(s, t) * k_stride (KvLayout)
  const void* v = nullptr;  // likewise with v_stride (strides and offsets count values, not bytes)
  int kv_dtype = 0;         // the cache's values: f32 (0), f16 (1) or bf16 (2) (KvLayout::dtype)
  int64_t k_stride = 0, v_stride = 0, max_ctx = 0;
  const int32_t* blocks = nullptr;               // the block table, or null (KvLayout)
  int64_t blocks_per_seq = 0, block_tokens = 0;
  int64_t k_head_offset = 0, v_head_offset = 0;  // values between consecutive kv heads' vectors in a row
  int64_t heads = 0, group = 1;                   // kv head of head h: h / group
  int64_t dk = 0, dv = 0;                         // at most 1024 each
  const int32_t* seqs = nullptr;
  const int32_t* pos = nullptr;
  int64_t rows = 0, window = 0;
  float scale = 1.0f;
  const float* sinks = nullptr;  // [heads] or null
  float* out = nullptr;          // head h of row r at out + r * ldo + h * o_head_stride, dv floats
  int64_t ldo = 0, o_head_stride = 0;
};
void attention(const AttentionArgs& a, void* stream);

// The router (coordinator/router.cpp's route(), same semantics and tie rule:
// the lower expert index wins): logits [rows][num_experts] f32 (any router bias
// already added) -> experts [rows][k] int32 and weights [rows][k] f32, slot 0
// the highest selection score. num_experts <= 1024, k <= 32.
enum class RouteScoring { Softmax = 0, Sigmoid = 1, TopkSoftmax = 2 };
enum class RouteGroups { None = 0, Max = 1, Top2Sum = 2 };
struct RouteArgs {
  const float* logits = nullptr;
  const float* score_bias = nullptr;  // [num_experts] or null: added for selection only
  int64_t rows = 0, num_experts = 0, k = 0;
  RouteScoring scoring = RouteScoring::Softmax;
  RouteGroups groups = RouteGroups::None;
  int64_t n_group = 1, topk_group = 1;
  bool norm_topk_prob = false;
  float routed_scaling_factor = 1.0f;
  int32_t* experts = nullptr;
  float* weights = nullptr;
};
void route(const RouteArgs& a, void* stream);

// Permutation of a batch's (row, slot) assignments by expert, stable (within an
// expert, assignments keep their order a = row * k + slot):
//   order[j]   = the assignment at permuted position j (j < rows * k)
//   inverse[a] = the permuted position of assignment a
//   offsets[e] = the first permuted position of expert e (num_experts + 1 entries;
//                offsets[num_experts] = rows * k), so expert e's rows are
//                [offsets[e], offsets[e + 1]).
// scratch: permute_scratch_bytes(rows * k, num_experts) bytes of device memory
// (any alignment; a size for more assignments covers fewer). Expert ids must lie
// in [0, num_experts): the caller validates them (an id out of range makes the
// plan wrong, never an access out of bounds). Sorted with CUB's radix sort.
size_t permute_scratch_bytes(int64_t assignments, int64_t num_experts);
void permute_plan(const int32_t* experts, int64_t rows, int64_t k, int64_t num_experts, int32_t* order,
                  int32_t* inverse, int32_t* offsets, void* scratch, size_t scratch_bytes, void* stream);
// xp[j][i] = x[order[j] / k][i] for j < rows * k, i < hidden (rows ldx apart in x;
// xp packed). With k = 1 and any row indices as `order`, a row gather.
void permute_rows(const float* x, int64_t ldx, const int32_t* order, int64_t rows, int64_t k, int64_t hidden,
                  float* xp, void* stream);
// y[r][i] (+)= sum_{slot < k} weights[r][slot] * yp[inverse[r * k + slot]][i], slots in
// order (worker/dispatch.cpp's combine order); accumulate: add to y, else overwrite.
void unpermute_combine(const float* yp, const int32_t* inverse, const float* weights, int64_t rows, int64_t k,
                       int64_t hidden, float* y, bool accumulate, void* stream);

// Qwen2-MoE's shared-expert gate: t[r][i] *= sigmoid(x[r] . w) for r < rows,
// i < hidden (x, t rows `hidden` apart).
void sigmoid_gate(const float* x, const float* w, float* t, int64_t rows, int64_t hidden, void* stream);

}  // namespace colibri::cuda
