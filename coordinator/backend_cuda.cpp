// backend_cuda.cpp: the model definition's operations on one CUDA GPU (see
// backend.h), with the kernels of kernels/cuda/: matrices as bf16 through
// cuBLASLt (the router's product in f32), the KV cache and the activations in
// device memory. The routed experts go through the host: each MoE layer
// downloads the router's choices (and, unless device_moe, its normalised
// rows); the engine's hook returns the combined expert output, uploaded again.
//
// Passes of decode size whose every row wants logits replay CUDA graphs of
// the stretches between MoE layers, captured at their first pass of n rows:
// an operation is queued as a small in-place closure (no allocation) and a
// stretch's closures are captured once; later passes of that size skip the
// queue and launch the graph. Built only with CUDA; make_cuda_backend throws
// Error(Unsupported) otherwise.
#include <algorithm>
#include <cstdlib>
#include <map>
#include <new>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "coordinator/backend.h"
#include "coordinator/kv_cache.h"
#include "coordinator/router.h"
#include "model/error.h"
#include "worker/gpu_experts.h"

#ifdef COLIBRI_HAVE_CUDA
#include <spdlog/spdlog.h>

#include "kernels/cuda/dense.h"
#include "kernels/cuda/device_info.h"
#include "kernels/cuda/ffn.h"
#include "kernels/cuda/ffn_pack.h"
#include "kernels/cuda/memory.h"
#include "model/dtype.h"
#endif

namespace colibri {

#ifdef COLIBRI_HAVE_CUDA
namespace {

using cuda::DeviceBuffer;
using cuda::PinnedBuffer;

// A matrix [out][in] as bf16 in device memory.
struct DevMatrix {
  DeviceBuffer buf;
  int64_t out = 0, in = 0;
  const uint16_t* p() const { return buf.as<const uint16_t>(); }
};

struct DevFfn {
  DeviceBuffer buf;
  cuda::DeviceFfn view;
};

struct DevLayer {
  DeviceBuffer attn_norm, ffn_norm, bq, bk, bv, bo, q_norm, k_norm, sinks, q_a_norm, kv_a_norm;
  DevMatrix wq, wk, wv, wo, wq_a, wq_b, wkv_a, wk_b, wv_b;
  DeviceBuffer router, router_bias, score_bias, shared_gate;  // router f32 [E][H]
  DevFfn dense, shared;
};

const float* fptr(const DeviceBuffer& b) { return b.get() ? b.as<const float>() : nullptr; }

// A queued GPU operation: a closure of pointers and sizes, stored in place.
class QueuedOp {
 public:
  template <class F>
  explicit QueuedOp(const F& f) {
    static_assert(sizeof(F) <= sizeof(buf_) && alignof(F) <= alignof(std::max_align_t) &&
                      std::is_trivially_copyable_v<F> && std::is_trivially_destructible_v<F>,
                  "a queued GPU operation captures only pointers and sizes, by value");
    ::new (static_cast<void*>(buf_)) F(f);
    run_ = [](const void* p) { (*static_cast<const F*>(p))(); };
  }
  void operator()() const { run_(buf_); }

 private:
  alignas(std::max_align_t) unsigned char buf_[256];
  void (*run_)(const void*) = nullptr;
};

class CudaBackend final : public DenseBackend {
 public:
  CudaBackend(std::shared_ptr<const ColibriFile> file, const ModelPlan& plan, const std::vector<LayerWeights>& layers,
              const BackendOptions& o)
      : file_(std::move(file)), c_(file_->config()), p_(plan), o_(o) {
    const std::string who = "rank " + std::to_string(o.rank) + ": ";
    // What the kernels cannot take is refused before anything is allocated.
    if (p_.experts > 1024 || p_.top_k > 32)
      throw Error(Status::Unsupported, who + "the GPU router takes at most 1024 experts and top-32");
    latent_ = p_.kv_lora_rank > 0;
    const int64_t dk = latent_ ? p_.kv_width : p_.head_dim;
    if (dk > 1024 || p_.rope_dim > 1024)
      throw Error(Status::Unsupported, who + "the GPU attention takes head sizes up to 1024, this model has " +
                                           std::to_string(dk));
    static_assert(static_cast<int>(RouteScoring::TopkSoftmax) == static_cast<int>(cuda::RouteScoring::TopkSoftmax) &&
                  static_cast<int>(RouteGroups::Top2Sum) == static_cast<int>(cuda::RouteGroups::Top2Sum));
    scoring_ = static_cast<cuda::RouteScoring>(p_.route.scoring);
    groups_ = static_cast<cuda::RouteGroups>(p_.route.groups);
    {
      const TensorView& e = file_->tensor(tname::token_embd());
      if (e.quant != QuantType::None) throw unsupported_quant(e);
      if (!c_.tie_word_embeddings && file_->tensor(tname::output()).quant != QuantType::None)
        throw unsupported_quant(file_->tensor(tname::output()));
    }
    for (const LayerWeights& w : layers) {
      for (const TensorView* t : {w.wq, w.wk, w.wv, w.wo, w.wq_a, w.wq_b, w.wkv_a, w.wk_b, w.wv_b, w.router})
        if (t && t->quant != QuantType::None) throw unsupported_quant(*t);
      for (const FfnWeights* f : {&w.dense, &w.shared})
        if (f->gate && f->quant != QuantType::None)
          throw Error(Status::Unsupported, who + "a quantised dense FFN; the GPU coordinator takes f32, f16 or bf16 "
                                                 "weights (run the coordinator with --coordinator-device cpu)");
    }
    cuda::set_device(o.device);
    stream_ = std::make_unique<cuda::Stream>();
    s_ = stream_->get();
    routed_ready_ = std::make_unique<cuda::Event>();
    if (const char* g = std::getenv("COLIBRI_CUDA_GRAPHS"); g && std::string(g) == "0") use_graphs_ = false;
    const int64_t R = o.rows_cap, H = p_.hidden, E = p_.experts, K = p_.top_k, V = p_.vocab;
    const int64_t Q = p_.q_width, KW = p_.kv_width, VW = p_.v_width, ATT = p_.att_width;
    const int64_t LQ = latent_ ? p_.heads * p_.kv_lora_rank : 0, QCAT = latent_ ? p_.heads * KW : 0;
    const int64_t QR = latent_ ? p_.q_lora_rank : 0;

    // What it needs, checked against the free memory before allocating.
    uint64_t weights = 0;
    auto mat_bytes = [](const TensorView* t) { return t ? static_cast<uint64_t>(t->numel()) * 2 : 0; };
    const TensorView& embd = file_->tensor(tname::token_embd());
    const TensorView& head = c_.tie_word_embeddings ? embd : file_->tensor(tname::output());
    weights += static_cast<uint64_t>(embd.numel()) * dtype_size(embd.dtype);
    if (!(c_.tie_word_embeddings && embd.dtype == DType::BF16)) weights += mat_bytes(&head);
    for (const LayerWeights& w : layers) {
      for (const TensorView* t : {w.wq, w.wk, w.wv, w.wo, w.wq_a, w.wq_b, w.wkv_a, w.wk_b, w.wv_b})
        weights += mat_bytes(t);
      if (w.router) weights += static_cast<uint64_t>(w.router->numel()) * 4;
      for (const FfnWeights* f : {&w.dense, &w.shared})
        if (f->gate) weights += static_cast<uint64_t>(3) * 2 * (f == &w.dense ? p_.dense_inter : p_.shared_inter) * H;
    }
    // The paged cache (coordinator/kv_cache.h): the pool's blocks, addressed through its tables.
    if (!o.kv_pool) throw Error(Status::Internal, "the CUDA backend needs the engine's KV block pool");
    kv_rows_ = o.kv_pool->num_blocks() * o.kv_pool->block_tokens();
    table_ints_ = o.kv_pool->max_slots() * o.kv_pool->blocks_per_slot();
    kv_es_ = KVCache::element_bytes(o.kv_dtype);
    kv_code_ = static_cast<int>(o.kv_dtype);  // cuda::KvLayout::dtype, as embed's table dtype
    kv_bytes_ = static_cast<uint64_t>(p_.layers) * kv_rows_ * (KW + VW) * kv_es_;
    const int64_t XB = std::max({H, Q, ATT, QR, LQ});
    act_bytes_ = static_cast<uint64_t>(R) * 4 * (6 * H + Q + 2 * KW + ATT + QR + QCAT + LQ + E + 2 * K + V + 4) +
                 static_cast<uint64_t>(R) * 2 * XB;
    const int64_t inter = std::max(p_.dense_inter, p_.shared_inter);
    // Two FFN runners' scratch, three GEMM workspaces of 32 MiB, the rotary tables.
    act_bytes_ += static_cast<uint64_t>(R) * (18 * H + 10 * inter) * 2 + (uint64_t{96} << 20) +
                  static_cast<uint64_t>(o.max_ctx) * p_.rope_dim * 4;
    const size_t free_b = cuda::free_device_memory();
    const uint64_t need = (weights + kv_bytes_ + act_bytes_) / 10 * 11;
    if (need > free_b)
      throw Error(Status::OutOfMemory,
                  who + "the dense part needs " + std::to_string(need >> 20) + " MiB on GPU " + std::to_string(o.device) +
                      " (weights " + std::to_string(weights >> 20) + " MiB, KV cache " + std::to_string(kv_bytes_ >> 20) +
 " MiB for " + std::to_string(kv_rows_) +
                      " positions, activations " + std::to_string(act_bytes_ >> 20) + " MiB), " +
                      std::to_string(free_b >> 20) + " MiB are free (a smaller --max-context or --max-batch, or "
                      "--coordinator-device cpu)");
    spdlog::info("rank {}: the dense part on GPU {}: weights {} MiB, KV cache {} MiB ({} positions in blocks of {}), "
                 "activations {} MiB; {} MiB free", o.rank, o.device, weights >> 20, kv_bytes_ >> 20, kv_rows_,
                 o.kv_pool->block_tokens(), act_bytes_ >> 20, free_b >> 20);

    // Weights.
    embd_dtype_ = static_cast<int>(embd.dtype);
    embd_ = upload_raw(embd.data, static_cast<size_t>(embd.numel()) * dtype_size(embd.dtype));
    if (c_.tie_word_embeddings && embd.dtype == DType::BF16) {
      head_shared_ = true;  // the table already is the bf16 [vocab][hidden] matrix
    } else {
      head_ = matrix(&head);
    }
    {
      const TensorView& t = file_->tensor(tname::output_norm());
      std::vector<float> fn(static_cast<size_t>(t.numel()));
      convert_elements(t.data, t.dtype, fn.data(), DType::F32, fn.size());
      final_norm_ = upload_f32(fn);
    }
    layers_.resize(layers.size());
    for (size_t l = 0; l < layers.size(); ++l) upload_layer(layers[l], layers_[l]);
    std::vector<float> cs(o.rope_cos, o.rope_cos + o.max_ctx * (p_.rope_dim / 2));
    std::vector<float> sn(o.rope_sin, o.rope_sin + o.max_ctx * (p_.rope_dim / 2));
    cos_ = upload_f32(cs);
    sin_ = upload_f32(sn);

    // KV cache and activations.
    kcache_ = DeviceBuffer(static_cast<size_t>(p_.layers * kv_rows_ * KW * kv_es_));
    if (VW) vcache_ = DeviceBuffer(static_cast<size_t>(p_.layers * kv_rows_ * VW * kv_es_));
    auto f32 = [&](int64_t w) { return DeviceBuffer(static_cast<size_t>(std::max<int64_t>(R * w, 1)) * 4); };
    for (Act a : {Act::X, Act::Xn, Act::Tmp, Act::Moe, Act::Gathered}) buf(a) = f32(H);
    buf(Act::Q) = f32(Q), buf(Act::K) = f32(KW), buf(Act::Att) = f32(ATT);
    if (latent_)
      buf(Act::Qa) = f32(QR), buf(Act::Qcat) = f32(QCAT), buf(Act::LatO) = f32(LQ);
    else
      buf(Act::V) = f32(KW);
    logits_ = f32(V), rlogits_ = f32(E), weights_ = f32(K);
    xb_ = DeviceBuffer(static_cast<size_t>(R * XB) * 2);
    experts_ = f32(K);  // int32, same size
    ints_ = DeviceBuffer(static_cast<size_t>(4 * R) * 4);  // tokens, seqs, pos, wanted rows
    h_ints_ = PinnedBuffer(static_cast<size_t>(4 * R) * 4);
    tables_ = DeviceBuffer(static_cast<size_t>(table_ints_) * 4);  // the KV block tables
    h_tables_ = PinnedBuffer(static_cast<size_t>(table_ints_) * 4);
    d_blocks_ = tables_.as<const int32_t>();
    if (!o.device_moe) {
      h_xn_ = PinnedBuffer(static_cast<size_t>(R * H) * 4);
      h_moe_ = PinnedBuffer(static_cast<size_t>(R * H) * 4);
    }
    h_experts_ = PinnedBuffer(static_cast<size_t>(R * K) * 4);
    h_weights_ = PinnedBuffer(static_cast<size_t>(R * K) * 4);
    gemm_ = std::make_unique<cuda::Gemm>(s_);
    if (p_.any_dense) dense_ffn_ = std::make_unique<cuda::FfnRunner>(FfnShape::silu(H, p_.dense_inter), R, s_);
    if (p_.shared_inter > 0) shared_ffn_ = std::make_unique<cuda::FfnRunner>(FfnShape::silu(H, p_.shared_inter), R, s_);
    // NOTE: a stretch queues about 30 operations per layer; grown, if ever, in a first pass only.
    pending_.reserve(static_cast<size_t>(64 + 40 * p_.layers));
    // NOTE: the uploads above are synchronous copies on the legacy default
    // stream, which may return before their DMA ends: wait for it, then ours.
    cuda::synchronize(nullptr);
    stream_->synchronize();
  }

  ~CudaBackend() override {
    cuda::set_device_quietly(o_.device);
    if (stream_) stream_->drain();  // nothing in flight reads what is freed below
  }

  float* act(Act a) override { return buf(a).as<float>(); }
  uint64_t kv_cache_bytes() const override { return kv_bytes_; }
  const float* host(const float*) const override { return nullptr; }

  void begin(int64_t n, const int32_t* tokens, const int32_t* seqs, const int32_t* pos, const uint8_t* want) override {
    const int64_t R = o_.rows_cap;
    if (n < 1 || n > R) throw Error(Status::Internal, "GPU forward: " + std::to_string(n) + " rows");
    cuda::set_device(o_.device);
    int32_t* hi = reinterpret_cast<int32_t*>(h_ints_.data());
    std::copy(tokens, tokens + n, hi);
    std::copy(seqs, seqs + n, hi + R);
    std::copy(pos, pos + n, hi + 2 * R);
    int64_t m = 0;
    for (int64_t i = 0; i < n; ++i)
      if (want[i]) hi[3 * R + m++] = static_cast<int32_t>(i);
    n_ = n, m_ = m;
    // The block tables change only when a sequence takes or frees a block:
    // uploaded then, at once (not through a stretch's graph), ahead of the
    // pass on the stream. h_tables_ is free again: the previous pass ended
    // with the stream synchronised.
    if (tables_version_ != o_.kv_pool->version()) {
      tables_version_ = o_.kv_pool->version();
      std::copy(o_.kv_pool->tables(), o_.kv_pool->tables() + table_ints_, reinterpret_cast<int32_t*>(h_tables_.data()));
      cuda::copy_async(tables_.get(), h_tables_.data(), static_cast<size_t>(table_ints_) * 4, cuda::Copy::HostToDevice, s_);
    }
    // Passes of decode size whose every row wants logits replay the graphs of their stretches.
    graphs_on_ = use_graphs_ && !o_.sync_stages && m == n && n <= o_.max_batch;
    segment_ = 0;
    pending_.clear();
    start_stretch();
    const int32_t* d_tok = ints_.as<const int32_t>();
    d_seq_ = d_tok + R, d_pos_ = d_tok + 2 * R, d_want_ = d_tok + 3 * R;
    void* dst = ints_.get();
    const size_t bytes = static_cast<size_t>(4 * R) * 4;
    // h_ints_ is read when the copy executes: the previous pass ended with the stream synchronised.
    issue([=, this] { cuda::copy_async(dst, hi, bytes, cuda::Copy::HostToDevice, s_); });
  }

  void embed(float* x) override {
    const void* table = embd_.get();
    const int dt = embd_dtype_;
    const int32_t* tok = ints_.as<const int32_t>();
    const int64_t n = n_, H = p_.hidden;
    issue([=, this] { cuda::embed(table, dt, tok, n, H, x, s_); });
  }

  void rmsnorm(const float* x, int64_t ldx, int layer, Vec w, float* y, int64_t ldy, int64_t rows, int64_t width,
               float eps) override {
    const float* g = vec(layer, w);
    issue([=, this] { cuda::rmsnorm(x, ldx, g, y, ldy, rows, width, eps, s_); });
  }

  // y = x . W^T with x rounded to bf16 first.
  void linear(const float* x, int64_t ldx, int64_t rows, int64_t in, MatRef w, int64_t out, float* y,
              int64_t ldy) override {
    const uint16_t* wp = mat(w);
    uint16_t* xb = xb_.as<uint16_t>();
    issue([=, this] {
      cuda::to_bf16(x, xb, rows * ldx, s_);
      gemm_->run(wp, out, in, xb, rows, y, ldx, ldy);
    });
  }

  // One bf16 copy of x serves every product.
  void linear_many(const float* x, int64_t ldx, int64_t rows, int64_t in,
                   std::initializer_list<Projection> jobs) override {
    struct Job {
      const uint16_t* w;
      int64_t out;
      float* y;
    };
    struct Jobs {
      Job j[3];
      int n;
    } js{};
    if (jobs.size() > 3) throw Error(Status::Internal, "GPU linear_many: more than 3 products");
    for (const auto& j : jobs) js.j[js.n++] = {mat(j.w), j.out, j.y};
    uint16_t* xb = xb_.as<uint16_t>();
    issue([=, this] {
      cuda::to_bf16(x, xb, rows * ldx, s_);
      for (int i = 0; i < js.n; ++i) gemm_->run(js.j[i].w, js.j[i].out, in, xb, rows, js.j[i].y, ldx, js.j[i].out);
    });
  }

  void linear_heads(const float* x, int64_t ldx, int64_t xhs, int64_t rows, MatRef w, int64_t heads, int64_t in,
                    int64_t out, float* y, int64_t ldy, int64_t yhs) override {
    const uint16_t* wp = mat(w);
    uint16_t* xb = xb_.as<uint16_t>();
    issue([=, this] {
      cuda::to_bf16(x, xb, rows * ldx, s_);
      gemm_->run_batched(wp, out * in, out, in, xb, xhs, rows, y, yhs, heads, ldx, ldy);  // one per head
    });
  }

  void add_bias(float* y, int64_t ldy, int64_t rows, int64_t width, int layer, Vec b) override {
    const float* v = vec(layer, b);
    issue([=, this] { cuda::add_bias(y, rows, width, ldy, v, s_); });
  }

  void clamp(float* x, int64_t count, float limit) override {
    issue([=, this] { cuda::clamp(x, count, limit, s_); });
  }

  void rope(float* x, int64_t ldx, int64_t rows, int64_t heads, int64_t head_stride, int64_t rope_dim,
            bool interleaved) override {
    const float *cs = fptr(cos_), *sn = fptr(sin_);
    const int32_t* pos = d_pos_;
    issue([=, this] { cuda::rope(x, rows, ldx, heads, head_stride, rope_dim, interleaved, cs, sn, pos, s_); });
  }

  void kv_store(int layer, const float* k, int64_t ldk, const float* v, int64_t ldv) override {
    const int64_t n = n_, KW = p_.kv_width;
    void *kc = layer_k(layer), *vc = v ? layer_v(layer) : nullptr;
    const int32_t *seq = d_seq_, *pos = d_pos_;
    const cuda::KvLayout kl = kv_layout();
    issue([=, this] {
      cuda::kv_store(k, ldk, n, KW, kc, kl, seq, pos, s_);
      if (v) cuda::kv_store(v, ldv, n, KW, vc, kl, seq, pos, s_);
    });
  }

  void attention(int layer, const AttentionOp& op) override {
    cuda::AttentionArgs a;
    a.q = op.q, a.ldq = op.ldq, a.q_head_stride = op.q_head_stride;
    a.k = layer_k(layer), a.v = op.latent ? layer_k(layer) : layer_v(layer);
    a.kv_dtype = kv_code_;
    a.k_stride = p_.kv_width, a.v_stride = p_.kv_width, a.max_ctx = o_.max_ctx;
    a.blocks = d_blocks_, a.blocks_per_seq = o_.kv_pool->blocks_per_slot(), a.block_tokens = o_.kv_pool->block_tokens();
    a.k_head_offset = op.latent ? 0 : op.dk, a.v_head_offset = op.latent ? 0 : op.dv;
    a.heads = op.heads, a.group = op.group, a.dk = op.dk, a.dv = op.dv;
    a.seqs = d_seq_, a.pos = d_pos_, a.rows = n_, a.window = op.window, a.scale = op.scale;
    a.sinks = op.sinks ? vec(layer, Vec::Sinks) : nullptr;
    a.out = op.out, a.ldo = op.ldo, a.o_head_stride = op.o_head_stride;
    issue([=, this] { cuda::attention(a, s_); });
  }

  void copy_rows(const float* src, int64_t lds, float* dst, int64_t ldd, int64_t rows, int64_t width) override {
    issue([=, this] { cuda::copy_rows(src, lds, dst, ldd, rows, width, s_); });
  }

  void add(float* y, const float* x, int64_t count) override {
    issue([=, this] { cuda::add(y, x, count, s_); });
  }

  void ffn(int layer, bool shared, const float* x, int64_t rows, float* y) override {
    const DevLayer& w = layers_[static_cast<size_t>(layer)];
    cuda::FfnRunner* runner = shared ? shared_ffn_.get() : dense_ffn_.get();
    const cuda::DeviceFfn view = shared ? w.shared.view : w.dense.view;
    issue([=] { runner->run(view, x, rows, y); });
  }

  void sigmoid_gate(const float* x, int layer, float* y, int64_t rows) override {
    const float* g = vec(layer, Vec::SharedGate);
    const int64_t H = p_.hidden;
    issue([=, this] { cuda::sigmoid_gate(x, g, y, rows, H, s_); });
  }

  // The router, its choices (and with host MoE the rows) to the host.
  void route(int layer, const float* xn, int64_t rows) override {
    const DevLayer& w = layers_[static_cast<size_t>(layer)];
    const int64_t H = p_.hidden, E = p_.experts, K = p_.top_k;
    cuda::RouteArgs ra;
    ra.logits = rlogits_.as<float>(), ra.score_bias = fptr(w.score_bias);
    ra.rows = rows, ra.num_experts = E, ra.k = K;
    ra.scoring = scoring_, ra.groups = groups_;
    ra.n_group = p_.route.n_group, ra.topk_group = p_.route.topk_group;
    ra.norm_topk_prob = p_.route.norm_topk_prob, ra.routed_scaling_factor = p_.route.routed_scaling_factor;
    ra.experts = experts_.as<int32_t>(), ra.weights = weights_.as<float>();
    const float *router = fptr(w.router), *rbias = fptr(w.router_bias);
    float* rl = rlogits_.as<float>();
    void *hx = o_.device_moe ? nullptr : h_xn_.get(), *he = h_experts_.get(), *hw = h_weights_.get();
    const void *de = experts_.get(), *dw = weights_.get();
    const bool record = !graphs_on_;
    cuda::Event* ready = routed_ready_.get();
    issue([=, this] {
      gemm_->run_f32(router, E, H, xn, rows, rl);
      if (rbias) cuda::add_bias(rl, rows, E, E, rbias, s_);
      cuda::route(ra, s_);
      if (hx) cuda::copy_async(hx, xn, static_cast<size_t>(rows * H) * 4, cuda::Copy::DeviceToHost, s_);
      cuda::copy_async(he, de, static_cast<size_t>(rows * K) * 4, cuda::Copy::DeviceToHost, s_);
      cuda::copy_async(hw, dw, static_cast<size_t>(rows * K) * 4, cuda::Copy::DeviceToHost, s_);
      // NOTE: in a graph the host can wait for the whole stretch only (an event
      // recorded in a capture is internal to it): there the shared expert does
      // not overlap with the host's part.
      if (record) ready->record(s_);
    });
  }

  MoeIo moe_inputs(int, int64_t) override {
    flush();
    // NOTE: this wait also orders the previous layer's upload from h_moe_ before
    // the hook overwrites it (same stream, queued earlier).
    if (graphs_on_)
      stream_->synchronize();
    else
      routed_ready_->synchronize();
    o_.clock->lap(Stage::Router);
    MoeIo io;
    io.experts = reinterpret_cast<int32_t*>(h_experts_.data());
    io.weights = reinterpret_cast<float*>(h_weights_.data());
    if (o_.device_moe) {
      io.xn = act(Act::Xn), io.out = act(Act::Moe), io.stream = s_;
    } else {
      io.xn = reinterpret_cast<float*>(h_xn_.data()), io.out = reinterpret_cast<float*>(h_moe_.data());
    }
    return io;
  }

  void moe_output(int64_t rows) override {
    cuda::set_device(o_.device);  // the hook may have computed experts on another GPU
    start_stretch();
    if (o_.device_moe) return;
    float* out = act(Act::Moe);
    const void* src = h_moe_.get();
    const size_t bytes = static_cast<size_t>(rows * p_.hidden) * 4;
    issue([=, this] { cuda::copy_async(out, src, bytes, cuda::Copy::HostToDevice, s_); });
  }

  int64_t gather_wanted(const float* x, int64_t ldx, float* dst) override {
    const int64_t m = m_, H = p_.hidden;
    const int32_t* want = d_want_;
    if (m > 0) issue([=, this] { cuda::permute_rows(x, ldx, want, m, 1, H, dst, s_); });
    return m;
  }

  void lm_head(const float* x, int64_t m, float* logits) override {
    if (m > 0)
      linear(x, p_.hidden, m, p_.hidden, {-1, Mat::LmHead}, p_.vocab, logits_.as<float>(), p_.vocab);
    flush();
    // NOTE: into pageable memory: outside any graph.
    if (m > 0)
      cuda::copy_async(logits, logits_.get(), static_cast<size_t>(m * p_.vocab) * 4, cuda::Copy::DeviceToHost, s_);
    stream_->synchronize();
    o_.clock->lap(Stage::LmHead);
  }

  // A stage ends: with sync_stages the GPU's work so far is charged to it;
  // without, the time is charged where the host next waits for the GPU.
  void lap(Stage s) override {
    if (!o_.sync_stages) return;
    stream_->synchronize();
    o_.clock->lap(s);
  }

 private:
  DeviceBuffer& buf(Act a) { return acts_[static_cast<size_t>(a)]; }

  static Error unsupported_quant(const TensorView& t) {
    return Error(Status::Unsupported, "'" + t.name +
                                          "' is quantised; the GPU coordinator takes f32, f16 or bf16 dense weights "
                                          "(run the coordinator with --coordinator-device cpu)");
  }

  DeviceBuffer upload_raw(const void* p, size_t bytes) {
    DeviceBuffer b(bytes);
    b.upload(p, bytes);
    return b;
  }
  DeviceBuffer upload_f32(const std::vector<float>& v) {
    return v.empty() ? DeviceBuffer() : upload_raw(v.data(), v.size() * sizeof(float));
  }
  DevMatrix matrix(const TensorView* t) {
    DevMatrix m;
    if (!t) return m;
    if (t->quant != QuantType::None) throw unsupported_quant(*t);
    if (t->shape.size() < 2) throw Error(Status::Format, "'" + t->name + "' is not a matrix");
    m.in = t->shape.back();
    m.out = t->numel() / m.in;
    std::vector<uint16_t> h(static_cast<size_t>(t->numel()));
    convert_elements(t->data, t->dtype, h.data(), DType::BF16, h.size());
    m.buf = upload_raw(h.data(), h.size() * 2);
    return m;
  }
  DevFfn ffn_upload(const FfnWeights& f, int64_t inter) {
    DevFfn d;
    if (!f.gate) return d;
    if (f.quant != QuantType::None)
      throw Error(Status::Unsupported, "a quantised dense FFN; the GPU coordinator takes f32, f16 or bf16 weights");
    const FfnShape spec = FfnShape::silu(p_.hidden, inter);
    const auto layout = cuda::PackedFfnLayout::of(spec, false);
    std::vector<char> h(layout.bytes);
    cuda::pack_ffn(f, spec, layout, h.data());
    d.buf = upload_raw(h.data(), h.size());
    d.view = cuda::DeviceFfn::at(d.buf.get(), layout);
    return d;
  }

  void upload_layer(const LayerWeights& w, DevLayer& d) {
    d.attn_norm = upload_f32(w.attn_norm);
    d.ffn_norm = upload_f32(w.ffn_norm);
    d.bq = upload_f32(w.bq), d.bk = upload_f32(w.bk), d.bv = upload_f32(w.bv), d.bo = upload_f32(w.bo);
    d.q_norm = upload_f32(w.q_norm), d.k_norm = upload_f32(w.k_norm), d.sinks = upload_f32(w.sinks);
    d.q_a_norm = upload_f32(w.q_a_norm), d.kv_a_norm = upload_f32(w.kv_a_norm);
    d.wq = matrix(w.wq), d.wk = matrix(w.wk), d.wv = matrix(w.wv), d.wo = matrix(w.wo);
    d.wq_a = matrix(w.wq_a), d.wq_b = matrix(w.wq_b), d.wkv_a = matrix(w.wkv_a);
    d.wk_b = matrix(w.wk_b), d.wv_b = matrix(w.wv_b);
    if (w.router) {
      if (w.router->quant != QuantType::None) throw unsupported_quant(*w.router);
      std::vector<float> r(static_cast<size_t>(w.router->numel()));
      convert_elements(w.router->data, w.router->dtype, r.data(), DType::F32, r.size());
      d.router = upload_f32(r);
    }
    d.router_bias = upload_f32(w.router_bias), d.score_bias = upload_f32(w.score_bias);
    d.shared_gate = upload_f32(w.shared_gate);
    d.dense = ffn_upload(w.dense, p_.dense_inter);
    d.shared = ffn_upload(w.shared, p_.shared_inter);
  }

  const float* vec(int layer, Vec v) const {
    if (v == Vec::FinalNorm) return fptr(final_norm_);
    const DevLayer& w = layers_[static_cast<size_t>(layer)];
    switch (v) {
      case Vec::AttnNorm: return fptr(w.attn_norm);
      case Vec::FfnNorm: return fptr(w.ffn_norm);
      case Vec::BiasQ: return fptr(w.bq);
      case Vec::BiasK: return fptr(w.bk);
      case Vec::BiasV: return fptr(w.bv);
      case Vec::BiasO: return fptr(w.bo);
      case Vec::QNorm: return fptr(w.q_norm);
      case Vec::KNorm: return fptr(w.k_norm);
      case Vec::Sinks: return fptr(w.sinks);
      case Vec::QaNorm: return fptr(w.q_a_norm);
      case Vec::KvaNorm: return fptr(w.kv_a_norm);
      case Vec::SharedGate: return fptr(w.shared_gate);
      case Vec::RouterBias: return fptr(w.router_bias);
      case Vec::FinalNorm: break;
    }
    return nullptr;
  }

  const uint16_t* mat(MatRef r) const {
    if (r.m == Mat::LmHead) return head_shared_ ? embd_.as<const uint16_t>() : head_.p();
    const DevLayer& w = layers_[static_cast<size_t>(r.layer)];
    switch (r.m) {
      case Mat::Q: return w.wq.p();
      case Mat::K: return w.wk.p();
      case Mat::V: return w.wv.p();
      case Mat::O: return w.wo.p();
      case Mat::Qa: return w.wq_a.p();
      case Mat::Qb: return w.wq_b.p();
      case Mat::Kva: return w.wkv_a.p();
      case Mat::Kb: return w.wk_b.p();
      case Mat::Vb: return w.wv_b.p();
      case Mat::LmHead: break;
    }
    return nullptr;
  }

  void* layer_k(int l) const { return kcache_.as<uint8_t>() + static_cast<size_t>(l * kv_rows_ * p_.kv_width * kv_es_); }
  void* layer_v(int l) const { return vcache_.as<uint8_t>() + static_cast<size_t>(l * kv_rows_ * p_.v_width * kv_es_); }
  cuda::KvLayout kv_layout() const {
    return {o_.max_ctx, d_blocks_, o_.kv_pool->blocks_per_slot(), o_.kv_pool->block_tokens(), kv_code_};
  }

  // A stretch between host waits begins: with graphs on, is its graph for
  // passes of this many rows captured already (then nothing is queued)?
  void start_stretch() {
    replaying_ = graphs_on_ && graphs_.count({n_, segment_}) > 0;
  }

  // Queues GPU work: at once; with graphs on, kept for flush(); when the
  // stretch's graph exists, not at all.
  template <class F>
  void issue(const F& f) {
    if (!graphs_on_) {
      f();
    } else if (!replaying_) {
      pending_.emplace_back(f);
    }
  }

  // With graphs on: the stretch since the last flush, as the graph of this
  // stretch for passes of this many rows (captured the first time). A capture
  // that fails turns graphs off (with a warning) and runs the work directly.
  void flush() {
    if (!graphs_on_) return;
    const std::pair<int64_t, int> key{n_, segment_++};
    if (!replaying_ && pending_.empty()) return;  // nothing queued: no graph
    if (!replaying_) {
      try {
        cuda::StreamGraph g = cuda::StreamGraph::capture(s_, [&] {
          for (const QueuedOp& op : pending_) op();
        });
        graphs_.emplace(key, std::move(g));
      } catch (const Error& e) {
        spdlog::warn("rank {}: CUDA graphs off ({}); the dense part launches its kernels one by one", o_.rank, e.what());
        use_graphs_ = graphs_on_ = false;
        graphs_.clear();
        for (const QueuedOp& op : pending_) op();
        pending_.clear();
        return;
      }
      pending_.clear();
    }
    graphs_.find(key)->second.launch(s_);
    replaying_ = false;
  }

  std::shared_ptr<const ColibriFile> file_;
  const ModelConfig& c_;
  const ModelPlan& p_;
  BackendOptions o_;
  std::unique_ptr<cuda::Stream> stream_;
  void* s_ = nullptr;  // stream_->get()
  std::unique_ptr<cuda::Event> routed_ready_;  // the MoE layer's rows and choices are on the host
  bool latent_ = false, head_shared_ = false;
  uint64_t kv_bytes_ = 0, act_bytes_ = 0;
  int64_t kv_rows_ = 0, table_ints_ = 0;  // the cache's rows per layer (blocks x block size); the tables' ints
  int64_t kv_es_ = 4;  // bytes per cached value
  int kv_code_ = 0;    // cuda::KvLayout::dtype of the cache: 0 f32, 1 f16, 2 bf16
  const int32_t* d_blocks_ = nullptr;     // the block tables on the device (tables_)
  uint64_t tables_version_ = ~uint64_t{0};  // the pool's version tables_ holds
  cuda::RouteScoring scoring_ = cuda::RouteScoring::Softmax;
  cuda::RouteGroups groups_ = cuda::RouteGroups::None;
  int embd_dtype_ = 0;
  DeviceBuffer embd_, final_norm_, cos_, sin_;
  DevMatrix head_;
  std::vector<DevLayer> layers_;
  DeviceBuffer kcache_, vcache_, tables_;
  DeviceBuffer acts_[static_cast<size_t>(Act::Count)];
  DeviceBuffer logits_, rlogits_, weights_, experts_, xb_, ints_;
  PinnedBuffer h_ints_, h_xn_, h_moe_, h_experts_, h_weights_, h_tables_;
  std::unique_ptr<cuda::Gemm> gemm_;
  std::unique_ptr<cuda::FfnRunner> dense_ffn_, shared_ffn_;
  // The pass: rows, rows wanting logits, the device copies of its row data.
  int64_t n_ = 0, m_ = 0;
  const int32_t *d_seq_ = nullptr, *d_pos_ = nullptr, *d_want_ = nullptr;
  // CUDA graphs: on unless COLIBRI_CUDA_GRAPHS=0; this pass uses them; this
  // stretch replays its graph; its index; the stretch's queued work; the
  // graphs by (rows, stretch).
  bool use_graphs_ = true, graphs_on_ = false, replaying_ = false;
  int segment_ = 0;
  std::vector<QueuedOp> pending_;
  std::map<std::pair<int64_t, int>, cuda::StreamGraph> graphs_;
};

}  // namespace
#endif

std::unique_ptr<DenseBackend> make_cuda_backend(std::shared_ptr<const ColibriFile> file, const ModelPlan& plan,
                                                const std::vector<LayerWeights>& layers, const BackendOptions& o) {
  require_gpu(o.device, o.rank);
#ifdef COLIBRI_HAVE_CUDA
  return std::make_unique<CudaBackend>(std::move(file), plan, layers, o);
#else
  (void)file, (void)plan, (void)layers;
  return nullptr;
#endif
}

}  // namespace colibri
