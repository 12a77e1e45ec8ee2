// gpu_dense.cpp: the coordinator's dense part on a GPU (see gpu_dense.h). The
// CPU reference is coordinator/engine.cpp's forward pass: the same order of
// operations, step by step, with kernels/cuda/dense.h's kernels.
#include "coordinator/gpu_dense.h"

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

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
  int64_t window = 0;
  int moe = -1;
  int64_t q_norm_width = 0;
};

const float* fptr(const DeviceBuffer& b) { return b.get() ? b.as<const float>() : nullptr; }

class CudaDense final : public GpuDense {
 public:
  CudaDense(std::shared_ptr<const ColibriFile> file, const std::vector<LayerWeights>& layers,
            const std::vector<float>& final_norm, const GpuDenseOptions& o)
      : file_(std::move(file)), c_(file_->config()), o_(o) {
    const std::string who = "rank " + std::to_string(o.rank) + ": ";
    // What the kernels cannot take is refused before anything is allocated.
    if (c_.num_experts > 1024 || c_.experts_per_token > 32)
      throw Error(Status::Unsupported, who + "the GPU router takes at most 1024 experts and top-32");
    mla_ = c_.attention == "mla";
    const int64_t dk = mla_ ? c_.kv_lora_rank + c_.qk_rope_head_dim : c_.head_dim;
    if (dk > 1024 || c_.rope_dim > 1024)
      throw Error(Status::Unsupported, who + "the GPU attention takes head sizes up to 1024, this model has " +
                                           std::to_string(dk));
    set_routing();
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
      any_dense_ = any_dense_ || w.moe < 0;
    }
    cuda::set_device(o.device);
    stream_ = std::make_unique<cuda::Stream>();
    s_ = stream_->get();
    routed_ready_ = std::make_unique<cuda::Event>();
    if (const char* g = std::getenv("COLIBRI_CUDA_GRAPHS"); g && std::string(g) == "0") use_graphs_ = false;
    const int64_t R = o.rows_cap, H = c_.hidden_size, nh = c_.num_heads, hd = c_.head_dim, E = c_.num_experts,
                  K = c_.experts_per_token, V = c_.vocab_size;
    Q_ = nh * hd;
    KW_ = mla_ ? c_.kv_lora_rank + c_.qk_rope_head_dim : c_.num_kv_heads * hd;
    VW_ = mla_ ? 0 : KW_;
    ATT_ = mla_ ? nh * c_.v_head_dim : Q_;
    const int64_t LQ = mla_ ? nh * c_.kv_lora_rank : 0, QCAT = mla_ ? nh * KW_ : 0;
    const int64_t QR = mla_ ? c_.q_lora_rank : 0;

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
        if (f->gate) weights += static_cast<uint64_t>(3) * 2 * (f == &w.dense ? c_.dense_intermediate_size : c_.shared_intermediate_size) * H;
    }
    kv_bytes_ = static_cast<uint64_t>(c_.num_layers) * o.max_batch * o.max_ctx * (KW_ + VW_) * 4;
    const int64_t XB = std::max({H, Q_, ATT_, QR, LQ});
    act_bytes_ = static_cast<uint64_t>(R) * 4 * (6 * H + Q_ + 2 * KW_ + ATT_ + QR + QCAT + LQ + E + 2 * K + V + 4) +
                 static_cast<uint64_t>(R) * 2 * XB;
    const int64_t inter = std::max(c_.dense_intermediate_size, c_.shared_intermediate_size);
    // Two FFN runners' scratch, three GEMM workspaces of 32 MiB, the rotary tables.
    act_bytes_ += static_cast<uint64_t>(R) * (18 * H + 10 * inter) * 2 + (uint64_t{96} << 20) +
                  static_cast<uint64_t>(o.max_ctx) * c_.rope_dim * 4;
    const size_t free_b = cuda::free_device_memory();
    const uint64_t need = (weights + kv_bytes_ + act_bytes_) / 10 * 11;
    if (need > free_b)
      throw Error(Status::OutOfMemory,
                  who + "the dense part needs " + std::to_string(need >> 20) + " MiB on GPU " + std::to_string(o.device) +
                      " (weights " + std::to_string(weights >> 20) + " MiB, KV cache " + std::to_string(kv_bytes_ >> 20) +
                      " MiB for " + std::to_string(o.max_batch) + " x " + std::to_string(o.max_ctx) +
                      " positions, activations " + std::to_string(act_bytes_ >> 20) + " MiB), " +
                      std::to_string(free_b >> 20) + " MiB are free (a smaller --max-context or --max-batch, or "
                      "--coordinator-device cpu)");
    spdlog::info("rank {}: the dense part on GPU {}: weights {} MiB, KV cache {} MiB ({} x {} positions), "
                 "activations {} MiB; {} MiB free", o.rank, o.device, weights >> 20, kv_bytes_ >> 20, o.max_batch,
                 o.max_ctx, act_bytes_ >> 20, free_b >> 20);

    // Weights.
    embd_dtype_ = static_cast<int>(embd.dtype);
    embd_ = upload_raw(embd.data, static_cast<size_t>(embd.numel()) * dtype_size(embd.dtype));
    if (c_.tie_word_embeddings && embd.dtype == DType::BF16) {
      head_shared_ = true;  // the table already is the bf16 [vocab][hidden] matrix
    } else {
      head_ = matrix(&head);
    }
    final_norm_ = upload_f32(final_norm);
    layers_.resize(layers.size());
    for (size_t l = 0; l < layers.size(); ++l) upload_layer(layers[l], layers_[l]);
    std::vector<float> cs(o.rope_cos, o.rope_cos + o.max_ctx * (c_.rope_dim / 2));
    std::vector<float> sn(o.rope_sin, o.rope_sin + o.max_ctx * (c_.rope_dim / 2));
    cos_ = upload_f32(cs);
    sin_ = upload_f32(sn);

    // KV cache and activations.
    kcache_ = DeviceBuffer(static_cast<size_t>(c_.num_layers) * o.max_batch * o.max_ctx * KW_ * 4);
    if (VW_) vcache_ = DeviceBuffer(static_cast<size_t>(c_.num_layers) * o.max_batch * o.max_ctx * VW_ * 4);
    auto f32 = [&](int64_t w) { return DeviceBuffer(static_cast<size_t>(std::max<int64_t>(R * w, 1)) * 4); };
    x_ = f32(H), xn_ = f32(H), tmp_ = f32(H), moe_ = f32(H), gathered_ = f32(H);
    q_ = f32(Q_), k_ = f32(KW_), att_ = f32(ATT_), logits_ = f32(V), rlogits_ = f32(E), weights_ = f32(K);
    if (mla_)
      qa_ = f32(QR), qcat_ = f32(QCAT), lat_o_ = f32(LQ);
    else
      v_ = f32(KW_);
    xb_ = DeviceBuffer(static_cast<size_t>(R * XB) * 2);
    experts_ = f32(K);  // int32, same size
    ints_ = DeviceBuffer(static_cast<size_t>(4 * R) * 4);  // tokens, seqs, pos, wanted rows
    h_ints_ = PinnedBuffer(static_cast<size_t>(4 * R) * 4);
    if (!o.device_moe) {
      h_xn_ = PinnedBuffer(static_cast<size_t>(R * H) * 4);
      h_moe_ = PinnedBuffer(static_cast<size_t>(R * H) * 4);
    }
    h_experts_ = PinnedBuffer(static_cast<size_t>(R * K) * 4);
    h_weights_ = PinnedBuffer(static_cast<size_t>(R * K) * 4);
    gemm_ = std::make_unique<cuda::Gemm>(s_);
    if (any_dense_)
      dense_ffn_ = std::make_unique<cuda::FfnRunner>(cuda::shape_of(FfnSpec::silu(H, c_.dense_intermediate_size)), R, s_);
    if (c_.shared_intermediate_size > 0)
      shared_ffn_ = std::make_unique<cuda::FfnRunner>(cuda::shape_of(FfnSpec::silu(H, c_.shared_intermediate_size)),
                                                      R, s_);
    // NOTE: the uploads above are synchronous copies on the legacy default
    // stream, which may return before their DMA ends: wait for it, then ours.
    cuda::synchronize(nullptr);
    stream_->synchronize();
  }

  ~CudaDense() override {
    cuda::set_device_quietly(o_.device);
    if (stream_) stream_->drain();  // nothing in flight reads what is freed below
  }

  uint64_t kv_cache_bytes() const override { return kv_bytes_; }

  void forward(int64_t n, const int32_t* tokens, const int32_t* seqs, const int32_t* pos, const uint8_t* want,
               float* logits, const MoeHook& moe) override {
    const int64_t H = c_.hidden_size, R = o_.rows_cap;
    if (n < 1 || n > R) throw Error(Status::Internal, "GPU forward: " + std::to_string(n) + " rows");
    cuda::set_device(o_.device);
    int32_t* hi = reinterpret_cast<int32_t*>(h_ints_.data());
    std::copy(tokens, tokens + n, hi);
    std::copy(seqs, seqs + n, hi + R);
    std::copy(pos, pos + n, hi + 2 * R);
    int64_t m = 0;
    for (int64_t i = 0; i < n; ++i)
      if (want[i]) hi[3 * R + m++] = static_cast<int32_t>(i);
    const int32_t* d_tok = ints_.as<const int32_t>();
    const int32_t *d_seq = d_tok + R, *d_pos = d_tok + 2 * R, *d_want = d_tok + 3 * R;
    const float eps = static_cast<float>(c_.rms_norm_eps);
    // Passes of decode size whose every row wants logits replay CUDA graphs of
    // the stretches between MoE layers (captured at their first pass of n rows).
    graphs_on_ = use_graphs_ && !o_.sync_stages && m == n && n <= o_.max_batch;
    rows_ = n;
    segment_ = 0;

    // NOTE: closures run at once, or when the stretch is flushed into a graph:
    // they capture the layer by value, what stays fixed during the pass by reference.
    issue([&] {
      // h_ints_ is read when the copy executes: the previous pass ended with the stream synchronised.
      cuda::copy_async(ints_.get(), hi, static_cast<size_t>(4 * R) * 4, cuda::Copy::HostToDevice, s_);
      cuda::embed(embd_.get(), embd_dtype_, d_tok, n, H, x(), s_);
    });
    for (int l = 0; l < c_.num_layers; ++l) {
      const DevLayer* w = &layers_[static_cast<size_t>(l)];
      issue([&, l, w] {
        cuda::rmsnorm(x(), H, fptr(w->attn_norm), xn(), H, n, H, eps, s_);
        lap(Stage::Dense);
        if (mla_)
          attention_mla(l, *w, n, d_seq, d_pos);
        else
          attention_gqa(l, *w, n, d_seq, d_pos);
        lap(Stage::Attention);
        cuda::add(x(), tmp(), n * H, s_);
        cuda::rmsnorm(x(), H, fptr(w->ffn_norm), xn(), H, n, H, eps, s_);
        lap(Stage::Dense);
      });
      if (w->moe < 0) {
        issue([&, w] {
          dense_ffn_->run(w->dense.view, xn(), n, moe_.as<float>());
          cuda::add(x(), moe_.as<float>(), n * H, s_);
          lap(Stage::Dense);
        });
        continue;
      }
      issue([&, w] { moe_begin(*w, n); });
      flush();
      moe_hook(*w, n, moe);
      issue([&, w] {
        moe_end(*w, n);
        cuda::add(x(), moe_.as<float>(), n * H, s_);
        lap(Stage::Dense);
      });
    }
    issue([&] {
      if (m == 0) return;
      cuda::permute_rows(x(), H, d_want, m, 1, H, gathered_.as<float>(), s_);
      cuda::rmsnorm(gathered_.as<float>(), H, fptr(final_norm_), gathered_.as<float>(), H, m, H, eps, s_);
      linear(gathered_.as<float>(), m, head_shared_ ? embd_.as<const uint16_t>() : head_.p(), c_.vocab_size, H,
             logits_.as<float>());
    });
    flush();
    // NOTE: into pageable memory: outside any graph.
    if (m > 0)
      cuda::copy_async(logits, logits_.get(), static_cast<size_t>(m * c_.vocab_size) * 4, cuda::Copy::DeviceToHost, s_);
    stream_->synchronize();
    o_.clock->lap(Stage::LmHead);
  }

 private:
  float* x() const { return x_.as<float>(); }
  float* xn() const { return xn_.as<float>(); }
  float* tmp() const { return tmp_.as<float>(); }
  uint16_t* xb() const { return xb_.as<uint16_t>(); }

  // A stage ends: with sync_stages the GPU's work so far is charged to it;
  // without, the time is charged where the host next waits for the GPU.
  void lap(Stage s) {
    if (!o_.sync_stages) return;
    stream_->synchronize();
    o_.clock->lap(s);
  }

  void set_routing() {
    static_assert(static_cast<int>(RouteScoring::TopkSoftmax) == static_cast<int>(cuda::RouteScoring::TopkSoftmax) &&
                  static_cast<int>(RouteGroups::Top2Sum) == static_cast<int>(cuda::RouteGroups::Top2Sum));
    scoring_ = static_cast<cuda::RouteScoring>(route_scoring(c_.routing));
    groups_ = static_cast<cuda::RouteGroups>(route_groups(c_.routing));
  }


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
  DevFfn ffn(const FfnWeights& f, int64_t inter) {
    DevFfn d;
    if (!f.gate) return d;
    if (f.quant != QuantType::None)
      throw Error(Status::Unsupported, "a quantised dense FFN; the GPU coordinator takes f32, f16 or bf16 weights");
    const FfnSpec spec = FfnSpec::silu(c_.hidden_size, inter);
    const auto layout = cuda::PackedFfnLayout::of(cuda::shape_of(spec), false);
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
    d.q_norm_width = static_cast<int64_t>(w.q_norm.size());
    d.q_a_norm = upload_f32(w.q_a_norm), d.kv_a_norm = upload_f32(w.kv_a_norm);
    d.wq = matrix(w.wq), d.wk = matrix(w.wk), d.wv = matrix(w.wv), d.wo = matrix(w.wo);
    d.wq_a = matrix(w.wq_a), d.wq_b = matrix(w.wq_b), d.wkv_a = matrix(w.wkv_a);
    d.wk_b = matrix(w.wk_b), d.wv_b = matrix(w.wv_b);
    d.window = w.window;
    d.moe = w.moe;
    if (w.router) {
      if (w.router->quant != QuantType::None) throw unsupported_quant(*w.router);
      std::vector<float> r(static_cast<size_t>(w.router->numel()));
      convert_elements(w.router->data, w.router->dtype, r.data(), DType::F32, r.size());
      d.router = upload_f32(r);
    }
    d.router_bias = upload_f32(w.router_bias), d.score_bias = upload_f32(w.score_bias);
    d.shared_gate = upload_f32(w.shared_gate);
    d.dense = ffn(w.dense, c_.dense_intermediate_size);
    d.shared = ffn(w.shared, c_.shared_intermediate_size);
  }

  // y[rows][out] = x[rows][in] (f32) . W^T, x rounded to bf16 first.
  void linear(const float* x, int64_t rows, const uint16_t* w, int64_t out, int64_t in, float* y) {
    cuda::to_bf16(x, xb(), rows * in, s_);
    gemm_->run(w, out, in, xb(), rows, y);
  }
  void linear(const float* x, int64_t rows, const DevMatrix& w, float* y) { linear(x, rows, w.p(), w.out, w.in, y); }

  float* layer_k(int l) const { return kcache_.as<float>() + static_cast<size_t>(l) * o_.max_batch * o_.max_ctx * KW_; }
  float* layer_v(int l) const { return vcache_.as<float>() + static_cast<size_t>(l) * o_.max_batch * o_.max_ctx * VW_; }

  void attention_gqa(int l, const DevLayer& w, int64_t n, const int32_t* d_seq, const int32_t* d_pos) {
    const int64_t nh = c_.num_heads, nkv = c_.num_kv_heads, hd = c_.head_dim, KV = KW_;
    const float eps = static_cast<float>(c_.rms_norm_eps);
    float *q = q_.as<float>(), *k = k_.as<float>(), *v = v_.as<float>();
    // NOTE: one bf16 copy of xn serves the three projections.
    cuda::to_bf16(xn(), xb(), n * c_.hidden_size, s_);
    gemm_->run(w.wq.p(), Q_, c_.hidden_size, xb(), n, q);
    gemm_->run(w.wk.p(), KV, c_.hidden_size, xb(), n, k);
    gemm_->run(w.wv.p(), KV, c_.hidden_size, xb(), n, v);
    if (w.bq.get()) cuda::add_bias(q, n, Q_, Q_, fptr(w.bq), s_);
    if (w.bk.get()) cuda::add_bias(k, n, KV, KV, fptr(w.bk), s_);
    if (w.bv.get()) cuda::add_bias(v, n, KV, KV, fptr(w.bv), s_);
    if (w.q_norm_width == hd) {
      cuda::rmsnorm(q, hd, fptr(w.q_norm), q, hd, n * nh, hd, eps, s_);
      cuda::rmsnorm(k, hd, fptr(w.k_norm), k, hd, n * nkv, hd, eps, s_);
    } else if (w.q_norm_width > 0) {
      cuda::rmsnorm(q, Q_, fptr(w.q_norm), q, Q_, n, Q_, eps, s_);
      cuda::rmsnorm(k, KV, fptr(w.k_norm), k, KV, n, KV, eps, s_);
    }
    if (c_.clip_qkv > 0) {
      const float cl = static_cast<float>(c_.clip_qkv);
      cuda::clamp(q, n * Q_, cl, s_);
      cuda::clamp(k, n * KV, cl, s_);
      cuda::clamp(v, n * KV, cl, s_);
    }
    cuda::rope(q, n, Q_, nh, hd, c_.rope_dim, c_.rope_interleaved, fptr(cos_), fptr(sin_), d_pos, s_);
    cuda::rope(k, n, KV, nkv, hd, c_.rope_dim, c_.rope_interleaved, fptr(cos_), fptr(sin_), d_pos, s_);
    cuda::kv_store(k, KV, n, KV, layer_k(l), o_.max_ctx, d_seq, d_pos, s_);
    cuda::kv_store(v, KV, n, KV, layer_v(l), o_.max_ctx, d_seq, d_pos, s_);
    cuda::AttentionArgs a;
    a.q = q, a.ldq = Q_, a.q_head_stride = hd;
    a.k = layer_k(l), a.v = layer_v(l), a.k_stride = KV, a.v_stride = KV, a.max_ctx = o_.max_ctx;
    a.k_head_offset = hd, a.v_head_offset = hd, a.heads = nh, a.group = nh / nkv, a.dk = hd, a.dv = hd;
    a.seqs = d_seq, a.pos = d_pos, a.rows = n, a.window = w.window, a.scale = static_cast<float>(c_.attn_scale);
    a.sinks = fptr(w.sinks), a.out = att_.as<float>(), a.ldo = Q_, a.o_head_stride = hd;
    cuda::attention(a, s_);
    linear(att_.as<float>(), n, w.wo, tmp());
    if (w.bo.get()) cuda::add_bias(tmp(), n, c_.hidden_size, c_.hidden_size, fptr(w.bo), s_);
  }

  void attention_mla(int l, const DevLayer& w, int64_t n, const int32_t* d_seq, const int32_t* d_pos) {
    const int64_t H = c_.hidden_size, nh = c_.num_heads, hd = c_.head_dim, R = c_.kv_lora_rank,
                  nope = c_.qk_nope_head_dim, rd = c_.qk_rope_head_dim, vd = c_.v_head_dim, LQ = nh * R;
    // NOTE: as the CPU engine: transformers' q_a/kv_a layernorms use eps 1e-6.
    const float eps = 1e-6f;
    float *q = q_.as<float>(), *kv = k_.as<float>();
    cuda::to_bf16(xn(), xb(), n * H, s_);
    if (w.wq_a.buf.get()) {
      const int64_t QR = c_.q_lora_rank;
      gemm_->run(w.wq_a.p(), QR, H, xb(), n, qa_.as<float>());
      gemm_->run(w.wkv_a.p(), KW_, H, xb(), n, kv);
      cuda::rmsnorm(qa_.as<float>(), QR, fptr(w.q_a_norm), qa_.as<float>(), QR, n, QR, eps, s_);
      linear(qa_.as<float>(), n, w.wq_b, q);
    } else {
      gemm_->run(w.wq.p(), Q_, H, xb(), n, q);
      gemm_->run(w.wkv_a.p(), KW_, H, xb(), n, kv);
    }
    cuda::rmsnorm(kv, KW_, fptr(w.kv_a_norm), kv, KW_, n, R, eps, s_);
    cuda::rope(kv + R, n, KW_, 1, rd, rd, c_.rope_interleaved, fptr(cos_), fptr(sin_), d_pos, s_);
    cuda::rope(q + nope, n, Q_, nh, hd, rd, c_.rope_interleaved, fptr(cos_), fptr(sin_), d_pos, s_);
    cuda::kv_store(kv, KW_, n, KW_, layer_k(l), o_.max_ctx, d_seq, d_pos, s_);
    // Absorbed queries [lat_q (R) | rotary q (rd)] per head: lat_q[h] = W_uk[h]^T q_nope[h].
    float* qcat = qcat_.as<float>();
    cuda::to_bf16(q, xb(), n * Q_, s_);
    gemm_->run_batched(w.wk_b.p(), R * nope, R, nope, xb(), hd, n, qcat, KW_, nh, Q_, nh * KW_);  // one per head
    cuda::copy_rows(q + nope, hd, qcat + R, KW_, n * nh, rd, s_);
    cuda::AttentionArgs a;
    a.q = qcat, a.ldq = nh * KW_, a.q_head_stride = KW_;
    a.k = layer_k(l), a.v = layer_k(l), a.k_stride = KW_, a.v_stride = KW_, a.max_ctx = o_.max_ctx;
    a.k_head_offset = 0, a.v_head_offset = 0, a.heads = nh, a.group = nh, a.dk = KW_, a.dv = R;
    a.seqs = d_seq, a.pos = d_pos, a.rows = n, a.window = w.window, a.scale = static_cast<float>(c_.attn_scale);
    a.out = lat_o_.as<float>(), a.ldo = LQ, a.o_head_stride = R;
    cuda::attention(a, s_);
    // Values: out[h] = W_uv[h] (sum_t p_t latent_t).
    cuda::to_bf16(lat_o_.as<float>(), xb(), n * LQ, s_);
    gemm_->run_batched(w.wv_b.p(), vd * R, vd, R, xb(), R, n, att_.as<float>(), vd, nh, LQ, ATT_);  // one per head
    linear(att_.as<float>(), n, w.wo, tmp());
    if (w.bo.get()) cuda::add_bias(tmp(), n, H, H, fptr(w.bo), s_);
  }

  // An MoE layer in three parts: on the stream, the router, its choices (and
  // with host MoE the rows) to the host, the shared expert; on the host, the
  // hook (the routed experts); on the stream again, the combined output (from
  // the host with host MoE) plus the shared expert's.
  void moe_begin(const DevLayer& w, int64_t n) {
    const int64_t H = c_.hidden_size, E = c_.num_experts, K = c_.experts_per_token;
    gemm_->run_f32(fptr(w.router), E, H, xn(), n, rlogits_.as<float>());
    if (w.router_bias.get()) cuda::add_bias(rlogits_.as<float>(), n, E, E, fptr(w.router_bias), s_);
    cuda::RouteArgs ra;
    ra.logits = rlogits_.as<float>(), ra.score_bias = fptr(w.score_bias);
    ra.rows = n, ra.num_experts = E, ra.k = K;
    ra.scoring = scoring_, ra.groups = groups_;
    ra.n_group = c_.routing.n_group, ra.topk_group = c_.routing.topk_group;
    ra.norm_topk_prob = c_.routing.norm_topk_prob, ra.routed_scaling_factor = c_.routing.routed_scaling_factor;
    ra.experts = experts_.as<int32_t>(), ra.weights = weights_.as<float>();
    cuda::route(ra, s_);
    // The router's choices to the host (the dispatch plan, replay and trace need
    // them there); with host MoE the rows too.
    if (!o_.device_moe) cuda::copy_async(h_xn_.get(), xn(), static_cast<size_t>(n * H) * 4, cuda::Copy::DeviceToHost, s_);
    cuda::copy_async(h_experts_.get(), experts_.get(), static_cast<size_t>(n * K) * 4, cuda::Copy::DeviceToHost, s_);
    cuda::copy_async(h_weights_.get(), weights_.get(), static_cast<size_t>(n * K) * 4, cuda::Copy::DeviceToHost, s_);
    // NOTE: in a graph the host can wait for the whole stretch only (an event
    // recorded in a capture is internal to it): there the shared expert does not
    // overlap with the host's part.
    if (!graphs_on_) routed_ready_->record(s_);
    if (w.shared.buf.get()) {
      shared_ffn_->run(w.shared.view, xn(), n, tmp());
      if (w.shared_gate.get()) cuda::sigmoid_gate(xn(), fptr(w.shared_gate), tmp(), n, H, s_);
    }
  }

  void moe_hook(const DevLayer& w, int64_t n, const MoeHook& moe) {
    // NOTE: this wait also orders the previous layer's upload from h_moe_ before
    // the hook overwrites it (same stream, queued earlier).
    if (graphs_on_)
      stream_->synchronize();
    else
      routed_ready_->synchronize();
    o_.clock->lap(Stage::Router);
    int32_t* ex = reinterpret_cast<int32_t*>(h_experts_.data());
    float* wt = reinterpret_cast<float*>(h_weights_.data());
    if (o_.device_moe)
      moe(w.moe, n, xn(), ex, wt, moe_.as<float>(), s_);
    else
      moe(w.moe, n, reinterpret_cast<float*>(h_xn_.data()), ex, wt, reinterpret_cast<float*>(h_moe_.data()), nullptr);
    cuda::set_device(o_.device);  // the hook may have computed experts on another GPU
  }

  void moe_end(const DevLayer& w, int64_t n) {
    const int64_t H = c_.hidden_size;
    float* out = moe_.as<float>();
    if (!o_.device_moe) cuda::copy_async(out, h_moe_.get(), static_cast<size_t>(n * H) * 4, cuda::Copy::HostToDevice, s_);
    if (w.shared.buf.get()) cuda::add(out, tmp(), n * H, s_);
  }

  // Queues GPU work: at once, or with graphs on, kept for flush().
  template <class F>
  void issue(F&& f) {
    if (graphs_on_)
      pending_.emplace_back(std::forward<F>(f));
    else
      f();
  }
  // With graphs on: the work kept since the last flush, as the graph of this
  // stretch for passes of this many rows (captured the first time). A capture
  // that fails turns graphs off (with a warning) and runs the work directly.
  void flush() {
    if (!graphs_on_ || pending_.empty()) return;
    cuda::StreamGraph& g = graphs_[{rows_, segment_++}];
    if (g.empty()) {
      try {
        g = cuda::StreamGraph::capture(s_, [&] {
          for (auto& op : pending_) op();
        });
      } catch (const Error& e) {
        spdlog::warn("rank {}: CUDA graphs off ({}); the dense part launches its kernels one by one", o_.rank, e.what());
        use_graphs_ = graphs_on_ = false;
        graphs_.clear();
        for (auto& op : pending_) op();
        pending_.clear();
        return;
      }
    }
    g.launch(s_);
    pending_.clear();
  }


  std::shared_ptr<const ColibriFile> file_;
  const ModelConfig& c_;
  GpuDenseOptions o_;
  std::unique_ptr<cuda::Stream> stream_;
  void* s_ = nullptr;  // stream_->get()
  std::unique_ptr<cuda::Event> routed_ready_;  // the MoE layer's rows and choices are on the host
  bool mla_ = false, head_shared_ = false, any_dense_ = false;
  int64_t Q_ = 0, KW_ = 0, VW_ = 0, ATT_ = 0;
  uint64_t kv_bytes_ = 0, act_bytes_ = 0;
  cuda::RouteScoring scoring_ = cuda::RouteScoring::Softmax;
  cuda::RouteGroups groups_ = cuda::RouteGroups::None;
  int embd_dtype_ = 0;
  DeviceBuffer embd_, final_norm_, cos_, sin_;
  DevMatrix head_;
  std::vector<DevLayer> layers_;
  DeviceBuffer kcache_, vcache_;
  DeviceBuffer x_, xn_, tmp_, moe_, gathered_, q_, k_, v_, att_, logits_, rlogits_, weights_, experts_, qa_, qcat_,
      lat_o_, xb_, ints_;
  PinnedBuffer h_ints_, h_xn_, h_moe_, h_experts_, h_weights_;
  std::unique_ptr<cuda::Gemm> gemm_;
  std::unique_ptr<cuda::FfnRunner> dense_ffn_, shared_ffn_;
  // CUDA graphs: on unless COLIBRI_CUDA_GRAPHS=0; this pass uses them; its rows
  // and stretch; the stretch's work not yet issued; the graphs by (rows, stretch).
  bool use_graphs_ = true, graphs_on_ = false;
  int64_t rows_ = 0;
  int segment_ = 0;
  std::vector<std::function<void()>> pending_;
  std::map<std::pair<int64_t, int>, cuda::StreamGraph> graphs_;
};

}  // namespace
#endif

std::unique_ptr<GpuDense> make_gpu_dense(std::shared_ptr<const ColibriFile> file, const std::vector<LayerWeights>& layers,
                                         const std::vector<float>& final_norm, const GpuDenseOptions& opts) {
  require_gpu(opts.device, opts.rank);
#ifdef COLIBRI_HAVE_CUDA
  return std::make_unique<CudaDense>(std::move(file), layers, final_norm, opts);
#else
  (void)file, (void)layers, (void)final_norm;
  return nullptr;
#endif
}

}  // namespace colibri
