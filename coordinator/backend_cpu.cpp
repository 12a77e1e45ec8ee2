// backend_cpu.cpp: the model definition's operations on the CPU (see
// backend.h): the kernels of kernels/cpu/ on the weights as stored in the
// mapped file (f32, f16, bf16 or quantised), the KV cache in host memory.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "coordinator/backend.h"
#include "coordinator/kv_cache.h"
#include "coordinator/router.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/qkernels.h"
#include "model/error.h"
#include "worker/expert_ffn.h"

namespace colibri {

namespace {

// y[r * ldy + o] = x[r] . W[o] for a dense matrix of `in` inputs and `out`
// outputs, stored in a DType or quantised (ModelConfig::dense_quant).
void linear_view(const float* x, int64_t ldx, int64_t rows, const TensorView& w, int64_t in, int64_t out, float* y,
                 int64_t ldy) {
  if (w.quant != QuantType::None) {
    const qkernels::QMatrix m{w.quant, w.quant_group, in, w.data, w.scales};
    qkernels::gemm(x, ldx, rows, m, out, y, ldy);
  } else {
    kernels::gemm(x, ldx, rows, w.data, w.dtype, in, out, y, ldy);
  }
}

class CpuBackend final : public DenseBackend {
 public:
  CpuBackend(std::shared_ptr<const ColibriFile> file, const ModelPlan& plan, std::vector<LayerWeights> layers,
             const BackendOptions& o)
      : file_(std::move(file)), p_(plan), layers_(std::move(layers)), o_(o), kt_(&kernels::active()) {
    const ColibriFile& f = *file_;
    const ModelConfig& c = f.config();
    embd_ = &f.tensor(tname::token_embd());
    lm_head_ = c.tie_word_embeddings ? embd_ : &f.tensor(tname::output());
    {
      const TensorView& t = f.tensor(tname::output_norm());
      final_norm_.resize(static_cast<size_t>(t.numel()));
      kernels::to_f32(t.data, t.dtype, t.numel(), final_norm_.data());
    }
    // The per-head products (linear_heads) run on stored f32/f16/bf16 matrices.
    for (const LayerWeights& w : layers_)
      for (const TensorView* t : {w.wk_b, w.wv_b})
        if (t && t->quant != QuantType::None)
          throw Error(Status::Unsupported, "'" + t->name + "' is quantised; per-head products take f32, f16 or bf16");
    if (!o.kv_pool) throw Error(Status::Internal, "the CPU backend needs the engine's KV block pool");
    kv_ = std::make_unique<KVCache>(p_.layers, *o.kv_pool, p_.kv_width, p_.v_width, o.kv_dtype);
    const int64_t R = o.rows_cap, H = p_.hidden, NH = p_.heads;
    const bool latent = p_.kv_lora_rank > 0;
    auto sz = [](int64_t a, int64_t b) { return static_cast<size_t>(a * b); };
    try {
      for (Act a : {Act::X, Act::Xn, Act::Tmp, Act::Moe, Act::Gathered}) buf(a).resize(sz(R, H));
      buf(Act::Q).resize(sz(R, p_.q_width));
      buf(Act::Att).resize(sz(R, p_.att_width));
      buf(Act::K).resize(sz(R, p_.kv_width));
      if (!latent) buf(Act::V).resize(sz(R, p_.kv_width));
      if (latent) {
        buf(Act::Qa).resize(sz(R, p_.q_lora_rank));
        buf(Act::Qcat).resize(sz(R, NH * p_.kv_width));
        buf(Act::LatO).resize(sz(R, NH * p_.kv_lora_rank));
        head_jobs_.resize(static_cast<size_t>(NH));
      }
      router_.resize(sz(R, p_.experts));
      experts_.resize(sz(R, p_.top_k));
      weights_.resize(sz(R, p_.top_k));
      ffn_gate_.resize(sz(R, p_.ffn_inter));
      ffn_up_.resize(sz(R, p_.ffn_inter));
      scores_.resize(sz(o.threads, o.max_ctx));
      // A widened row per thread (the latent attention over a 16-bit cache).
      if (o.kv_dtype != DType::F32) krow_.resize(sz(o.threads, p_.kv_width));
    } catch (const std::bad_alloc&) {
      throw Error(Status::OutOfMemory, "activation buffers for " + std::to_string(R) + " rows do not fit in memory");
    }
  }

  float* act(Act a) override { return buf(a).data(); }
  uint64_t kv_cache_bytes() const override { return kv_->bytes(); }
  const float* host(const float* p) const override { return p; }

  void begin(int64_t n, const int32_t* tokens, const int32_t* seqs, const int32_t* pos, const uint8_t* want) override {
    n_ = n, tokens_ = tokens, seqs_ = seqs, pos_ = pos, want_ = want;
    kt_ = &kernels::active();  // NOTE: per pass, as kernels::select() may change it between calls
  }

  void embed(float* x) override {
    const int64_t H = p_.hidden;
    const size_t row_bytes = static_cast<size_t>(H) * dtype_size(embd_->dtype);
    for (int64_t i = 0; i < n_; ++i)
      kernels::to_f32(embd_->data + static_cast<size_t>(tokens_[i]) * row_bytes, embd_->dtype, H, x + i * H);
  }

  void rmsnorm(const float* x, int64_t ldx, int layer, Vec w, float* y, int64_t ldy, int64_t rows, int64_t width,
               float eps) override {
    const float* g = vec(layer, w);
    for (int64_t i = 0; i < rows; ++i) kt_->rmsnorm(x + i * ldx, g, y + i * ldy, width, eps);
  }

  void linear(const float* x, int64_t ldx, int64_t rows, int64_t in, MatRef w, int64_t out, float* y,
              int64_t ldy) override {
    linear_view(x, ldx, rows, mat(w), in, out, y, ldy);
  }

  // One parallel region for all (kernels::gemm_many, or qkernels::gemm_many
  // when all are quantised alike: one quantisation of x); mixed storage runs
  // one product after another.
  void linear_many(const float* x, int64_t ldx, int64_t rows, int64_t in,
                   std::initializer_list<Projection> jobs) override {
    const TensorView& w0 = mat(jobs.begin()->w);
    if (std::all_of(jobs.begin(), jobs.end(), [&](const Projection& j) { return mat(j.w).quant == QuantType::None; })) {
      kernels::GemmJob g[4];
      int n = 0;
      for (const auto& j : jobs) {
        const TensorView& t = mat(j.w);
        g[n++] = {x, ldx, rows, t.data, t.dtype, in, j.out, j.y, j.out};
      }
      kernels::gemm_many(g, n);
      return;
    }
    if (!std::all_of(jobs.begin(), jobs.end(), [&](const Projection& j) {
          return mat(j.w).quant == w0.quant && mat(j.w).quant_group == w0.quant_group;
        })) {
      for (const auto& j : jobs) linear_view(x, ldx, rows, mat(j.w), in, j.out, j.y, j.out);
      return;
    }
    qkernels::QGemmJob q[qkernels::kMaxGemmMany];
    int n = 0;
    for (const auto& j : jobs) {
      const TensorView& t = mat(j.w);
      q[n++] = {{t.quant, t.quant_group, in, t.data, t.scales}, j.out, j.y, j.out};
    }
    qkernels::gemm_many(x, ldx, rows, q, n);
  }

  // Every head's product in one parallel region (each bitwise kernels::gemm's).
  void linear_heads(const float* x, int64_t ldx, int64_t xhs, int64_t rows, MatRef w, int64_t heads, int64_t in,
                    int64_t out, float* y, int64_t ldy, int64_t yhs) override {
    const TensorView& t = mat(w);  // never quantised: checked at construction
    const size_t head_bytes = static_cast<size_t>(in * out) * dtype_size(t.dtype);
    for (int64_t h = 0; h < heads; ++h)
      head_jobs_[static_cast<size_t>(h)] = {x + h * xhs, ldx, rows, t.data + h * head_bytes, t.dtype, in, out,
                                            y + h * yhs, ldy};
    kernels::gemm_many(head_jobs_.data(), static_cast<int>(heads));
  }

  void add_bias(float* y, int64_t ldy, int64_t rows, int64_t width, int layer, Vec b) override {
    const float* v = vec(layer, b);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < width; ++i) y[r * ldy + i] += v[i];
  }

  void clamp(float* x, int64_t count, float limit) override {
    for (int64_t i = 0; i < count; ++i) x[i] = std::clamp(x[i], -limit, limit);
  }

  void rope(float* x, int64_t ldx, int64_t rows, int64_t heads, int64_t head_stride, int64_t rope_dim,
            bool interleaved) override {
    const int64_t half = p_.rope_dim / 2;
    for (int64_t i = 0; i < rows; ++i)
      kt_->rope(x + i * ldx, heads, head_stride, rope_dim, interleaved, o_.rope_cos + pos_[i] * half,
                o_.rope_sin + pos_[i] * half);
  }

  void kv_store(int layer, const float* k, int64_t ldk, const float* v, int64_t ldv) override {
    for (int64_t i = 0; i < n_; ++i) kv_->store(layer, seqs_[i], pos_[i], k + i * ldk, v ? v + i * ldv : nullptr);
  }

  // One (row, head) pair per iteration, over positions [start, p] of the
  // row's sequence (consecutive rows of the cache).
  void attention(int layer, const AttentionOp& a) override {
    const int64_t n = n_, pairs = n * a.heads;
    const float* sinks = a.sinks ? vec(layer, Vec::Sinks) : nullptr;
    const int32_t *seqs = seqs_, *pos = pos_;
#pragma omp parallel for schedule(dynamic, 4) num_threads(o_.threads) if (pairs * (pos[n - 1] + 1) > 4096)
    for (int64_t ph = 0; ph < pairs; ++ph) {
      const int64_t i = ph / a.heads, h = ph % a.heads;
      const int64_t p = pos[i], s = seqs[i];
      const int64_t start = a.window > 0 ? std::max<int64_t>(0, p - a.window + 1) : 0;
      float* sc = scores_.data() + static_cast<size_t>(omp_get_thread_num()) * o_.max_ctx;
      const float* q = a.q + i * a.ldq + h * a.q_head_stride;
      float* o = a.out + i * a.ldo + h * a.o_head_stride;
      if (a.latent) {
        attend_latent(layer, s, start, p, q, a, sc, o);
      } else {
        const int64_t kvh = h / a.group, n_pos = p - start + 1, bt = o_.kv_pool->block_tokens();
        const int32_t* table = o_.kv_pool->table(static_cast<int>(s));
        const float* sink = sinks ? sinks + h : nullptr;
        if (kv_->dtype() == DType::F32)
          kt_->attend(q, a.dk, static_cast<const float*>(kv_->k_layer(layer)) + kvh * a.dk,
                      static_cast<const float*>(kv_->v_layer(layer)) + kvh * a.dv, p_.kv_width, table, bt, start,
                      n_pos, a.scale, sink, sc, o);
        else
          kt_->attend16(q, a.dk, static_cast<const uint16_t*>(kv_->k_layer(layer)) + kvh * a.dk,
                        static_cast<const uint16_t*>(kv_->v_layer(layer)) + kvh * a.dv, p_.kv_width, kv_->dtype(),
                        table, bt, start, n_pos, a.scale, sink, sc, o);
      }
    }
  }

  void copy_rows(const float* src, int64_t lds, float* dst, int64_t ldd, int64_t rows, int64_t width) override {
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(dst + r * ldd, src + r * lds, static_cast<size_t>(width) * sizeof(float));
  }

  void add(float* y, const float* x, int64_t count) override {
    for (int64_t i = 0; i < count; ++i) y[i] += x[i];
  }

  void ffn(int layer, bool shared, const float* x, int64_t rows, float* y) override {
    const LayerWeights& w = layers_[static_cast<size_t>(layer)];
    colibri::ffn(shared ? w.shared : w.dense, FfnShape::silu(p_.hidden, shared ? p_.shared_inter : p_.dense_inter), x,
                 rows, y, ffn_gate_.data(), ffn_up_.data());
  }

  void sigmoid_gate(const float* x, int layer, float* y, int64_t rows) override {
    const int64_t H = p_.hidden;
    const float* gw = layers_[static_cast<size_t>(layer)].shared_gate.data();
    for (int64_t i = 0; i < rows; ++i) {
      // Qwen2-MoE: the shared expert's output times sigmoid(x . w_gate).
      const float g = 1.0f / (1.0f + std::exp(-kt_->dot(x + i * H, gw, H)));
      float* t = y + i * H;
      for (int64_t j = 0; j < H; ++j) t[j] *= g;
    }
  }

  void route(int layer, const float* xn, int64_t rows) override {
    const LayerWeights& w = layers_[static_cast<size_t>(layer)];
    const int64_t H = p_.hidden, E = p_.experts;
    kernels::gemm(xn, H, rows, w.router->data, w.router->dtype, H, E, router_.data(), E);
    if (!w.router_bias.empty()) add_bias(router_.data(), E, rows, E, layer, Vec::RouterBias);
    colibri::route(p_.route, router_.data(), rows, E, p_.top_k, w.score_bias.empty() ? nullptr : w.score_bias.data(),
                   experts_.data(), weights_.data());
  }

  MoeIo moe_inputs(int, int64_t) override {
    return {buf(Act::Xn).data(), experts_.data(), weights_.data(), buf(Act::Moe).data(), nullptr};
  }
  void moe_output(int64_t) override {}

  int64_t gather_wanted(const float* x, int64_t ldx, float* dst) override {
    int64_t m = 0;
    for (int64_t i = 0; i < n_; ++i)
      if (want_[i]) std::memcpy(dst + (m++) * p_.hidden, x + i * ldx, static_cast<size_t>(p_.hidden) * sizeof(float));
    return m;
  }

  void lm_head(const float* x, int64_t m, float* logits) override {
    if (m > 0) linear_view(x, p_.hidden, m, *lm_head_, p_.hidden, p_.vocab, logits, p_.vocab);
    o_.clock->lap(Stage::LmHead);
  }

  void lap(Stage s) override { o_.clock->lap(s); }

 private:
  std::vector<float>& buf(Act a) { return acts_[static_cast<size_t>(a)]; }

  const float* vec(int layer, Vec v) const {
    if (v == Vec::FinalNorm) return final_norm_.data();
    const LayerWeights& w = layers_[static_cast<size_t>(layer)];
    switch (v) {
      case Vec::AttnNorm: return w.attn_norm.data();
      case Vec::FfnNorm: return w.ffn_norm.data();
      case Vec::BiasQ: return w.bq.data();
      case Vec::BiasK: return w.bk.data();
      case Vec::BiasV: return w.bv.data();
      case Vec::BiasO: return w.bo.data();
      case Vec::QNorm: return w.q_norm.data();
      case Vec::KNorm: return w.k_norm.data();
      case Vec::Sinks: return w.sinks.data();
      case Vec::QaNorm: return w.q_a_norm.data();
      case Vec::KvaNorm: return w.kv_a_norm.data();
      case Vec::SharedGate: return w.shared_gate.data();
      case Vec::RouterBias: return w.router_bias.data();
      case Vec::FinalNorm: break;
    }
    return nullptr;
  }

  const TensorView& mat(MatRef r) const {
    if (r.m == Mat::LmHead) return *lm_head_;
    const LayerWeights& w = layers_[static_cast<size_t>(r.layer)];
    const TensorView* t = nullptr;
    switch (r.m) {
      case Mat::Q: t = w.wq; break;
      case Mat::K: t = w.wk; break;
      case Mat::V: t = w.wv; break;
      case Mat::O: t = w.wo; break;
      case Mat::Qa: t = w.wq_a; break;
      case Mat::Qb: t = w.wq_b; break;
      case Mat::Kva: t = w.wkv_a; break;
      case Mat::Kb: t = w.wk_b; break;
      case Mat::Vb: t = w.wv_b; break;
      case Mat::LmHead: break;
    }
    return *t;
  }

  // Latent attention of one head: the score is q[0, R) . latent + q[R, dk) .
  // rotary key, the output the softmax-weighted sum of the latents.
  void attend_latent(int layer, int64_t s, int64_t start, int64_t p, const float* lq, const AttentionOp& a, float* sc,
                     float* o) {
    const int64_t R = a.dv, rd = a.dk - a.dv;
    const kernels::KernelTable& kt = *kt_;
    const float* qr = lq + R;
    // A 16-bit cache's rows are widened here (exactly), then used as f32 rows are.
    float* tmp = krow_.empty() ? nullptr : krow_.data() + static_cast<size_t>(omp_get_thread_num()) * p_.kv_width;
    const DType dt = kv_->dtype();
    auto row_at = [&](int64_t t) -> const float* {
      const void* r = kv_->k_row(layer, s, t);
      if (dt == DType::F32) return static_cast<const float*>(r);
      kt.widen16(static_cast<const uint16_t*>(r), dt, p_.kv_width, tmp);
      return tmp;
    };
    float mx = -INFINITY;
    for (int64_t t = start; t <= p; ++t) {
      const float* row = row_at(t);
      float v = (kt.dot(lq, row, R) + kt.dot(qr, row + R, rd)) * a.scale;
      sc[t - start] = v;
      mx = std::max(mx, v);
    }
    float sum = 0.f;
    for (int64_t t = 0; t <= p - start; ++t) sum += (sc[t] = std::exp(sc[t] - mx));
    const float inv = 1.0f / sum;
    std::memset(o, 0, static_cast<size_t>(R) * sizeof(float));
    for (int64_t t = start; t <= p; ++t) kt.axpy(o, sc[t - start] * inv, row_at(t), R);
  }

  std::shared_ptr<const ColibriFile> file_;
  const ModelPlan& p_;
  std::vector<LayerWeights> layers_;
  BackendOptions o_;
  const kernels::KernelTable* kt_;
  const TensorView* embd_ = nullptr;
  const TensorView* lm_head_ = nullptr;
  std::vector<float> final_norm_;
  std::unique_ptr<KVCache> kv_;
  std::vector<float> krow_;  // [threads][kv_width]: widened latent rows (16-bit cache)
  std::vector<float> acts_[static_cast<size_t>(Act::Count)];
  std::vector<float> router_, weights_, ffn_gate_, ffn_up_, scores_;
  std::vector<int32_t> experts_;
  std::vector<kernels::GemmJob> head_jobs_;
  // The pass's rows (host memory, from begin()).
  int64_t n_ = 0;
  const int32_t *tokens_ = nullptr, *seqs_ = nullptr, *pos_ = nullptr;
  const uint8_t* want_ = nullptr;
};

}  // namespace

std::unique_ptr<DenseBackend> make_cpu_backend(std::shared_ptr<const ColibriFile> file, const ModelPlan& plan,
                                               std::vector<LayerWeights> layers, const BackendOptions& o) {
  return std::make_unique<CpuBackend>(std::move(file), plan, std::move(layers), o);
}

}  // namespace colibri
