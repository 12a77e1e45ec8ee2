// engine.cpp: the coordinator's forward pass and generation loop.
#include "coordinator/engine.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "coordinator/cluster.h"
#include "coordinator/router.h"
#include "coordinator/routing_trace.h"
#include "kernels/cpu/kernels.h"
#include "model/error.h"

namespace colibri {

struct Engine::LayerWeights {
  std::vector<float> attn_norm, ffn_norm;
  const TensorView *wq, *wk, *wv, *wo, *router;
};

namespace {

std::vector<float> to_f32_vector(const TensorView& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  kernels::to_f32(t.data, t.dtype, t.numel(), v.data());
  return v;
}

void apply_rope(float* x, int64_t heads, int64_t hd, const float* cos, const float* sin) {
  // NOTE: Hugging Face's rotate_half layout: element i pairs with i + hd/2.
  const int64_t half = hd / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * hd;
    for (int64_t i = 0; i < half; ++i) {
      float a = v[i], b = v[i + half];
      v[i] = a * cos[i] - b * sin[i];
      v[i + half] = b * cos[i] + a * sin[i];
    }
  }
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

  const int L = static_cast<int>(c.num_layers), NE = static_cast<int>(c.num_experts);
  if (opts.placement)
    placement_ = opts.placement;
  else if (comm_.size() == 1)
    placement_ = std::make_shared<const Placement>(Placement::single(L, NE));
  else
    placement_ = std::make_shared<const Placement>(make_placement("contiguous", L, NE, comm_.size(), false, nullptr, 0));
  cluster::check_placement(*placement_, c, comm_.size());
  trace_ = opts.trace;
  bool hosts = false;
  for (int l = 0; l < c.num_layers && !hosts; ++l)
    for (int e = 0; e < c.num_experts && !hosts; ++e) hosts = placement_->owns(comm_.rank(), l, e);
  if (hosts)
    worker_ = std::make_unique<Worker>(file_, *placement_, comm_.rank(), comm_.size(), rows_cap_ * c.experts_per_token,
                                       opts.store);
  dispatch_ = std::make_unique<MoeDispatcher>(c, *placement_, comm_, worker_.get(), rows_cap_);
  kv_ = std::make_unique<KVCache>(c.num_layers, max_batch_, max_ctx_, c.num_kv_heads, c.head_dim);

  embd_ = &file_->tensor(tname::token_embd());
  lm_head_ = c.tie_word_embeddings ? embd_ : &file_->tensor(tname::output());
  final_norm_ = to_f32_vector(file_->tensor(tname::output_norm()));
  layers_.resize(static_cast<size_t>(c.num_layers));
  for (int l = 0; l < c.num_layers; ++l) {
    LayerWeights& w = layers_[static_cast<size_t>(l)];
    w.attn_norm = to_f32_vector(file_->tensor(tname::layer(l, "attn_norm")));
    w.ffn_norm = to_f32_vector(file_->tensor(tname::layer(l, "ffn_norm")));
    w.wq = &file_->tensor(tname::layer(l, "attn_q"));
    w.wk = &file_->tensor(tname::layer(l, "attn_k"));
    w.wv = &file_->tensor(tname::layer(l, "attn_v"));
    w.wo = &file_->tensor(tname::layer(l, "attn_output"));
    w.router = &file_->tensor(tname::layer(l, "ffn_gate_inp"));
  }

  const int64_t R = rows_cap_, H = c.hidden_size, Q = c.num_heads * c.head_dim, KV = c.num_kv_heads * c.head_dim;
  auto sz = [](int64_t a, int64_t b) { return static_cast<size_t>(a * b); };
  try {
    x_.resize(sz(R, H));
    xn_.resize(sz(R, H));
    tmp_.resize(sz(R, H));
    moe_.resize(sz(R, H));
    gathered_.resize(sz(R, H));
    q_.resize(sz(R, Q));
    att_.resize(sz(R, Q));
    k_.resize(sz(R, KV));
    v_.resize(sz(R, KV));
    router_.resize(sz(R, c.num_experts));
    experts_.resize(sz(R, c.experts_per_token));
    weights_.resize(sz(R, c.experts_per_token));
    logits_.resize(sz(R, c.vocab_size));
  } catch (const std::bad_alloc&) {
    throw Error(Status::OutOfMemory, "activation buffers for " + std::to_string(R) + " rows do not fit in memory");
  }

  // Rotary tables, computed in f32 the way transformers does:
  // inv_freq = 1 / theta^(2i/d), angle = pos * inv_freq.
  const int64_t half = c.head_dim / 2;
  rope_cos_.resize(sz(max_ctx_, half));
  rope_sin_.resize(sz(max_ctx_, half));
  for (int64_t i = 0; i < half; ++i) {
    float ex = static_cast<float>(2 * i) / static_cast<float>(c.head_dim);
    float inv = 1.0f / std::pow(static_cast<float>(c.rope_theta), ex);
    for (int64_t p = 0; p < max_ctx_; ++p) {
      float a = static_cast<float>(p) * inv;
      rope_cos_[static_cast<size_t>(p * half + i)] = std::cos(a);
      rope_sin_[static_cast<size_t>(p * half + i)] = std::sin(a);
    }
  }
  threads_ = omp_get_max_threads();
  scores_.resize(sz(threads_, max_ctx_));
}

Engine::~Engine() = default;

void Engine::start_workers() {
  if (comm_.size() == 1 || workers_started_) return;
  cluster::Setup s;
  s.rows_cap = rows_cap_;
  s.model_checksum = file_->header().meta_checksum;
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

void Engine::attention(int layer, int64_t n, const int32_t* seqs, const int32_t* pos) {
  const ModelConfig& c = file_->config();
  const int64_t nh = c.num_heads, hd = c.head_dim, group = c.num_heads / c.num_kv_heads, Q = nh * hd;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const auto& kt = kernels::active();
  const int64_t pairs = n * nh;
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads_) if (pairs * (pos[n - 1] + 1) > 4096)
  for (int64_t ph = 0; ph < pairs; ++ph) {
    const int64_t i = ph / nh, h = ph % nh, kvh = h / group;
    const int64_t p = pos[i], s = seqs[i];
    const int64_t start = c.sliding_window > 0 ? std::max<int64_t>(0, p - c.sliding_window + 1) : 0;
    float* sc = scores_.data() + static_cast<size_t>(omp_get_thread_num()) * max_ctx_;
    const float* q = q_.data() + i * Q + h * hd;
    float mx = -INFINITY;
    for (int64_t t = start; t <= p; ++t) {
      float v = kt.dot(q, kv_->k(layer, s, t) + kvh * hd, hd) * scale;
      sc[t - start] = v;
      mx = std::max(mx, v);
    }
    float sum = 0.f;
    for (int64_t t = 0; t <= p - start; ++t) sum += (sc[t] = std::exp(sc[t] - mx));
    const float inv = 1.0f / sum;
    float* o = att_.data() + i * Q + h * hd;
    std::memset(o, 0, static_cast<size_t>(hd) * sizeof(float));
    for (int64_t t = start; t <= p; ++t) kt.axpy(o, sc[t - start] * inv, kv_->v(layer, s, t) + kvh * hd, hd);
  }
}

void Engine::forward(int64_t n, const int32_t* tokens, const int32_t* seqs, const int32_t* pos,
                     const uint8_t* want_logits) {
  const ModelConfig& c = file_->config();
  const int64_t H = c.hidden_size, Q = c.num_heads * c.head_dim, KV = c.num_kv_heads * c.head_dim;
  const int64_t hd = c.head_dim, half = hd / 2, E = c.num_experts, K = c.experts_per_token;
  const auto& kt = kernels::active();
  const float eps = static_cast<float>(c.rms_norm_eps);
  const size_t row_bytes = static_cast<size_t>(H) * dtype_size(embd_->dtype);
  if (comm_.size() > 1) {
    if (!workers_started_) start_workers();
    cluster::send_op(comm_, cluster::Op::Forward);
  }

  for (int64_t i = 0; i < n; ++i)
    kernels::to_f32(embd_->data + static_cast<size_t>(tokens[i]) * row_bytes, embd_->dtype, H, x_.data() + i * H);

  for (int l = 0; l < c.num_layers; ++l) {
    const LayerWeights& w = layers_[static_cast<size_t>(l)];
    // Attention block.
    for (int64_t i = 0; i < n; ++i) kt.rmsnorm(x_.data() + i * H, w.attn_norm.data(), xn_.data() + i * H, H, eps);
    kernels::gemm(xn_.data(), H, n, w.wq->data, w.wq->dtype, H, Q, q_.data(), Q);
    kernels::gemm(xn_.data(), H, n, w.wk->data, w.wk->dtype, H, KV, k_.data(), KV);
    kernels::gemm(xn_.data(), H, n, w.wv->data, w.wv->dtype, H, KV, v_.data(), KV);
    for (int64_t i = 0; i < n; ++i) {
      const float* cs = rope_cos_.data() + pos[i] * half;
      const float* sn = rope_sin_.data() + pos[i] * half;
      apply_rope(q_.data() + i * Q, c.num_heads, hd, cs, sn);
      apply_rope(k_.data() + i * KV, c.num_kv_heads, hd, cs, sn);
      std::memcpy(kv_->k(l, seqs[i], pos[i]), k_.data() + i * KV, static_cast<size_t>(KV) * sizeof(float));
      std::memcpy(kv_->v(l, seqs[i], pos[i]), v_.data() + i * KV, static_cast<size_t>(KV) * sizeof(float));
    }
    attention(l, n, seqs, pos);
    kernels::gemm(att_.data(), Q, n, w.wo->data, w.wo->dtype, Q, H, tmp_.data(), H);
    for (int64_t i = 0; i < n * H; ++i) x_[static_cast<size_t>(i)] += tmp_[static_cast<size_t>(i)];
    // MoE block: router on the coordinator, experts wherever the placement says.
    for (int64_t i = 0; i < n; ++i) kt.rmsnorm(x_.data() + i * H, w.ffn_norm.data(), xn_.data() + i * H, H, eps);
    kernels::gemm(xn_.data(), H, n, w.router->data, w.router->dtype, H, E, router_.data(), E);
    route(c.routing, router_.data(), n, E, K, experts_.data(), weights_.data());
    if (trace_)
      for (int64_t i = 0; i < n; ++i)
        trace_->write(step_, l, seqs[i], pos[i], experts_.data() + i * K, weights_.data() + i * K, static_cast<int>(K));
    dispatch_->forward(l, xn_.data(), n, experts_.data(), weights_.data(), moe_.data());
    for (int64_t i = 0; i < n * H; ++i) x_[static_cast<size_t>(i)] += moe_[static_cast<size_t>(i)];
  }

  ++step_;
  int64_t m = 0;
  for (int64_t i = 0; i < n; ++i)
    if (want_logits[i]) kt.rmsnorm(x_.data() + i * H, final_norm_.data(), gathered_.data() + (m++) * H, H, eps);
  if (m > 0) kernels::gemm(gathered_.data(), H, m, lm_head_->data, lm_head_->dtype, H, c.vocab_size, logits_.data(), c.vocab_size);
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
    validate_sampling(r.sampling, c.vocab_size);
  }
}

std::vector<SequenceOutput> Engine::generate(const std::vector<Request>& reqs, const GenerateOptions& opts,
                                             GenerateStats* stats) {
  validate(reqs);
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
    if (!r.ignore_eos && t == c.eos_token_id) {
      done[static_cast<size_t>(s)] = 1;
      o.finish_reason = "eos";
    } else if (static_cast<int32_t>(o.tokens.size()) >= r.max_new_tokens) {
      done[static_cast<size_t>(s)] = 1;
      o.finish_reason = "length";
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

  // Prefill in chunks that may span sequences.
  auto t0 = clock::now();
  int64_t s = 0, p = 0;
  while (s < B && !interrupted()) {
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
  }
  auto t1 = clock::now();
  st.prefill_seconds = std::chrono::duration<double>(t1 - t0).count();

  // Decode: one row per unfinished sequence.
  while (!interrupted()) {
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
    for (int64_t i = 0; i < n && !st.cancelled; ++i) {
      const float* lg = logits_.data() + i * V;
      const int64_t q = seq[static_cast<size_t>(i)];
      if (opts.record_logits) out[static_cast<size_t>(q)].logits.insert(out[static_cast<size_t>(q)].logits.end(), lg, lg + V);
      accept(q, lg);
      ++st.decode_tokens;
    }
  }
  st.decode_seconds = std::chrono::duration<double>(clock::now() - t1).count();
  if (st.cancelled)
    for (auto& o : out)
      if (o.finish_reason.empty()) o.finish_reason = st.interrupted ? "interrupted" : "cancelled";
  if (stats) *stats = st;
  return out;
}

}  // namespace colibri
