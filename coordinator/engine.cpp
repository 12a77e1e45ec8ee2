// engine.cpp: the coordinator's forward pass and generation loop.
#include "coordinator/engine.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>

#include "coordinator/cluster.h"
#include "coordinator/gpu_dense.h"
#include "coordinator/layer_weights.h"
#include "coordinator/router.h"
#include "coordinator/routing_trace.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/qkernels.h"
#include "model/error.h"
#include "worker/expert_ffn.h"

namespace colibri {

namespace {

std::vector<float> to_f32_vector(const TensorView& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  kernels::to_f32(t.data, t.dtype, t.numel(), v.data());
  return v;
}

std::vector<float> optional_f32(const ColibriFile& f, const std::string& name) {
  const TensorView* t = f.find(name);
  return t ? to_f32_vector(*t) : std::vector<float>{};
}

void add_bias(float* y, int64_t rows, int64_t width, const std::vector<float>& b) {
  if (b.empty()) return;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < width; ++i) y[r * width + i] += b[static_cast<size_t>(i)];
}

FfnWeights ffn_weights(const ColibriFile& f, int l, const char* gate, const char* up, const char* down) {
  FfnWeights w;
  const TensorView &g = f.tensor(tname::layer(l, gate)), &u = f.tensor(tname::layer(l, up)),
                   &d = f.tensor(tname::layer(l, down));
  w.dtype = g.dtype;
  w.gate = g.data;
  w.up = u.data;
  w.down = d.data;
  w.quant = g.quant;
  w.quant_group = g.quant_group;
  w.gate_scales = g.scales;
  w.up_scales = u.scales;
  w.down_scales = d.scales;
  for (const TensorView* t : {&u, &d})
    if (t->dtype != g.dtype || t->quant != g.quant || t->quant_group != g.quant_group)
      throw Error(Status::Format, f.path() + ": the FFN matrices of layer " + std::to_string(l) + " differ in storage");
  return w;
}

// y[r * ldy + o] = x[r] . W[o] for a dense matrix of `in` inputs and `out`
// outputs, stored in a DType or quantised (ModelConfig::dense_quant).
void linear(const float* x, int64_t ldx, int64_t rows, const TensorView& w, int64_t in, int64_t out, float* y,
            int64_t ldy) {
  if (w.quant != QuantType::None) {
    const qkernels::QMatrix m{w.quant, w.quant_group, in, w.data, w.scales};
    qkernels::gemm(x, ldx, rows, m, out, y, ldy);
  } else {
    kernels::gemm(x, ldx, rows, w.data, w.dtype, in, out, y, ldy);
  }
}

// Several products of the same rows (attention's q, k, v) in one parallel
// region: kernels::gemm_many, or qkernels::gemm_many when all are quantised
// alike (one quantisation of x); mixed storage runs one product after another.
// Each result is bitwise what linear() gives for it alone.
struct LinearJob {
  const TensorView* w;
  int64_t out;
  float* y;
};
void linear_many(const float* x, int64_t ldx, int64_t rows, int64_t in, std::initializer_list<LinearJob> jobs) {
  const TensorView& w0 = *jobs.begin()->w;
  if (std::all_of(jobs.begin(), jobs.end(), [](const LinearJob& j) { return j.w->quant == QuantType::None; })) {
    kernels::GemmJob g[4];
    int n = 0;
    for (const auto& j : jobs) g[n++] = {x, ldx, rows, j.w->data, j.w->dtype, in, j.out, j.y, j.out};
    kernels::gemm_many(g, n);
    return;
  }
  if (!std::all_of(jobs.begin(), jobs.end(), [&](const LinearJob& j) {
        return j.w->quant == w0.quant && j.w->quant_group == w0.quant_group;
      })) {
    for (const auto& j : jobs) linear(x, ldx, rows, *j.w, in, j.out, j.y, j.out);
    return;
  }
  qkernels::QGemmJob q[qkernels::kMaxGemmMany];
  int n = 0;
  for (const auto& j : jobs) q[n++] = {{j.w->quant, j.w->quant_group, in, j.w->data, j.w->scales}, j.out, j.y, j.out};
  qkernels::gemm_many(x, ldx, rows, q, n);
}

}  // namespace

Engine::Engine(std::shared_ptr<const ColibriFile> file, const EngineOptions& opts, Communicator& comm)
    : file_(std::move(file)), comm_(comm), sampler_(file_->config().vocab_size) {
  const ModelConfig& c = file_->config();
  if (opts.max_batch < 1) throw Error(Status::InvalidArgument, "max batch must be >= 1");
  if (opts.prefill_chunk < 1) throw Error(Status::InvalidArgument, "prefill chunk must be >= 1");
  if (opts.max_context < 0) throw Error(Status::InvalidArgument, "max context must be >= 0");
  if (opts.max_context > c.max_position_embeddings)
    throw Error(Status::InvalidArgument, "max context " + std::to_string(opts.max_context) + " exceeds the model's " +
                                             std::to_string(c.max_position_embeddings) + " positions");
  max_batch_ = opts.max_batch;
  max_ctx_ = opts.max_context > 0 ? opts.max_context : c.max_position_embeddings;
  chunk_ = opts.prefill_chunk;
  rows_cap_ = std::max(chunk_, max_batch_);

  const int M = static_cast<int>(c.num_moe_layers()), NE = static_cast<int>(c.num_experts);
  if (opts.placement)
    placement_ = opts.placement;
  else if (comm_.size() == 1)
    placement_ = std::make_shared<const Placement>(Placement::single(M, NE));
  else
    placement_ = std::make_shared<const Placement>(make_placement("contiguous", M, NE, comm_.size(), false, nullptr, 0));
  cluster::check_placement(*placement_, c, comm_.size());
  trace_ = opts.trace;
  bool hosts = false;
  for (int l = 0; l < M && !hosts; ++l)
    for (int e = 0; e < NE && !hosts; ++e) hosts = placement_->owns(comm_.rank(), l, e);
  if (hosts)
    worker_ = std::make_unique<Worker>(file_, *placement_, comm_.rank(), comm_.size(), rows_cap_ * c.experts_per_token,
                                       opts.store);
  replay_ = opts.replay;
  if (replay_) replay_->check(c);
  stage_sync_ = opts.stage_sync;
  check_numerics_ = opts.check_numerics;
  if (check_numerics_ && opts.device >= 0)
    throw Error(Status::Unsupported, "--check-numerics checks the dense part on the CPU; with --device cuda only the "
                                     "logits are checked (leave --check-numerics out, or run the dense part on the CPU)");
  // With the dense part on a GPU the MoE rows stay there when nothing must
  // cross to the host: one rank, or NCCL moving device buffers.
  if (opts.device >= 0) require_gpu(opts.device, comm_.rank());  // the clear refusal, before any GPU is touched
  const bool device_moe = opts.device >= 0 && (comm_.size() == 1 || std::string(comm_.backend()) == "nccl");
  dispatch_ = std::make_unique<MoeDispatcher>(c, *placement_, comm_, worker_.get(), rows_cap_, clock_,
                                              device_moe ? opts.device : -1);
  dispatch_->set_stage_sync(stage_sync_);
  const bool mla = c.attention == "mla";
  // NOTE: with the dense part on a GPU, the KV cache and the activations live
  // there: the host keeps only the logits.
  const bool on_gpu = opts.device >= 0;
  if (!on_gpu)
    kv_ = mla ? std::make_unique<KVCache>(c.num_layers, max_batch_, max_ctx_, c.kv_lora_rank + c.qk_rope_head_dim, 0)
              : std::make_unique<KVCache>(c.num_layers, max_batch_, max_ctx_, c.num_kv_heads * c.head_dim,
                                          c.num_kv_heads * c.head_dim);

  const ColibriFile& f = *file_;
  embd_ = &f.tensor(tname::token_embd());
  lm_head_ = c.tie_word_embeddings ? embd_ : &f.tensor(tname::output());
  final_norm_ = to_f32_vector(f.tensor(tname::output_norm()));
  layers_.resize(static_cast<size_t>(c.num_layers));
  int64_t ffn_inter = 0;
  for (int l = 0; l < c.num_layers; ++l) {
    LayerWeights& w = layers_[static_cast<size_t>(l)];
    auto name = [&](const char* what) { return tname::layer(l, what); };
    w.attn_norm = to_f32_vector(f.tensor(name("attn_norm")));
    w.ffn_norm = to_f32_vector(f.tensor(name("ffn_norm")));
    w.window = c.window(l);
    w.wo = &f.tensor(name("attn_output"));
    w.bo = optional_f32(f, name("attn_output_bias"));
    if (mla) {
      if (c.q_lora_rank > 0) {
        w.wq_a = &f.tensor(name("attn_q_a"));
        w.q_a_norm = to_f32_vector(f.tensor(name("attn_q_a_norm")));
        w.wq_b = &f.tensor(name("attn_q_b"));
      } else {
        w.wq = &f.tensor(name("attn_q"));
      }
      w.wkv_a = &f.tensor(name("attn_kv_a"));
      w.kv_a_norm = to_f32_vector(f.tensor(name("attn_kv_a_norm")));
      w.wk_b = &f.tensor(name("attn_k_b"));
      w.wv_b = &f.tensor(name("attn_v_b"));
    } else {
      w.wq = &f.tensor(name("attn_q"));
      w.wk = &f.tensor(name("attn_k"));
      w.wv = &f.tensor(name("attn_v"));
      w.bq = optional_f32(f, name("attn_q_bias"));
      w.bk = optional_f32(f, name("attn_k_bias"));
      w.bv = optional_f32(f, name("attn_v_bias"));
      w.q_norm = optional_f32(f, name("attn_q_norm"));
      w.k_norm = optional_f32(f, name("attn_k_norm"));
      w.sinks = optional_f32(f, name("attn_sinks"));
    }
    w.moe = c.moe_index(l);
    if (w.moe < 0) {
      w.dense = ffn_weights(f, l, "ffn_gate", "ffn_up", "ffn_down");
      ffn_inter = std::max(ffn_inter, c.dense_intermediate_size);
      continue;
    }
    w.router = &f.tensor(name("ffn_gate_inp"));
    w.router_bias = optional_f32(f, name("ffn_gate_inp_bias"));
    w.score_bias = optional_f32(f, name("exp_probs_b"));
    if (c.shared_intermediate_size > 0) {
      w.shared = ffn_weights(f, l, "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp");
      w.shared_gate = optional_f32(f, name("ffn_gate_inp_shexp"));
      ffn_inter = std::max(ffn_inter, c.shared_intermediate_size);
    }
  }

  const int64_t R = rows_cap_, H = c.hidden_size, NH = c.num_heads;
  const int64_t Q = NH * c.head_dim;
  const int64_t KV = mla ? c.kv_lora_rank + c.qk_rope_head_dim : c.num_kv_heads * c.head_dim;
  const int64_t ATT = mla ? NH * c.v_head_dim : Q;
  auto sz = [](int64_t a, int64_t b) { return static_cast<size_t>(a * b); };
  try {
    logits_.resize(sz(R, c.vocab_size));
    if (!on_gpu) {
      x_.resize(sz(R, H));
      xn_.resize(sz(R, H));
      tmp_.resize(sz(R, H));
      moe_.resize(sz(R, H));
      gathered_.resize(sz(R, H));
      q_.resize(sz(R, Q));
      att_.resize(sz(R, ATT));
      k_.resize(sz(R, KV));
      if (!mla) v_.resize(sz(R, KV));
      router_.resize(sz(R, c.num_experts));
      experts_.resize(sz(R, c.experts_per_token));
      weights_.resize(sz(R, c.experts_per_token));
      ffn_gate_.resize(sz(R, ffn_inter));
      ffn_up_.resize(sz(R, ffn_inter));
      if (mla) {
        qa_.resize(sz(R, c.q_lora_rank));
        lat_q_.resize(sz(R, NH * c.kv_lora_rank));
        lat_o_.resize(sz(R, NH * c.kv_lora_rank));
      }
    }
  } catch (const std::bad_alloc&) {
    throw Error(Status::OutOfMemory, "activation buffers for " + std::to_string(R) + " rows do not fit in memory");
  }

  // Rotary tables in f32 the way transformers computes them: angle = pos *
  // inv_freq (default or YaRN), cos/sin times YaRN's attention factor.
  const std::vector<float> inv = rope_inv_freq(c);
  const int64_t half = c.rope_dim / 2;
  if (c.rope_dim > 512) throw Error(Status::Unsupported, "rotary dimension above 512");
  const float af = static_cast<float>(c.rope_scaling.attention_factor);
  rope_cos_.resize(sz(max_ctx_, half));
  rope_sin_.resize(sz(max_ctx_, half));
  for (int64_t i = 0; i < half; ++i)
    for (int64_t p = 0; p < max_ctx_; ++p) {
      const float a = static_cast<float>(p) * inv[static_cast<size_t>(i)];
      float cs = std::cos(a), sn = std::sin(a);
      if (af != 1.0f) cs *= af, sn *= af;
      rope_cos_[static_cast<size_t>(p * half + i)] = cs;
      rope_sin_[static_cast<size_t>(p * half + i)] = sn;
    }
  for (size_t i = 0; i < rope_cos_.size(); ++i)
    if (!std::isfinite(rope_cos_[i]) || !std::isfinite(rope_sin_[i])) {
      char theta[32];
      std::snprintf(theta, sizeof theta, "%g", c.rope_theta);
      throw Error(Status::Numerical, file_->path() + ": the rotary tables are not finite (position " +
                                         std::to_string(static_cast<int64_t>(i) / std::max<int64_t>(half, 1)) +
                                         ", frequency " + std::to_string(static_cast<int64_t>(i) % std::max<int64_t>(half, 1)) +
                                         "): rope_theta " + theta + " or the rope scaling overflows");
    }
  threads_ = omp_get_max_threads();
  if (!on_gpu) scores_.resize(sz(threads_, max_ctx_));
  if (on_gpu) {
    GpuDenseOptions g;
    g.device = opts.device;
    g.rank = comm_.rank();
    g.rows_cap = rows_cap_, g.max_batch = max_batch_, g.max_ctx = max_ctx_;
    g.rope_cos = rope_cos_.data(), g.rope_sin = rope_sin_.data();
    g.clock = &clock_;
    g.sync_stages = stage_sync_;
    g.device_moe = device_moe;
    gpu_ = make_gpu_dense(file_, layers_, final_norm_, g);
  }
}

Engine::~Engine() = default;

uint64_t Engine::kv_cache_bytes() const { return gpu_ ? gpu_->kv_cache_bytes() : kv_->bytes(); }

void Engine::start_workers() {
  if (comm_.size() == 1 || workers_started_) return;
  cluster::Setup s;
  s.rows_cap = rows_cap_;
  s.model_checksum = file_->header().meta_checksum;
  s.stage_sync = stage_sync_ ? 1 : 0;
  cluster::send_setup(comm_, s);
  // Wait (without a deadline) until every worker has built its expert store:
  // preloading pinned experts may take long, and the first exchange is timed.
  const double t = comm_.timeout();
  comm_.set_timeout(0);
  comm_.barrier();
  comm_.set_timeout(t);
  workers_started_ = true;
}

void Engine::stop_workers() {
  if (comm_.size() == 1 || workers_stopped_) return;
  cluster::send_op(comm_, cluster::Op::Stop);
  workers_stopped_ = true;
}

void Engine::attention_gqa(int layer, int64_t n, const int32_t* seqs, const int32_t* pos) {
  const ModelConfig& c = file_->config();
  const LayerWeights& w = layers_[static_cast<size_t>(layer)];
  const int64_t H = c.hidden_size, nh = c.num_heads, nkv = c.num_kv_heads, hd = c.head_dim;
  const int64_t Q = nh * hd, KV = nkv * hd, group = nh / nkv, half = c.rope_dim / 2;
  const auto& kt = kernels::active();
  const float eps = static_cast<float>(c.rms_norm_eps);
  linear_many(xn_.data(), H, n, H, {{w.wq, Q, q_.data()}, {w.wk, KV, k_.data()}, {w.wv, KV, v_.data()}});
  add_bias(q_.data(), n, Q, w.bq);
  add_bias(k_.data(), n, KV, w.bk);
  add_bias(v_.data(), n, KV, w.bv);
  for (int64_t i = 0; i < n; ++i) {
    float* q = q_.data() + i * Q;
    float* k = k_.data() + i * KV;
    float* v = v_.data() + i * KV;
    // The norm's width tells per-head ([head_dim]) from full width (OLMoE).
    if (w.q_norm.size() == static_cast<size_t>(hd)) {
      for (int64_t h = 0; h < nh; ++h) kt.rmsnorm(q + h * hd, w.q_norm.data(), q + h * hd, hd, eps);
      for (int64_t h = 0; h < nkv; ++h) kt.rmsnorm(k + h * hd, w.k_norm.data(), k + h * hd, hd, eps);
    } else if (!w.q_norm.empty()) {
      kt.rmsnorm(q, w.q_norm.data(), q, Q, eps);
      kt.rmsnorm(k, w.k_norm.data(), k, KV, eps);
    }
    if (c.clip_qkv > 0) {
      const float cl = static_cast<float>(c.clip_qkv);
      for (int64_t j = 0; j < Q; ++j) q[j] = std::clamp(q[j], -cl, cl);
      for (int64_t j = 0; j < KV; ++j) k[j] = std::clamp(k[j], -cl, cl), v[j] = std::clamp(v[j], -cl, cl);
    }
    const float* cs = rope_cos_.data() + pos[i] * half;
    const float* sn = rope_sin_.data() + pos[i] * half;
    kt.rope(q, nh, hd, c.rope_dim, c.rope_interleaved, cs, sn);
    kt.rope(k, nkv, hd, c.rope_dim, c.rope_interleaved, cs, sn);
    std::memcpy(kv_->k(layer, seqs[i], pos[i]), k, static_cast<size_t>(KV) * sizeof(float));
    std::memcpy(kv_->v(layer, seqs[i], pos[i]), v, static_cast<size_t>(KV) * sizeof(float));
  }

  const float scale = static_cast<float>(c.attn_scale);
  const int64_t window = w.window;
  const float* sinks = w.sinks.empty() ? nullptr : w.sinks.data();
  const int64_t pairs = n * nh;
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads_) if (pairs * (pos[n - 1] + 1) > 4096)
  for (int64_t ph = 0; ph < pairs; ++ph) {
    const int64_t i = ph / nh, h = ph % nh, kvh = h / group;
    const int64_t p = pos[i], s = seqs[i];
    const int64_t start = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
    float* sc = scores_.data() + static_cast<size_t>(omp_get_thread_num()) * max_ctx_;
    // Positions [start, p] of this sequence are consecutive rows of the cache.
    kt.attend(q_.data() + i * Q + h * hd, hd, kv_->k(layer, s, start) + kvh * hd, kv_->v(layer, s, start) + kvh * hd, KV,
              p - start + 1, scale, sinks ? sinks + h : nullptr, sc, att_.data() + i * Q + h * hd);
  }
  linear(att_.data(), Q, n, *w.wo, Q, H, tmp_.data(), H);
  add_bias(tmp_.data(), n, H, w.bo);
}

void Engine::attention_mla(int layer, int64_t n, const int32_t* seqs, const int32_t* pos) {
  const ModelConfig& c = file_->config();
  const LayerWeights& w = layers_[static_cast<size_t>(layer)];
  const int64_t H = c.hidden_size, nh = c.num_heads, hd = c.head_dim, Q = nh * hd;
  const int64_t R = c.kv_lora_rank, nope = c.qk_nope_head_dim, rd = c.qk_rope_head_dim, vd = c.v_head_dim;
  const int64_t KW = R + rd, half = rd / 2, ATT = nh * vd, LQ = nh * R;
  const auto& kt = kernels::active();
  // NOTE: transformers builds q_a_layernorm and kv_a_layernorm with the RMSNorm
  // default eps 1e-6, whatever rms_norm_eps says (DeepSeek-V2 and V3 alike).
  const float eps = 1e-6f;
  // Queries: q = W_q x, or W_qb rmsnorm(W_qa x).
  // The compressed KV: [latent (R) | shared rotary key (rd)]; the cache keeps
  // the normalised latent and the rotated key, never per-head K and V.
  if (w.wq_a) {
    const int64_t QR = c.q_lora_rank;
    linear_many(xn_.data(), H, n, H, {{w.wq_a, QR, qa_.data()}, {w.wkv_a, KW, k_.data()}});
    for (int64_t i = 0; i < n; ++i) kt.rmsnorm(qa_.data() + i * QR, w.q_a_norm.data(), qa_.data() + i * QR, QR, eps);
    linear(qa_.data(), QR, n, *w.wq_b, QR, Q, q_.data(), Q);
  } else {
    linear_many(xn_.data(), H, n, H, {{w.wq, Q, q_.data()}, {w.wkv_a, KW, k_.data()}});
  }
  for (int64_t i = 0; i < n; ++i) {
    float* kv = k_.data() + i * KW;
    kt.rmsnorm(kv, w.kv_a_norm.data(), kv, R, eps);
    const float* cs = rope_cos_.data() + pos[i] * half;
    const float* sn = rope_sin_.data() + pos[i] * half;
    kt.rope(kv + R, 1, rd, rd, c.rope_interleaved, cs, sn);
    kt.rope(q_.data() + i * Q + nope, nh, hd, rd, c.rope_interleaved, cs, sn);
    std::memcpy(kv_->k(layer, seqs[i], pos[i]), kv, static_cast<size_t>(KW) * sizeof(float));
  }
  // Absorb W_uk into the queries: lat_q[h] = W_uk[h]^T q_nope[h] (attn_k_b
  // holds W_uk[h]^T as [R, nope] per head), so scores need only the latent.
  const size_t kb_head = static_cast<size_t>(R * nope) * dtype_size(w.wk_b->dtype);
  for (int64_t h = 0; h < nh; ++h)
    kernels::gemm(q_.data() + h * hd, Q, n, w.wk_b->data + h * kb_head, w.wk_b->dtype, nope, R, lat_q_.data() + h * R, LQ);

  const float scale = static_cast<float>(c.attn_scale);
  const int64_t window = w.window;
  const int64_t pairs = n * nh;
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads_) if (pairs * (pos[n - 1] + 1) > 4096)
  for (int64_t ph = 0; ph < pairs; ++ph) {
    const int64_t i = ph / nh, h = ph % nh;
    const int64_t p = pos[i], s = seqs[i];
    const int64_t start = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
    float* sc = scores_.data() + static_cast<size_t>(omp_get_thread_num()) * max_ctx_;
    const float* lq = lat_q_.data() + i * LQ + h * R;
    const float* qr = q_.data() + i * Q + h * hd + nope;
    float mx = -INFINITY;
    for (int64_t t = start; t <= p; ++t) {
      const float* kv = kv_->k(layer, s, t);
      float v = (kt.dot(lq, kv, R) + kt.dot(qr, kv + R, rd)) * scale;
      sc[t - start] = v;
      mx = std::max(mx, v);
    }
    float sum = 0.f;
    for (int64_t t = 0; t <= p - start; ++t) sum += (sc[t] = std::exp(sc[t] - mx));
    const float inv = 1.0f / sum;
    float* o = lat_o_.data() + i * LQ + h * R;
    std::memset(o, 0, static_cast<size_t>(R) * sizeof(float));
    for (int64_t t = start; t <= p; ++t) kt.axpy(o, sc[t - start] * inv, kv_->k(layer, s, t), R);
  }
  // Values: out[h] = W_uv[h] (sum_t p_t latent_t).
  const size_t vb_head = static_cast<size_t>(vd * R) * dtype_size(w.wv_b->dtype);
  for (int64_t h = 0; h < nh; ++h)
    kernels::gemm(lat_o_.data() + h * R, LQ, n, w.wv_b->data + h * vb_head, w.wv_b->dtype, R, vd, att_.data() + h * vd, ATT);
  linear(att_.data(), ATT, n, *w.wo, ATT, H, tmp_.data(), H);
  add_bias(tmp_.data(), n, H, w.bo);
}

void Engine::feed_forward(int layer, int64_t n, const int32_t* seqs, const int32_t* pos) {
  const ModelConfig& c = file_->config();
  const LayerWeights& w = layers_[static_cast<size_t>(layer)];
  const int64_t H = c.hidden_size, E = c.num_experts, K = c.experts_per_token;
  if (w.moe < 0) {
    ffn(w.dense, FfnSpec::silu(H, c.dense_intermediate_size), xn_.data(), n, moe_.data(), ffn_gate_.data(), ffn_up_.data());
    return;
  }
  // Router on the coordinator, experts wherever the placement says.
  kernels::gemm(xn_.data(), H, n, w.router->data, w.router->dtype, H, E, router_.data(), E);
  add_bias(router_.data(), n, E, w.router_bias);
  route(c.routing, router_.data(), n, E, K, w.score_bias.empty() ? nullptr : w.score_bias.data(), experts_.data(),
        weights_.data());
  routed(w.moe, n, seqs, pos, xn_.data(), experts_.data(), weights_.data(), moe_.data());
  if (c.shared_intermediate_size > 0) {
    ffn(w.shared, FfnSpec::silu(H, c.shared_intermediate_size), xn_.data(), n, tmp_.data(), ffn_gate_.data(),
        ffn_up_.data());
    const auto& kt = kernels::active();
    for (int64_t i = 0; i < n; ++i) {
      float* t = tmp_.data() + i * H;
      if (!w.shared_gate.empty()) {
        // Qwen2-MoE: the shared expert's output times sigmoid(x . w_gate).
        const float g = 1.0f / (1.0f + std::exp(-kt.dot(xn_.data() + i * H, w.shared_gate.data(), H)));
        for (int64_t j = 0; j < H; ++j) t[j] *= g;
      }
      float* m = moe_.data() + i * H;
      for (int64_t j = 0; j < H; ++j) m[j] += t[j];
    }
  }
}

void Engine::routed(int moe, int64_t n, const int32_t* seqs, const int32_t* pos, const float* xn, int32_t* experts,
                    float* weights, float* out, void* stream) {
  const int64_t K = file_->config().experts_per_token;
  if (replay_) replay_->next(moe, n, experts, weights);
  if (trace_)
    for (int64_t i = 0; i < n; ++i)
      trace_->write(step_, moe, seqs[i], pos[i], experts + i * K, weights + i * K, static_cast<int>(K));
  clock_.lap(Stage::Router);
  if (stream)
    dispatch_->forward_device(moe, xn, n, experts, weights, out, stream);
  else
    dispatch_->forward(moe, xn, n, experts, weights, out);
}

void Engine::forward(int64_t n, const int32_t* tokens, const int32_t* seqs, const int32_t* pos,
                     const uint8_t* want_logits) {
  const ModelConfig& c = file_->config();
  const int64_t H = c.hidden_size;
  const auto& kt = kernels::active();
  const float eps = static_cast<float>(c.rms_norm_eps);
  const size_t row_bytes = static_cast<size_t>(H) * dtype_size(embd_->dtype);
  if (comm_.size() > 1 && !workers_started_) start_workers();
  // Stage times: every segment of the pass is charged to a stage (clock_.lap).
  clock_.mark();
  clock_.count_pass();
  if (comm_.size() > 1) {
    cluster::send_op(comm_, cluster::Op::Forward, clock_.phase());
    clock_.lap(Stage::Exchange);
  }

  if (gpu_) {
    gpu_->forward(n, tokens, seqs, pos, want_logits, logits_.data(),
                  [&](int moe, int64_t rows, const float* xn, int32_t* experts, float* weights, float* out,
                      void* stream) { routed(moe, rows, seqs, pos, xn, experts, weights, out, stream); });
    if (comm_.size() > 1) cluster::end_pass(comm_, *file_);
    ++step_;
    return;
  }
  for (int64_t i = 0; i < n; ++i)
    kernels::to_f32(embd_->data + static_cast<size_t>(tokens[i]) * row_bytes, embd_->dtype, H, x_.data() + i * H);
  if (check_numerics_) check_stage("embedding", -1, n, x_.data(), H, seqs, pos);

  const bool mla = c.attention == "mla";
  for (int l = 0; l < c.num_layers; ++l) {
    const LayerWeights& w = layers_[static_cast<size_t>(l)];
    for (int64_t i = 0; i < n; ++i) kt.rmsnorm(x_.data() + i * H, w.attn_norm.data(), xn_.data() + i * H, H, eps);
    clock_.lap(Stage::Dense);
    if (mla)
      attention_mla(l, n, seqs, pos);
    else
      attention_gqa(l, n, seqs, pos);
    clock_.lap(Stage::Attention);
    if (check_numerics_) check_stage("attention output", l, n, tmp_.data(), H, seqs, pos);
    for (int64_t i = 0; i < n * H; ++i) x_[static_cast<size_t>(i)] += tmp_[static_cast<size_t>(i)];
    if (check_numerics_) check_stage("residual stream after the attention", l, n, x_.data(), H, seqs, pos, true);
    for (int64_t i = 0; i < n; ++i) kt.rmsnorm(x_.data() + i * H, w.ffn_norm.data(), xn_.data() + i * H, H, eps);
    clock_.lap(Stage::Dense);
    feed_forward(l, n, seqs, pos);
    if (check_numerics_)
      check_stage(w.moe < 0 ? "dense feed-forward output" : "MoE output (routed and shared experts)", l, n, moe_.data(), H,
                  seqs, pos);
    for (int64_t i = 0; i < n * H; ++i) x_[static_cast<size_t>(i)] += moe_[static_cast<size_t>(i)];
    if (check_numerics_) check_stage("residual stream after the feed-forward", l, n, x_.data(), H, seqs, pos, true);
    clock_.lap(Stage::Dense);
  }

  if (comm_.size() > 1) {
    cluster::end_pass(comm_, *file_);
    clock_.lap(Stage::Exchange);
  }
  ++step_;
  int64_t m = 0;
  for (int64_t i = 0; i < n; ++i)
    if (want_logits[i]) kt.rmsnorm(x_.data() + i * H, final_norm_.data(), gathered_.data() + (m++) * H, H, eps);
  if (m > 0) linear(gathered_.data(), H, m, *lm_head_, H, c.vocab_size, logits_.data(), c.vocab_size);
  clock_.lap(Stage::LmHead);
}

void Engine::check_stage(const char* stage, int layer, int64_t n, const float* x, int64_t w, const int32_t* seqs,
                         const int32_t* pos, bool normed_next) const {
  auto where = [&](int64_t i) {
    return std::string(stage) + (layer >= 0 ? " of layer " + std::to_string(layer) : std::string()) +
           ", row of sequence " + std::to_string(seqs[i]) + " at position " + std::to_string(pos[i]);
  };
  for (int64_t i = 0; i < n; ++i) {
    double ss = 0;
    for (int64_t j = 0; j < w; ++j) {
      const float v = x[i * w + j];
      ss += static_cast<double>(v) * v;
      if (std::isfinite(v)) continue;
      throw Error(Status::Numerical, "forward pass " + std::to_string(step_) + ": the first non-finite value (" +
                                         std::to_string(v) + ") is in the " + where(i) + ", element " + std::to_string(j));
    }
    // NOTE: an RMSNorm of a row whose mean square overflows f32 gives zeros
    // (as transformers' f32 norm does): finite, but every later value is garbage.
    if (normed_next && ss / static_cast<double>(w) > static_cast<double>(std::numeric_limits<float>::max())) {
      char ms[32];
      std::snprintf(ms, sizeof ms, "%.3g", ss / static_cast<double>(w));
      throw Error(Status::Numerical, "forward pass " + std::to_string(step_) + ": the " + where(i) +
                                         " overflows the next RMSNorm (mean square " + ms +
                                         " beyond the f32 range): its output is all zeros");
    }
  }
}

void Engine::check_pass(const char* phase, int64_t index, int64_t n, const int32_t* seqs, const int32_t* pos,
                        const uint8_t* want_logits) const {
  // NOTE: first the file: a pass that read zeros from a truncated file has
  // garbage logits, and the file is the cause to report.
  file_->check_unchanged();
  const int64_t V = file_->config().vocab_size;
  int64_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!want_logits[i]) continue;
    const float* lg = logits_.data() + (m++) * V;
    bool all_equal = V > 1;
    for (int64_t v = 0; v < V; ++v) {
      all_equal = all_equal && lg[v] == lg[0];
      if (std::isfinite(lg[v])) continue;
      throw Error(Status::Numerical,
                  std::string(phase) + " " + std::to_string(index) + ": the logits of sequence " + std::to_string(seqs[i]) + " at position " + std::to_string(pos[i]) +
                      " are not finite (" + std::to_string(lg[v]) + " for token " + std::to_string(v) +
                      "): the model's weights or config overflow; " +
                      (check_numerics_ ? "no earlier stage was non-finite, so the LM head overflowed"
                                       : "--check-numerics names the first layer and stage that goes non-finite"));
    }
    // NOTE: every logit equal (all zeros, say) is what an overflowed final
    // norm gives: no token is more likely than another, so sampling is garbage.
    if (all_equal)
      throw Error(Status::Numerical,
                  std::string(phase) + " " + std::to_string(index) + ": the logits of sequence " + std::to_string(seqs[i]) +
                      " at position " + std::to_string(pos[i]) + " are all equal (" + std::to_string(lg[0]) +
                      "): the activations overflowed (the final norm's input is beyond the f32 range); " +
                      (check_numerics_ ? "the LM head's input was all zeros"
                                       : "--check-numerics names the first layer and stage that overflows"));
  }
}

void Engine::validate(const std::vector<Request>& reqs) const {
  const ModelConfig& c = file_->config();
  if (reqs.empty()) throw Error(Status::InvalidArgument, "no prompts given");
  if (static_cast<int64_t>(reqs.size()) > max_batch_)
    throw Error(Status::InvalidArgument, std::to_string(reqs.size()) + " prompts exceed the maximum batch of " +
                                             std::to_string(max_batch_));
  for (size_t i = 0; i < reqs.size(); ++i) {
    const Request& r = reqs[i];
    std::string who = "prompt " + std::to_string(i);
    if (r.prompt.empty()) throw Error(Status::InvalidArgument, who + " is empty");
    for (size_t j = 0; j < r.prompt.size(); ++j)
      if (r.prompt[j] < 0 || r.prompt[j] >= c.vocab_size)
        throw Error(Status::InvalidArgument, who + ": token id " + std::to_string(r.prompt[j]) + " at position " +
                                                 std::to_string(j) + " is outside the vocabulary [0, " +
                                                 std::to_string(c.vocab_size) + ")");
    if (r.max_new_tokens < 0) throw Error(Status::InvalidArgument, who + ": max new tokens must be >= 0");
    const int64_t need = static_cast<int64_t>(r.prompt.size()) + r.max_new_tokens;
    if (need > max_ctx_)
      throw Error(Status::InvalidArgument, who + ": " + std::to_string(r.prompt.size()) + " prompt tokens + " +
                                               std::to_string(r.max_new_tokens) + " new tokens exceed the context of " +
                                               std::to_string(max_ctx_) + " positions");
    for (int32_t id : r.stop_ids)
      if (id < 0 || id >= c.vocab_size)
        throw Error(Status::InvalidArgument, who + ": stop token id " + std::to_string(id) + " is outside the vocabulary");
    validate_sampling(r.sampling, c.vocab_size);
  }
}

std::vector<SequenceOutput> Engine::generate(const std::vector<Request>& reqs, const GenerateOptions& opts,
                                             GenerateStats* stats) {
  validate(reqs);
  if (replay_) replay_->rewind();  // every call replays the same routing
  const ModelConfig& c = file_->config();
  const int64_t V = c.vocab_size, B = static_cast<int64_t>(reqs.size());
  using clock = std::chrono::steady_clock;
  GenerateStats st;
  std::vector<SequenceOutput> out(static_cast<size_t>(B));
  std::vector<Rng> rngs;
  std::vector<int64_t> len(static_cast<size_t>(B));
  std::vector<uint8_t> done(static_cast<size_t>(B), 0);
  for (int64_t s = 0; s < B; ++s) {
    const Request& r = reqs[static_cast<size_t>(s)];
    rngs.emplace_back(r.sampling.seed);
    len[static_cast<size_t>(s)] = static_cast<int64_t>(r.prompt.size());
    out[static_cast<size_t>(s)].tokens.reserve(static_cast<size_t>(r.max_new_tokens));
    if (opts.record_logits)
      out[static_cast<size_t>(s)].logits.reserve(static_cast<size_t>((r.prompt.size() + r.max_new_tokens) * V));
    if (r.max_new_tokens == 0) {
      done[static_cast<size_t>(s)] = 1;
      out[static_cast<size_t>(s)].finish_reason = "length";
    }
  }
  {
    // NOTE: the per-pass timings grow during the loops: reserve, so a step allocates nothing.
    int64_t prompt = 0, steps = 0;
    for (const Request& r : reqs) {
      prompt += static_cast<int64_t>(r.prompt.size());
      steps = std::max<int64_t>(steps, r.max_new_tokens);
    }
    st.prefill_pass_seconds.reserve(static_cast<size_t>((prompt + chunk_ - 1) / chunk_));
    st.decode_step_seconds.reserve(static_cast<size_t>(steps));
  }
  std::vector<int32_t> tok(static_cast<size_t>(rows_cap_)), seq(static_cast<size_t>(rows_cap_)),
      pos(static_cast<size_t>(rows_cap_));
  std::vector<uint8_t> want(static_cast<size_t>(rows_cap_));

  // Appends a sampled token; returns false when the caller asked to stop.
  auto accept = [&](int64_t s, const float* lg) -> bool {
    const Request& r = reqs[static_cast<size_t>(s)];
    SequenceOutput& o = out[static_cast<size_t>(s)];
    int32_t t = sampler_.sample(lg, r.sampling, rngs[static_cast<size_t>(s)]);
    o.tokens.push_back(t);
    int64_t p = len[static_cast<size_t>(s)]++;
    if (!r.ignore_eos &&
        (t == c.eos_token_id || std::find(r.stop_ids.begin(), r.stop_ids.end(), t) != r.stop_ids.end())) {
      done[static_cast<size_t>(s)] = 1;
      o.finish_reason = "eos";
    } else if (static_cast<int32_t>(o.tokens.size()) >= r.max_new_tokens) {
      done[static_cast<size_t>(s)] = 1;
      o.finish_reason = "length";
    }
    if (opts.stop && opts.stop(static_cast<int>(s), t, done[static_cast<size_t>(s)] ? o.finish_reason : std::string()) &&
        o.finish_reason != "eos") {
      done[static_cast<size_t>(s)] = 1;
      o.finish_reason = "stop";
    }
    if (opts.on_token && !opts.on_token(static_cast<int>(s), static_cast<int>(p), t)) {
      st.cancelled = true;
      return false;
    }
    return true;
  };

  auto interrupted = [&] {
    if (opts.interrupt && opts.interrupt->load() != 0) {
      st.interrupted = opts.interrupt->load();
      st.cancelled = true;
    }
    return st.cancelled;
  };

  // NOTE: an error after the run started keeps what was generated: the
  // caller gets it with the error (GenerationError) to print or return.
  try {
    // Prefill in chunks that may span sequences.
    auto t0 = clock::now();
    int64_t s = 0, p = 0;
    clock_.set_phase(Phase::Prefill);
    while (s < B && !interrupted()) {
      const auto tp = clock::now();
      int64_t n = 0;
      while (n < chunk_ && s < B) {
        const Request& r = reqs[static_cast<size_t>(s)];
        const bool last = p + 1 == static_cast<int64_t>(r.prompt.size());
        tok[static_cast<size_t>(n)] = r.prompt[static_cast<size_t>(p)];
        seq[static_cast<size_t>(n)] = static_cast<int32_t>(s);
        pos[static_cast<size_t>(n)] = static_cast<int32_t>(p);
        want[static_cast<size_t>(n)] = opts.record_logits || (last && r.max_new_tokens > 0);
        ++n;
        if (last) {
          ++s;
          p = 0;
        } else {
          ++p;
        }
      }
      forward(n, tok.data(), seq.data(), pos.data(), want.data());
      check_pass("prefill pass", static_cast<int64_t>(st.prefill_pass_seconds.size()), n, seq.data(), pos.data(), want.data());
      st.prefill_tokens += n;
      int64_t m = 0;
      for (int64_t i = 0; i < n && !st.cancelled; ++i) {
        if (!want[static_cast<size_t>(i)]) continue;
        const float* lg = logits_.data() + (m++) * V;
        const int64_t q = seq[static_cast<size_t>(i)];
        SequenceOutput& o = out[static_cast<size_t>(q)];
        if (opts.record_logits) o.logits.insert(o.logits.end(), lg, lg + V);
        const bool last = pos[static_cast<size_t>(i)] + 1 == static_cast<int32_t>(reqs[static_cast<size_t>(q)].prompt.size());
        if (last && !done[static_cast<size_t>(q)]) accept(q, lg);
      }
      clock_.lap(Stage::Sampling);
      st.prefill_pass_seconds.push_back(std::chrono::duration<double>(clock::now() - tp).count());
    }
    auto t1 = clock::now();
    st.prefill_seconds = std::chrono::duration<double>(t1 - t0).count();

    // Decode: one row per unfinished sequence.
    clock_.set_phase(Phase::Decode);
    while (!interrupted()) {
      const auto tp = clock::now();
      int64_t n = 0;
      for (int64_t q = 0; q < B; ++q) {
        if (done[static_cast<size_t>(q)]) continue;
        tok[static_cast<size_t>(n)] = out[static_cast<size_t>(q)].tokens.back();
        seq[static_cast<size_t>(n)] = static_cast<int32_t>(q);
        pos[static_cast<size_t>(n)] = static_cast<int32_t>(len[static_cast<size_t>(q)] - 1);
        want[static_cast<size_t>(n)] = 1;
        ++n;
      }
      if (n == 0) break;
      forward(n, tok.data(), seq.data(), pos.data(), want.data());
      check_pass("decode step", static_cast<int64_t>(st.decode_step_seconds.size()), n, seq.data(), pos.data(), want.data());
      for (int64_t i = 0; i < n && !st.cancelled; ++i) {
        const float* lg = logits_.data() + i * V;
        const int64_t q = seq[static_cast<size_t>(i)];
        if (opts.record_logits) out[static_cast<size_t>(q)].logits.insert(out[static_cast<size_t>(q)].logits.end(), lg, lg + V);
        accept(q, lg);
        ++st.decode_tokens;
      }
      clock_.lap(Stage::Sampling);
      st.decode_step_seconds.push_back(std::chrono::duration<double>(clock::now() - tp).count());
    }
    clock_.set_phase(Phase::Prefill);
    st.decode_seconds = std::chrono::duration<double>(clock::now() - t1).count();
  } catch (const GenerationError&) {
    throw;
  } catch (const Error& e) {
    clock_.set_phase(Phase::Prefill);
    for (auto& o : out)
      if (o.finish_reason.empty()) o.finish_reason = "error";
    if (stats) *stats = st;
    throw GenerationError(e, std::move(out), std::move(st));
  }
  if (st.cancelled)
    for (auto& o : out)
      if (o.finish_reason.empty()) o.finish_reason = st.interrupted ? "interrupted" : "cancelled";
  if (stats) *stats = st;
  return out;
}

}  // namespace colibri
