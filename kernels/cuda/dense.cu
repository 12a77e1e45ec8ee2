// dense.cu: the coordinator's dense layers on the GPU (see dense.h): RMSNorm,
// rotary embedding, embedding lookup, the KV cache store and attention, the
// router, the permutation by expert and the combine, and the element-wise
// pieces. Conventions as in ffn.cu: 64-bit index math, every launch checked,
// bad sizes rejected by the host launchers with Status::InvalidArgument before
// anything is launched, zero rows a no-op.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cub/device/device_radix_sort.cuh>

#include <climits>
#include <cstdint>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/dense.h"
#include "model/error.h"

namespace colibri::cuda {

namespace {

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

[[noreturn]] void invalid(const char* fn, const std::string& what) {
  throw Error(Status::InvalidArgument, std::string(fn) + ": " + what);
}

// The message is built only on failure.
#define DENSE_REQUIRE(cond, fn, msg) \
  do {                               \
    if (!(cond)) invalid(fn, msg);   \
  } while (0)

std::string num(int64_t v) { return std::to_string(v); }

constexpr int64_t kMaxBlocks = int64_t{1} << 20;  // grid-stride loops cover the rest
constexpr int kThreads = 256;

// Blocks for a flat grid-stride loop over n elements.
int flat_blocks(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<int>(b < kMaxBlocks ? b : kMaxBlocks);
}
// Blocks for a loop with one block per row (or item).
int row_blocks(int64_t rows) { return static_cast<int>(rows < kMaxBlocks ? rows : kMaxBlocks); }

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;  // identical in every lane (addition commutes)
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The sum of v over the block (blockDim.x a multiple of 32, at most 1024), in a
// fixed order: every thread gets the same value. sm: 32 floats of shared memory.
__device__ float block_sum(float v, float* sm) {
  v = warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  __syncthreads();  // a previous call's readers are done with sm
  if (lane == 0) sm[warp] = v;
  __syncthreads();
  float s = 0.0f;
  for (int w = 0; w < nw; ++w) s += sm[w];
  return s;
}

// ---- RMSNorm -------------------------------------------------------------------

// One block per row. CPU: inv = 1 / sqrt(ss / n + eps); y = (x * inv) * w (no
// contraction into fused operations, as the CPU's).
template <bool V4>
__global__ void rmsnorm_kernel(const float* x, int64_t ldx, const float* __restrict__ w, float* y, int64_t ldy,
                               int64_t rows, int64_t n, float eps) {
  __shared__ float sm[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* xr = x + r * ldx;
    float* yr = y + r * ldy;
    float ss = 0.0f;
    if constexpr (V4) {
      const int64_t n4 = n / 4;
      for (int64_t i = threadIdx.x; i < n4; i += blockDim.x) {
        const float4 v = reinterpret_cast<const float4*>(xr)[i];
        ss = fmaf(v.x, v.x, ss);
        ss = fmaf(v.y, v.y, ss);
        ss = fmaf(v.z, v.z, ss);
        ss = fmaf(v.w, v.w, ss);
      }
    } else {
      for (int64_t i = threadIdx.x; i < n; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
    }
    ss = block_sum(ss, sm);
    const float inv = 1.0f / sqrtf(__fadd_rn(__fdiv_rn(ss, static_cast<float>(n)), eps));
    if constexpr (V4) {
      const int64_t n4 = n / 4;
      for (int64_t i = threadIdx.x; i < n4; i += blockDim.x) {
        const float4 v = reinterpret_cast<const float4*>(xr)[i];
        const float4 g = reinterpret_cast<const float4*>(w)[i];
        float4 o;
        o.x = __fmul_rn(__fmul_rn(v.x, inv), g.x);
        o.y = __fmul_rn(__fmul_rn(v.y, inv), g.y);
        o.z = __fmul_rn(__fmul_rn(v.z, inv), g.z);
        o.w = __fmul_rn(__fmul_rn(v.w, inv), g.w);
        reinterpret_cast<float4*>(yr)[i] = o;
      }
    } else {
      for (int64_t i = threadIdx.x; i < n; i += blockDim.x) yr[i] = __fmul_rn(__fmul_rn(xr[i], inv), w[i]);
    }
  }
}

// ---- element-wise ----------------------------------------------------------------

__global__ void add_kernel(float* __restrict__ x, const float* __restrict__ r, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x[i] = __fadd_rn(x[i], r[i]);
}

__global__ void add_bias_rows_kernel(float* __restrict__ y, int64_t rows, int64_t width, int64_t ldy,
                                     const float* __restrict__ b) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x)
    for (int64_t i = threadIdx.x; i < width; i += blockDim.x) y[r * ldy + i] = __fadd_rn(y[r * ldy + i], b[i]);
}

// std::clamp(v, -limit, limit): NaN stays NaN.
__global__ void clamp_kernel(float* __restrict__ x, int64_t n, float limit) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = x[i];
    x[i] = v < -limit ? -limit : (limit < v ? limit : v);
  }
}

__global__ void copy_rows_kernel(const float* __restrict__ src, int64_t lds, float* __restrict__ dst, int64_t ldd,
                                 int64_t rows, int64_t width) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x)
    for (int64_t i = threadIdx.x; i < width; i += blockDim.x) dst[r * ldd + i] = src[r * lds + i];
}

// ---- rotary embedding ---------------------------------------------------------------

constexpr int kMaxRope = 1024;  // rd at most this (the CPU's scratch is 1024 floats too)

// One block per (row, head) vector: its first rd elements are read into shared
// memory, then rotated and written back in half layout.
__global__ void rope_kernel(float* x, int64_t rows, int64_t ldx, int64_t heads, int64_t head_stride, int64_t rd,
                            bool interleaved, const float* __restrict__ cos, const float* __restrict__ sin,
                            const int32_t* __restrict__ pos) {
  __shared__ float s[kMaxRope];
  const int64_t half = rd / 2, items = rows * heads;
  for (int64_t it = blockIdx.x; it < items; it += gridDim.x) {
    const int64_t r = it / heads, h = it - r * heads;
    float* v = x + r * ldx + h * head_stride;
    const int64_t p = pos[r];
    __syncthreads();  // the previous item's readers are done with s
    for (int64_t i = threadIdx.x; i < rd; i += blockDim.x) s[i] = v[i];
    __syncthreads();
    const float* c = cos + p * half;
    const float* sn = sin + p * half;
    for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
      const float a = interleaved ? s[2 * i] : s[i], b = interleaved ? s[2 * i + 1] : s[i + half];
      const float ci = c[i], si = sn[i];
      v[i] = __fsub_rn(__fmul_rn(a, ci), __fmul_rn(b, si));
      v[i + half] = __fadd_rn(__fmul_rn(b, ci), __fmul_rn(a, si));
    }
  }
}

// ---- embedding, KV store ---------------------------------------------------------------

template <int DTYPE>
__device__ __forceinline__ float table_value(const void* table, int64_t i) {
  if constexpr (DTYPE == 0) {
    return static_cast<const float*>(table)[i];
  } else if constexpr (DTYPE == 1) {
    return __half2float(__ushort_as_half(static_cast<const unsigned short*>(table)[i]));
  } else {
    return __uint_as_float(static_cast<uint32_t>(static_cast<const unsigned short*>(table)[i]) << 16);
  }
}

template <int DTYPE>
__global__ void embed_kernel(const void* __restrict__ table, const int32_t* __restrict__ tokens, int64_t rows,
                             int64_t hidden, float* __restrict__ out) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t base = static_cast<int64_t>(tokens[r]) * hidden;
    for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) out[r * hidden + i] = table_value<DTYPE>(table, base + i);
  }
}

// Rows whose position is outside [0, max_ctx) or whose sequence is negative are
// skipped (the host validates them; this only keeps a bad value from writing
// outside the cache's rows).
// The cache row of position t of sequence s (KvLayout).
__device__ __forceinline__ int64_t kv_row(const int32_t* blocks, int64_t bps, int64_t bt, int64_t max_ctx, int64_t s,
                                          int64_t t) {
  return blocks ? static_cast<int64_t>(blocks[s * bps + t / bt]) * bt + t % bt : s * max_ctx + t;
}

// Stores x as element i of a cache of DTYPE values (table_value reads it back).
template <int DTYPE>
__device__ __forceinline__ void store_value(void* cache, int64_t i, float x) {
  if constexpr (DTYPE == 0) {
    static_cast<float*>(cache)[i] = x;
  } else if constexpr (DTYPE == 1) {
    static_cast<unsigned short*>(cache)[i] = __half_as_ushort(__float2half_rn(x));
  } else {
    static_cast<unsigned short*>(cache)[i] = __bfloat16_as_ushort(__float2bfloat16_rn(x));
  }
}

template <int DTYPE>
__global__ void kv_store_kernel(const float* __restrict__ src, int64_t lds, int64_t rows, int64_t width,
                                void* __restrict__ cache, KvLayout kv, const int32_t* __restrict__ seqs,
                                const int32_t* __restrict__ pos) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t s = seqs[r], p = pos[r];
    if (s < 0 || p < 0 || p >= kv.max_ctx) continue;
    const int64_t base = kv_row(kv.blocks, kv.blocks_per_seq, kv.block_tokens, kv.max_ctx, s, p) * width;
    for (int64_t i = threadIdx.x; i < width; i += blockDim.x) store_value<DTYPE>(cache, base + i, src[r * lds + i]);
  }
}

// ---- attention ---------------------------------------------------------------------------

constexpr int kAttnMaxWarps = 16;
constexpr int64_t kAttnMaxDim = 1024;


// One block per (row, head), blockDim.x / 32 warps (at most 16). Warp w takes
// positions start + w, start + w + nw, ... (U of them per step); its lanes split
// q . k_t (lane holds elements lane + 32 j, j < N) and own the same elements of
// the output accumulator. Each warp keeps an online softmax (running max m, sum
// l, accumulator); the warps' states merge in warp order through shared memory,
// where the sink joins the denominator. N: dk, dv <= 32 N.
template <int N, int U, int DTYPE>
__global__ void __launch_bounds__(kAttnMaxWarps * 32) attention_kernel(const AttentionArgs p) {
  __shared__ float sm_m[kAttnMaxWarps], sm_l[kAttnMaxWarps];
  __shared__ float sm_acc[32 * N];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int64_t pairs = p.rows * p.heads;
  for (int64_t ph = blockIdx.x; ph < pairs; ph += gridDim.x) {
    const int64_t r = ph / p.heads, h = ph - r * p.heads, kvh = h / p.group;
    const int64_t pos = p.pos[r], s = p.seqs[r];
    float* o = p.out + r * p.ldo + h * p.o_head_stride;
    if (pos < 0 || pos >= p.max_ctx || s < 0) {  // block-uniform: a bad row reads nothing and yields NaN
      for (int64_t i = threadIdx.x; i < p.dv; i += blockDim.x) o[i] = __int_as_float(0x7fc00000);
      continue;
    }
    const int64_t start = p.window > 0 ? (pos - p.window + 1 > 0 ? pos - p.window + 1 : 0) : 0;
    const float* qv = p.q + r * p.ldq + h * p.q_head_stride;
    float q[N], acc[N];
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const int idx = lane + 32 * j;
      q[j] = idx < p.dk ? qv[idx] : 0.0f;
      acc[j] = 0.0f;
    }
    const int64_t kb = kvh * p.k_head_offset, vb = kvh * p.v_head_offset;  // offsets into p.k, p.v
    float m = -INFINITY, l = 0.0f;
    for (int64_t t = start + warp; t <= pos; t += static_cast<int64_t>(U) * nw) {
      float sc[U];
      bool live[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t tu = t + static_cast<int64_t>(u) * nw;
        live[u] = tu <= pos;
        const int64_t kr = kb + kv_row(p.blocks, p.blocks_per_seq, p.block_tokens, p.max_ctx, s, live[u] ? tu : t) * p.k_stride;
        float d = 0.0f;
#pragma unroll
        for (int j = 0; j < N; ++j) {
          const int idx = lane + 32 * j;
          if (idx < p.dk) d = fmaf(q[j], table_value<DTYPE>(p.k, kr + idx), d);
        }
        sc[u] = d;
      }
#pragma unroll
      for (int u = 0; u < U; ++u) sc[u] = warp_sum(sc[u]) * p.scale;
      float mx = sc[0];
#pragma unroll
      for (int u = 1; u < U; ++u)
        if (live[u]) mx = fmaxf(mx, sc[u]);
      if (mx > m) {  // warp-uniform: every lane holds the same scores
        const float c = expf(m - mx);
        l *= c;
#pragma unroll
        for (int j = 0; j < N; ++j) acc[j] *= c;
        m = mx;
      }
      float e[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        e[u] = live[u] ? expf(sc[u] - m) : 0.0f;
        l += e[u];
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (!live[u]) continue;
        const int64_t vr =
            vb + kv_row(p.blocks, p.blocks_per_seq, p.block_tokens, p.max_ctx, s, t + static_cast<int64_t>(u) * nw) * p.v_stride;
#pragma unroll
        for (int j = 0; j < N; ++j) {
          const int idx = lane + 32 * j;
          if (idx < p.dv) acc[j] = fmaf(e[u], table_value<DTYPE>(p.v, vr + idx), acc[j]);
        }
      }
    }
    // Merge the warps' states (a warp without positions has m = -inf, l = 0).
    if (lane == 0) sm_m[warp] = m, sm_l[warp] = l;
    __syncthreads();
    float M = -INFINITY;
    for (int w = 0; w < nw; ++w) M = fmaxf(M, sm_m[w]);
    const float sink = p.sinks ? p.sinks[h] : 0.0f;
    if (p.sinks) M = fmaxf(M, sink);
    float L = 0.0f;
    for (int w = 0; w < nw; ++w)
      if (sm_m[w] != -INFINITY) L += sm_l[w] * expf(sm_m[w] - M);
    if (p.sinks) L += expf(sink - M);  // the sink joins the denominator only
    const float f = m != -INFINITY ? expf(m - M) : 0.0f;
    for (int w = 0; w < nw; ++w) {
      if (warp == w) {
#pragma unroll
        for (int j = 0; j < N; ++j) {
          const int idx = lane + 32 * j;
          if (idx < p.dv) sm_acc[idx] = w == 0 ? f * acc[j] : fmaf(f, acc[j], sm_acc[idx]);
        }
      }
      __syncthreads();
    }
    const float inv = 1.0f / L;
    for (int64_t i = threadIdx.x; i < p.dv; i += blockDim.x) o[i] = sm_acc[i] * inv;
    __syncthreads();  // the next pair rewrites sm_*
  }
}

// ---- router -----------------------------------------------------------------------------

constexpr int kRouteWarps = 4;
constexpr int kNone = INT_MAX;  // "no candidate" in an arg-max

struct RouteParams {
  const float* logits;
  const float* score_bias;
  int64_t rows;
  int E, k, scoring, groups, G, per, topk_group;
  bool norm;
  float scaling;
  int32_t* experts;
  float* weights;
};

// (v, i) better than (bv, bi): larger value, then lower index; kNone loses.
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
  return i != kNone && (bi == kNone || v > bv || (v == bv && i < bi));
}

// One warp per row; lane holds experts e = lane + 32 j, j < NJ (E <= 32 NJ).
// Shared memory (groups only): per warp G group scores and G keep flags.
template <int NJ>
__global__ void __launch_bounds__(kRouteWarps * 32) route_kernel(const RouteParams p) {
  extern __shared__ float route_sm[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* gscore = route_sm + warp * p.G;
  unsigned char* gkeep = reinterpret_cast<unsigned char*>(route_sm + kRouteWarps * p.G) + warp * p.G;
  for (int64_t r = blockIdx.x * static_cast<int64_t>(kRouteWarps) + warp; r < p.rows;
       r += static_cast<int64_t>(gridDim.x) * kRouteWarps) {
    const float* lg = p.logits + r * p.E;
    float pv[NJ], cv[NJ];
    uint32_t allowed = 0;
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const int e = lane + 32 * j;
      pv[j] = e < p.E ? lg[e] : 0.0f;
      if (e < p.E) allowed |= 1u << j;
    }
    if (p.scoring == 0) {  // softmax over all experts
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < NJ; ++j)
        if (allowed >> j & 1u) mx = fmaxf(mx, pv[j]);
      mx = warp_max(mx);
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < NJ; ++j)
        if (allowed >> j & 1u) {
          pv[j] = expf(pv[j] - mx);
          sum += pv[j];
        }
      sum = warp_sum(sum);
#pragma unroll
      for (int j = 0; j < NJ; ++j) pv[j] = pv[j] / sum;
    } else if (p.scoring == 1) {  // sigmoid
#pragma unroll
      for (int j = 0; j < NJ; ++j) pv[j] = 1.0f / (1.0f + expf(-pv[j]));
    }
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const int e = lane + 32 * j;
      cv[j] = pv[j];
      if (p.score_bias && e < p.E) cv[j] += p.score_bias[e];
    }
    if (p.groups != 0) {
      // Group scores: the max, or the sum of the two best (as a multiset).
      int gid[NJ];
#pragma unroll
      for (int j = 0; j < NJ; ++j) gid[j] = (lane + 32 * j) / p.per;
      for (int g = 0; g < p.G; ++g) {
        float a1 = -INFINITY, a2 = -INFINITY;
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
          if ((allowed >> j & 1u) && gid[j] == g) {
            const float c = cv[j];
            if (c > a1) a2 = a1, a1 = c;
            else if (c > a2) a2 = c;
          }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
          const float b1 = __shfl_xor_sync(0xffffffffu, a1, o), b2 = __shfl_xor_sync(0xffffffffu, a2, o);
          const float n1 = fmaxf(a1, b1), n2 = fmaxf(fminf(a1, b1), fmaxf(a2, b2));
          a1 = n1, a2 = n2;
        }
        if (lane == 0) gscore[g] = p.groups == 1 ? a1 : a1 + a2;
      }
      for (int g = lane; g < p.G; g += 32) gkeep[g] = 0;
      __syncwarp();
      for (int round = 0; round < p.topk_group; ++round) {
        float bv = 0.0f;
        int bi = kNone;
        for (int g = lane; g < p.G; g += 32)
          if (!gkeep[g] && better(gscore[g], g, bv, bi)) bv = gscore[g], bi = g;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
          const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
          const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
          if (better(ov, oi, bv, bi)) bv = ov, bi = oi;
        }
        bi = __shfl_sync(0xffffffffu, bi, 0);
        if (lane == 0 && bi != kNone) gkeep[bi] = 1;
        __syncwarp();
      }
#pragma unroll
      for (int j = 0; j < NJ; ++j)
        if ((allowed >> j & 1u) && !gkeep[gid[j]]) allowed &= ~(1u << j);
      __syncwarp();  // gscore and gkeep are rewritten by the warp's next row
    }
    // k rounds of arg-max over the allowed, untaken experts.
    int my_e = -1;
    float my_w = 0.0f;
    for (int slot = 0; slot < p.k; ++slot) {
      float bv = 0.0f, bp = 0.0f;
      int bi = kNone;
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const int e = lane + 32 * j;
        if ((allowed >> j & 1u) && better(cv[j], e, bv, bi)) bv = cv[j], bi = e, bp = pv[j];
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o), op = __shfl_xor_sync(0xffffffffu, bp, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (better(ov, oi, bv, bi)) bv = ov, bi = oi, bp = op;
      }
      bi = __shfl_sync(0xffffffffu, bi, 0);
      bp = __shfl_sync(0xffffffffu, bp, 0);
      if (bi != kNone && (bi & 31) == lane) allowed &= ~(1u << (bi >> 5));  // taken
      if (lane == slot) my_e = bi != kNone ? bi : -1, my_w = bp;
    }
    // The weights, in slot order as the CPU (lane j holds slot j).
    if (p.scoring == 2) {  // softmax over the k selected logits
      float mx = __shfl_sync(0xffffffffu, my_w, 0);
      for (int j = 1; j < p.k; ++j) mx = fmaxf(mx, __shfl_sync(0xffffffffu, my_w, j));
      const float ex = lane < p.k ? expf(my_w - mx) : 0.0f;
      float sum = 0.0f;
      for (int j = 0; j < p.k; ++j) sum += __shfl_sync(0xffffffffu, ex, j);
      my_w = ex / sum;
    } else if (p.norm) {
      float sum = 0.0f;
      for (int j = 0; j < p.k; ++j) sum += __shfl_sync(0xffffffffu, my_w, j);
      if (p.scoring == 1) sum += 1e-20f;  // as transformers' DeepSeek-V3 router
      my_w = my_w / sum;
    }
    if (p.scaling != 1.0f) my_w *= p.scaling;
    if (lane < p.k) {
      p.experts[r * p.k + lane] = my_e;
      p.weights[r * p.k + lane] = my_w;
    }
  }
}

// ---- permutation and combine --------------------------------------------------------------

__global__ void iota_kernel(int32_t* __restrict__ v, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    v[i] = static_cast<int32_t>(i);
}

// inverse[order[j]] = j; offsets[e] = the first j with sorted[j] >= e (e <= E).
__global__ void plan_finish_kernel(const uint32_t* __restrict__ sorted, const int32_t* __restrict__ order, int64_t n,
                                   int64_t E, int32_t* __restrict__ inverse, int32_t* __restrict__ offsets) {
  const int64_t total = n > E + 1 ? n : E + 1;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (i < n) {
      const int32_t a = order[i];
      if (a >= 0 && a < n) inverse[a] = static_cast<int32_t>(i);
    }
    if (i <= E) {
      int64_t lo = 0, hi = n;
      while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (static_cast<int64_t>(sorted[mid]) < i) lo = mid + 1;
        else hi = mid;
      }
      offsets[i] = static_cast<int32_t>(lo);
    }
  }
}

// One block per permuted row. A negative order entry yields a NaN row (x's row
// count is not known here: with k = 1 this is also a plain row gather).
template <bool V4>
__global__ void permute_rows_kernel(const float* __restrict__ x, int64_t ldx, const int32_t* __restrict__ order,
                                    int64_t n, int64_t k, int64_t hidden, float* __restrict__ xp) {
  for (int64_t j = blockIdx.x; j < n; j += gridDim.x) {
    const int64_t a = order[j];
    float* dst = xp + j * hidden;
    if (a < 0) {
      for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = __int_as_float(0x7fc00000);
      continue;
    }
    const float* src = x + (a / k) * ldx;
    if constexpr (V4) {
      for (int64_t i = threadIdx.x; i < hidden / 4; i += blockDim.x)
        reinterpret_cast<float4*>(dst)[i] = reinterpret_cast<const float4*>(src)[i];
    } else {
      for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = src[i];
    }
  }
}

// One block per token row: y = (accumulate ? y : 0), then y = fma(w_slot, yp_row, y)
// for each slot in order (the CPU's combine: a zeroed row, then axpy per slot).
__global__ void unpermute_combine_kernel(const float* __restrict__ yp, const int32_t* __restrict__ inverse,
                                         const float* __restrict__ weights, int64_t rows, int64_t k, int64_t hidden,
                                         float* __restrict__ y, bool accumulate) {
  const int64_t n = rows * k;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    float* yr = y + r * hidden;
    for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
      float acc = accumulate ? yr[i] : 0.0f;
      for (int64_t s = 0; s < k; ++s) {
        const int64_t j = inverse[r * k + s];
        const float v = j >= 0 && j < n ? yp[j * hidden + i] : __int_as_float(0x7fc00000);
        acc = fmaf(weights[r * k + s], v, acc);
      }
      yr[i] = acc;
    }
  }
}

// t[r] *= sigmoid(x[r] . w), one block per row.
__global__ void sigmoid_gate_kernel(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ t,
                                    int64_t rows, int64_t hidden) {
  __shared__ float sm[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    float d = 0.0f;
    for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) d = fmaf(x[r * hidden + i], w[i], d);
    d = block_sum(d, sm);
    const float g = 1.0f / (1.0f + expf(-d));
    for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) t[r * hidden + i] *= g;
  }
}

// Bits that hold every expert id < num_experts (at least 1).
int key_bits(int64_t num_experts) {
  int b = 1;
  while (b < 31 && (int64_t{1} << b) < num_experts) ++b;
  return b;
}

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

size_t cub_sort_bytes(int64_t n, int64_t num_experts) {
  size_t bytes = 0;
  COLIBRI_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const uint32_t*>(nullptr),
                                                     static_cast<uint32_t*>(nullptr),
                                                     static_cast<const int32_t*>(nullptr),
                                                     static_cast<int32_t*>(nullptr), static_cast<int>(n), 0,
                                                     key_bits(num_experts)));
  return bytes;
}

}  // namespace

// ---- launchers --------------------------------------------------------------------------------

void rmsnorm(const float* x, int64_t ldx, const float* w, float* y, int64_t ldy, int64_t rows, int64_t n, float eps,
             void* stream) {
  static const char* fn = "rmsnorm";
  DENSE_REQUIRE(rows >= 0 && n >= 1, fn, "bad shape: " + num(rows) + " rows of " + num(n));
  DENSE_REQUIRE(ldx >= n && ldy >= n, fn, "row strides " + num(ldx) + ", " + num(ldy) + " below the width " + num(n));
  if (rows == 0) return;
  DENSE_REQUIRE(x && w && y, fn, "null device pointer");
  const int threads = n >= 2048 ? 256 : n >= 512 ? 128 : 64;
  const bool v4 = n % 4 == 0 && ldx % 4 == 0 && ldy % 4 == 0 && aligned16(x) && aligned16(y) && aligned16(w);
  if (v4)
    rmsnorm_kernel<true><<<row_blocks(rows), threads, 0, as_stream(stream)>>>(x, ldx, w, y, ldy, rows, n, eps);
  else
    rmsnorm_kernel<false><<<row_blocks(rows), threads, 0, as_stream(stream)>>>(x, ldx, w, y, ldy, rows, n, eps);
  COLIBRI_CUDA_LAUNCH_CHECK("rmsnorm_kernel");
}

void add(float* x, const float* r, int64_t n, void* stream) {
  DENSE_REQUIRE(n >= 0, "add", "negative size " + num(n));
  if (n == 0) return;
  DENSE_REQUIRE(x && r, "add", "null device pointer");
  add_kernel<<<flat_blocks(n), kThreads, 0, as_stream(stream)>>>(x, r, n);
  COLIBRI_CUDA_LAUNCH_CHECK("add_kernel");
}

void add_bias(float* y, int64_t rows, int64_t width, int64_t ldy, const float* b, void* stream) {
  static const char* fn = "add_bias";
  DENSE_REQUIRE(rows >= 0 && width >= 0, fn, "bad shape: " + num(rows) + " x " + num(width));
  DENSE_REQUIRE(ldy >= width, fn, "row stride " + num(ldy) + " below the width " + num(width));
  if (rows == 0 || width == 0) return;
  DENSE_REQUIRE(y && b, fn, "null device pointer");
  add_bias_rows_kernel<<<row_blocks(rows), width >= 256 ? 256 : 64, 0, as_stream(stream)>>>(y, rows, width, ldy, b);
  COLIBRI_CUDA_LAUNCH_CHECK("add_bias_rows_kernel");
}

void clamp(float* x, int64_t n, float limit, void* stream) {
  DENSE_REQUIRE(n >= 0, "clamp", "negative size " + num(n));
  DENSE_REQUIRE(limit >= 0.0f, "clamp", "negative limit");
  if (n == 0) return;
  DENSE_REQUIRE(x, "clamp", "null device pointer");
  clamp_kernel<<<flat_blocks(n), kThreads, 0, as_stream(stream)>>>(x, n, limit);
  COLIBRI_CUDA_LAUNCH_CHECK("clamp_kernel");
}

void copy_rows(const float* src, int64_t lds, float* dst, int64_t ldd, int64_t rows, int64_t width, void* stream) {
  static const char* fn = "copy_rows";
  DENSE_REQUIRE(rows >= 0 && width >= 0, fn, "bad shape: " + num(rows) + " x " + num(width));
  DENSE_REQUIRE(lds >= width && ldd >= width, fn, "row strides " + num(lds) + ", " + num(ldd) + " below the width " +
                                                      num(width));
  if (rows == 0 || width == 0) return;
  DENSE_REQUIRE(src && dst, fn, "null device pointer");
  copy_rows_kernel<<<row_blocks(rows), width >= 256 ? 256 : 64, 0, as_stream(stream)>>>(src, lds, dst, ldd, rows,
                                                                                          width);
  COLIBRI_CUDA_LAUNCH_CHECK("copy_rows_kernel");
}

void rope(float* x, int64_t rows, int64_t ldx, int64_t heads, int64_t head_stride, int64_t rd, bool interleaved,
          const float* cos, const float* sin, const int32_t* pos, void* stream) {
  static const char* fn = "rope";
  DENSE_REQUIRE(rows >= 0 && heads >= 1, fn, "bad shape: " + num(rows) + " rows of " + num(heads) + " heads");
  DENSE_REQUIRE(rd >= 0 && rd % 2 == 0 && rd <= kMaxRope, fn, "rotary dims " + num(rd) + " (even, at most 1024)");
  DENSE_REQUIRE(head_stride >= 0 && ldx >= 0, fn, "negative stride");
  DENSE_REQUIRE(heads == 1 || head_stride >= rd, fn, "head stride " + num(head_stride) + " below the rotary dims " +
                                                         num(rd));
  DENSE_REQUIRE(rows <= 1 || ldx >= (heads - 1) * head_stride + rd, fn, "row stride " + num(ldx) + " overlaps heads");
  if (rows == 0 || rd == 0) return;
  DENSE_REQUIRE(x && cos && sin && pos, fn, "null device pointer");
  DENSE_REQUIRE(rows <= INT64_MAX / heads, fn, "too many vectors");
  const int threads = rd / 2 >= 128 ? 128 : rd / 2 >= 64 ? 64 : 32;
  rope_kernel<<<row_blocks(rows * heads), threads, 0, as_stream(stream)>>>(x, rows, ldx, heads, head_stride, rd,
                                                                           interleaved, cos, sin, pos);
  COLIBRI_CUDA_LAUNCH_CHECK("rope_kernel");
}

void embed(const void* table, int dtype, const int32_t* tokens, int64_t rows, int64_t hidden, float* out,
           void* stream) {
  static const char* fn = "embed";
  DENSE_REQUIRE(dtype >= 0 && dtype <= 2, fn, "table dtype " + num(dtype) + " (0 f32, 1 f16, 2 bf16)");
  DENSE_REQUIRE(rows >= 0 && hidden >= 1, fn, "bad shape: " + num(rows) + " x " + num(hidden));
  if (rows == 0) return;
  DENSE_REQUIRE(table && tokens && out, fn, "null device pointer");
  const int blocks = row_blocks(rows), threads = hidden >= 256 ? 256 : 64;
  cudaStream_t s = as_stream(stream);
  if (dtype == 0) embed_kernel<0><<<blocks, threads, 0, s>>>(table, tokens, rows, hidden, out);
  else if (dtype == 1) embed_kernel<1><<<blocks, threads, 0, s>>>(table, tokens, rows, hidden, out);
  else embed_kernel<2><<<blocks, threads, 0, s>>>(table, tokens, rows, hidden, out);
  COLIBRI_CUDA_LAUNCH_CHECK("embed_kernel");
}

void kv_store(const float* src, int64_t lds, int64_t rows, int64_t width, void* cache, const KvLayout& kv,
              const int32_t* seqs, const int32_t* pos, void* stream) {
  static const char* fn = "kv_store";
  const int64_t max_ctx = kv.max_ctx;
  DENSE_REQUIRE(rows >= 0 && width >= 1 && max_ctx >= 1, fn, "bad shape: " + num(rows) + " rows of " + num(width) +
                                                                 ", context " + num(max_ctx));
  DENSE_REQUIRE(!kv.blocks || (kv.block_tokens >= 1 && kv.blocks_per_seq * kv.block_tokens >= max_ctx), fn,
                "a block table of " + num(kv.blocks_per_seq) + " blocks of " + num(kv.block_tokens) +
                    " positions does not cover the context " + num(max_ctx));
  DENSE_REQUIRE(lds >= width, fn, "row stride " + num(lds) + " below the width " + num(width));
  DENSE_REQUIRE(kv.dtype >= 0 && kv.dtype <= 2, fn, "cache dtype " + num(kv.dtype) + " (0 f32, 1 f16, 2 bf16)");
  if (rows == 0) return;
  DENSE_REQUIRE(src && cache && seqs && pos, fn, "null device pointer");
  const int blocks = row_blocks(rows), threads = width >= 256 ? 256 : 64;
  cudaStream_t s = as_stream(stream);
  if (kv.dtype == 0) kv_store_kernel<0><<<blocks, threads, 0, s>>>(src, lds, rows, width, cache, kv, seqs, pos);
  else if (kv.dtype == 1) kv_store_kernel<1><<<blocks, threads, 0, s>>>(src, lds, rows, width, cache, kv, seqs, pos);
  else kv_store_kernel<2><<<blocks, threads, 0, s>>>(src, lds, rows, width, cache, kv, seqs, pos);
  COLIBRI_CUDA_LAUNCH_CHECK("kv_store_kernel");
}

template <int DTYPE>
void launch_attention(const AttentionArgs& a, int64_t d, int blocks, int threads, cudaStream_t s) {
  if (d <= 64) attention_kernel<2, 2, DTYPE><<<blocks, threads, 0, s>>>(a);
  else if (d <= 128) attention_kernel<4, 2, DTYPE><<<blocks, threads, 0, s>>>(a);
  else if (d <= 256) attention_kernel<8, 2, DTYPE><<<blocks, threads, 0, s>>>(a);
  else if (d <= 512) attention_kernel<16, 1, DTYPE><<<blocks, threads, 0, s>>>(a);
  else if (d <= 768) attention_kernel<24, 1, DTYPE><<<blocks, threads, 0, s>>>(a);
  else attention_kernel<32, 1, DTYPE><<<blocks, threads, 0, s>>>(a);
}

void attention(const AttentionArgs& a, void* stream) {
  static const char* fn = "attention";
  DENSE_REQUIRE(a.rows >= 0 && a.heads >= 1 && a.group >= 1, fn, "bad shape: " + num(a.rows) + " rows, " +
                                                                     num(a.heads) + " heads, group " + num(a.group));
  DENSE_REQUIRE(a.dk >= 1 && a.dk <= kAttnMaxDim && a.dv >= 1 && a.dv <= kAttnMaxDim, fn,
                "head dims " + num(a.dk) + ", " + num(a.dv) + " (1 to 1024 each)");
  DENSE_REQUIRE(a.max_ctx >= 1 && a.window >= 0, fn, "context " + num(a.max_ctx) + ", window " + num(a.window));
  DENSE_REQUIRE(a.kv_dtype >= 0 && a.kv_dtype <= 2, fn, "cache dtype " + num(a.kv_dtype) + " (0 f32, 1 f16, 2 bf16)");
  DENSE_REQUIRE(!a.blocks || (a.block_tokens >= 1 && a.blocks_per_seq * a.block_tokens >= a.max_ctx), fn,
                "a block table of " + num(a.blocks_per_seq) + " blocks of " + num(a.block_tokens) +
                    " positions does not cover the context " + num(a.max_ctx));
  DENSE_REQUIRE(a.ldq >= 0 && a.q_head_stride >= 0 && a.k_stride >= 0 && a.v_stride >= 0 && a.k_head_offset >= 0 &&
                    a.v_head_offset >= 0 && a.ldo >= 0 && a.o_head_stride >= 0,
                fn, "negative stride");
  DENSE_REQUIRE(a.heads == 1 || a.o_head_stride >= a.dv, fn, "output head stride " + num(a.o_head_stride) +
                                                                 " below dv " + num(a.dv));
  DENSE_REQUIRE(a.rows <= 1 || a.ldo >= (a.heads - 1) * a.o_head_stride + a.dv, fn,
                "output row stride " + num(a.ldo) + " overlaps heads");
  if (a.rows == 0) return;
  DENSE_REQUIRE(a.q && a.k && a.v && a.seqs && a.pos && a.out, fn, "null device pointer");
  DENSE_REQUIRE(a.rows <= INT64_MAX / a.heads, fn, "too many (row, head) pairs");
  const int64_t pairs = a.rows * a.heads;
  // Few (row, head) pairs (decode of a few sequences): more warps per pair so
  // that a long context still spreads over the SMs.
  const int warps = pairs >= 1024 ? 4 : pairs >= 256 ? 8 : kAttnMaxWarps;
  const int blocks = row_blocks(pairs), threads = warps * 32;
  cudaStream_t s = as_stream(stream);
  const int64_t d = a.dk > a.dv ? a.dk : a.dv;
  if (a.kv_dtype == 0) launch_attention<0>(a, d, blocks, threads, s);
  else if (a.kv_dtype == 1) launch_attention<1>(a, d, blocks, threads, s);
  else launch_attention<2>(a, d, blocks, threads, s);
  COLIBRI_CUDA_LAUNCH_CHECK("attention_kernel");
}

void route(const RouteArgs& a, void* stream) {
  static const char* fn = "route";
  DENSE_REQUIRE(a.rows >= 0, fn, "negative rows");
  DENSE_REQUIRE(a.num_experts >= 1 && a.num_experts <= 1024, fn, num(a.num_experts) + " experts (1 to 1024)");
  DENSE_REQUIRE(a.k >= 1 && a.k <= 32 && a.k <= a.num_experts, fn,
                "top-" + num(a.k) + " of " + num(a.num_experts) + " (k from 1 to min(32, experts))");
  const int sc = static_cast<int>(a.scoring), gs = static_cast<int>(a.groups);
  DENSE_REQUIRE(sc >= 0 && sc <= 2, fn, "unknown scoring " + num(sc));
  DENSE_REQUIRE(gs >= 0 && gs <= 2, fn, "unknown group selection " + num(gs));
  int64_t G = 1, topk_group = 1;
  if (a.groups != RouteGroups::None) {
    G = a.n_group, topk_group = a.topk_group;
    DENSE_REQUIRE(G >= 1 && a.num_experts % G == 0, fn, num(a.num_experts) + " experts in " + num(G) + " groups");
    DENSE_REQUIRE(topk_group >= 1 && topk_group <= G, fn, "topk_group " + num(topk_group) + " of " + num(G));
    DENSE_REQUIRE(a.k <= topk_group * (a.num_experts / G), fn,
                  "top-" + num(a.k) + " from " + num(topk_group) + " groups of " + num(a.num_experts / G));
    DENSE_REQUIRE(a.groups != RouteGroups::Top2Sum || a.num_experts / G >= 2, fn,
                  "top2_sum needs at least 2 experts per group");
  }
  if (a.rows == 0) return;
  DENSE_REQUIRE(a.logits && a.experts && a.weights, fn, "null device pointer");
  RouteParams p{a.logits,
                a.score_bias,
                a.rows,
                static_cast<int>(a.num_experts),
                static_cast<int>(a.k),
                sc,
                gs,
                static_cast<int>(G),
                static_cast<int>(a.num_experts / G),
                static_cast<int>(topk_group),
                a.norm_topk_prob,
                a.routed_scaling_factor,
                a.experts,
                a.weights};
  const int64_t need = (a.rows + kRouteWarps - 1) / kRouteWarps;
  const int blocks = static_cast<int>(need < kMaxBlocks ? need : kMaxBlocks), threads = kRouteWarps * 32;
  const size_t smem = gs != 0 ? static_cast<size_t>(kRouteWarps) * static_cast<size_t>(G) * (sizeof(float) + 1) : 0;
  cudaStream_t s = as_stream(stream);
  const int64_t E = a.num_experts;
  if (E <= 32) route_kernel<1><<<blocks, threads, smem, s>>>(p);
  else if (E <= 64) route_kernel<2><<<blocks, threads, smem, s>>>(p);
  else if (E <= 128) route_kernel<4><<<blocks, threads, smem, s>>>(p);
  else if (E <= 256) route_kernel<8><<<blocks, threads, smem, s>>>(p);
  else if (E <= 512) route_kernel<16><<<blocks, threads, smem, s>>>(p);
  else route_kernel<32><<<blocks, threads, smem, s>>>(p);
  COLIBRI_CUDA_LAUNCH_CHECK("route_kernel");
}

// Scratch: [sorted keys (n uint32) | iota values (n int32) | CUB's temporary storage],
// each part 256-byte aligned from the first 256-byte boundary at or after the
// scratch pointer (hence 256 bytes of slack).
size_t permute_scratch_bytes(int64_t assignments, int64_t num_experts) {
  static const char* fn = "permute_scratch_bytes";
  DENSE_REQUIRE(assignments >= 0 && assignments <= INT32_MAX, fn, num(assignments) + " assignments");
  DENSE_REQUIRE(num_experts >= 1 && num_experts < INT32_MAX, fn, num(num_experts) + " experts");
  const size_t n = static_cast<size_t>(assignments);
  return 256 + 2 * align256(n * 4) + align256(cub_sort_bytes(assignments, num_experts));
}

void permute_plan(const int32_t* experts, int64_t rows, int64_t k, int64_t num_experts, int32_t* order,
                  int32_t* inverse, int32_t* offsets, void* scratch, size_t scratch_bytes, void* stream) {
  static const char* fn = "permute_plan";
  DENSE_REQUIRE(rows >= 0 && k >= 1 && num_experts >= 1 && num_experts < INT32_MAX, fn,
                "bad shape: " + num(rows) + " rows, k " + num(k) + ", " + num(num_experts) + " experts");
  DENSE_REQUIRE(rows <= INT32_MAX / k, fn, num(rows) + " x " + num(k) + " assignments (at most 2^31 - 1)");
  const int64_t n = rows * k;
  DENSE_REQUIRE(offsets, fn, "null device pointer");
  cudaStream_t s = as_stream(stream);
  if (n == 0) {  // every expert empty: offsets all 0
    COLIBRI_CUDA_CHECK(cudaMemsetAsync(offsets, 0, static_cast<size_t>(num_experts + 1) * sizeof(int32_t), s));
    return;
  }
  DENSE_REQUIRE(experts && order && inverse && scratch, fn, "null device pointer");
  const size_t part = align256(static_cast<size_t>(n) * 4);
  const size_t cub_bytes = cub_sort_bytes(n, num_experts);
  const size_t skip = (256 - reinterpret_cast<uintptr_t>(scratch) % 256) % 256;  // to the first 256-byte boundary
  DENSE_REQUIRE(scratch_bytes >= skip + 2 * part + cub_bytes, fn,
                "scratch of " + std::to_string(scratch_bytes) + " bytes, needs " +
                    std::to_string(skip + 2 * part + cub_bytes) + " (see permute_scratch_bytes)");
  char* sp = static_cast<char*>(scratch) + skip;
  uint32_t* sorted = reinterpret_cast<uint32_t*>(sp);
  int32_t* iota = reinterpret_cast<int32_t*>(sp + part);
  void* temp = sp + 2 * part;
  iota_kernel<<<flat_blocks(n), kThreads, 0, s>>>(iota, n);
  COLIBRI_CUDA_LAUNCH_CHECK("iota_kernel");
  size_t temp_bytes = scratch_bytes - skip - 2 * part;
  // Expert ids are non-negative: sorted as unsigned keys over their low bits
  // (LSD radix sort: stable, so an expert's assignments keep their order).
  COLIBRI_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, reinterpret_cast<const uint32_t*>(experts),
                                                     sorted, static_cast<const int32_t*>(iota), order,
                                                     static_cast<int>(n), 0, key_bits(num_experts), s));
  COLIBRI_CUDA_LAUNCH_CHECK("cub::DeviceRadixSort::SortPairs");
  plan_finish_kernel<<<flat_blocks(n > num_experts + 1 ? n : num_experts + 1), kThreads, 0, s>>>(
      sorted, order, n, num_experts, inverse, offsets);
  COLIBRI_CUDA_LAUNCH_CHECK("plan_finish_kernel");
}

void permute_rows(const float* x, int64_t ldx, const int32_t* order, int64_t rows, int64_t k, int64_t hidden,
                  float* xp, void* stream) {
  static const char* fn = "permute_rows";
  DENSE_REQUIRE(rows >= 0 && k >= 1 && hidden >= 1, fn,
                "bad shape: " + num(rows) + " rows, k " + num(k) + ", hidden " + num(hidden));
  DENSE_REQUIRE(ldx >= hidden, fn, "row stride " + num(ldx) + " below the width " + num(hidden));
  DENSE_REQUIRE(rows <= INT32_MAX / k, fn, "too many assignments");
  if (rows == 0) return;
  DENSE_REQUIRE(x && order && xp, fn, "null device pointer");
  const int64_t n = rows * k;
  const bool v4 = hidden % 4 == 0 && ldx % 4 == 0 && aligned16(x) && aligned16(xp);
  const int threads = hidden >= 1024 ? 256 : hidden >= 256 ? 128 : 64;
  cudaStream_t s = as_stream(stream);
  if (v4) permute_rows_kernel<true><<<row_blocks(n), threads, 0, s>>>(x, ldx, order, n, k, hidden, xp);
  else permute_rows_kernel<false><<<row_blocks(n), threads, 0, s>>>(x, ldx, order, n, k, hidden, xp);
  COLIBRI_CUDA_LAUNCH_CHECK("permute_rows_kernel");
}

void unpermute_combine(const float* yp, const int32_t* inverse, const float* weights, int64_t rows, int64_t k,
                       int64_t hidden, float* y, bool accumulate, void* stream) {
  static const char* fn = "unpermute_combine";
  DENSE_REQUIRE(rows >= 0 && k >= 1 && hidden >= 1, fn,
                "bad shape: " + num(rows) + " rows, k " + num(k) + ", hidden " + num(hidden));
  DENSE_REQUIRE(rows <= INT32_MAX / k, fn, "too many assignments");
  if (rows == 0) return;
  DENSE_REQUIRE(yp && inverse && weights && y, fn, "null device pointer");
  unpermute_combine_kernel<<<row_blocks(rows), hidden >= 1024 ? 256 : 128, 0, as_stream(stream)>>>(
      yp, inverse, weights, rows, k, hidden, y, accumulate);
  COLIBRI_CUDA_LAUNCH_CHECK("unpermute_combine_kernel");
}

void sigmoid_gate(const float* x, const float* w, float* t, int64_t rows, int64_t hidden, void* stream) {
  static const char* fn = "sigmoid_gate";
  DENSE_REQUIRE(rows >= 0 && hidden >= 1, fn, "bad shape: " + num(rows) + " x " + num(hidden));
  if (rows == 0) return;
  DENSE_REQUIRE(x && w && t, fn, "null device pointer");
  sigmoid_gate_kernel<<<row_blocks(rows), hidden >= 1024 ? 256 : 128, 0, as_stream(stream)>>>(x, w, t, rows, hidden);
  COLIBRI_CUDA_LAUNCH_CHECK("sigmoid_gate_kernel");
}

}  // namespace colibri::cuda
