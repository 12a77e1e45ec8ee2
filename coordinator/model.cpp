// model.cpp: the model definition (see model.h).
#include "coordinator/model.h"

namespace colibri {

namespace {

// Grouped-query (or multi-head) attention of layer l on Xn into Tmp, the
// output projection included.
void attention_grouped(const ModelPlan& p, const LayerPlan& L, int l, DenseBackend& b, int64_t n) {
  const int64_t H = p.hidden, nh = p.heads, nkv = p.kv_heads, hd = p.head_dim, Q = p.q_width, KV = p.kv_width;
  float *xn = b.act(Act::Xn), *q = b.act(Act::Q), *k = b.act(Act::K), *v = b.act(Act::V), *att = b.act(Act::Att);
  b.linear_many(xn, H, n, H, {{{l, Mat::Q}, Q, q}, {{l, Mat::K}, KV, k}, {{l, Mat::V}, KV, v}});
  if (L.bias_q) b.add_bias(q, Q, n, Q, l, Vec::BiasQ);
  if (L.bias_k) b.add_bias(k, KV, n, KV, l, Vec::BiasK);
  if (L.bias_v) b.add_bias(v, KV, n, KV, l, Vec::BiasV);
  switch (L.qk_norm) {
    case QkNorm::None:
      break;
    case QkNorm::PerHead:
      b.rmsnorm(q, hd, l, Vec::QNorm, q, hd, n * nh, hd, p.eps);
      b.rmsnorm(k, hd, l, Vec::KNorm, k, hd, n * nkv, hd, p.eps);
      break;
    case QkNorm::Full:
      b.rmsnorm(q, Q, l, Vec::QNorm, q, Q, n, Q, p.eps);
      b.rmsnorm(k, KV, l, Vec::KNorm, k, KV, n, KV, p.eps);
      break;
  }
  if (p.clip_qkv > 0) {
    b.clamp(q, n * Q, p.clip_qkv);
    b.clamp(k, n * KV, p.clip_qkv);
    b.clamp(v, n * KV, p.clip_qkv);
  }
  b.rope(q, Q, n, nh, hd, p.rope_dim, p.rope_interleaved);
  b.rope(k, KV, n, nkv, hd, p.rope_dim, p.rope_interleaved);
  b.kv_store(l, k, KV, v, KV);
  AttentionOp a;
  a.q = q, a.ldq = Q, a.q_head_stride = hd;
  a.heads = nh, a.group = nh / nkv, a.dk = hd, a.dv = hd, a.latent = false;
  a.out = att, a.ldo = Q, a.o_head_stride = hd;
  a.window = L.window, a.scale = p.attn_scale, a.sinks = L.sinks;
  b.attention(l, a);
  b.linear(att, Q, n, Q, {l, Mat::O}, H, b.act(Act::Tmp), H);
  if (L.bias_o) b.add_bias(b.act(Act::Tmp), H, n, H, l, Vec::BiasO);
}

// Multi-head latent attention of layer l on Xn into Tmp. The cache keeps the
// normalised latent and the rotated shared key, never per-head K and V; the
// queries absorb W_uk (scores need only the latent) and the latent output
// goes through W_uv afterwards.
void attention_latent(const ModelPlan& p, const LayerPlan& L, int l, DenseBackend& b, int64_t n) {
  const int64_t H = p.hidden, nh = p.heads, hd = p.head_dim, Q = p.q_width, KW = p.kv_width;
  const int64_t R = p.kv_lora_rank, nope = p.nope_dim, rd = p.rope_dim, vd = p.v_head_dim, ATT = p.att_width;
  float *xn = b.act(Act::Xn), *q = b.act(Act::Q), *kv = b.act(Act::K);
  // Queries: q = W_q x, or W_qb rmsnorm(W_qa x). The compressed KV: [latent (R) | rotary key (rd)].
  if (L.q_lora) {
    const int64_t QR = p.q_lora_rank;
    float* qa = b.act(Act::Qa);
    b.linear_many(xn, H, n, H, {{{l, Mat::Qa}, QR, qa}, {{l, Mat::Kva}, KW, kv}});
    b.rmsnorm(qa, QR, l, Vec::QaNorm, qa, QR, n, QR, p.latent_eps);
    b.linear(qa, QR, n, QR, {l, Mat::Qb}, Q, q, Q);
  } else {
    b.linear_many(xn, H, n, H, {{{l, Mat::Q}, Q, q}, {{l, Mat::Kva}, KW, kv}});
  }
  b.rmsnorm(kv, KW, l, Vec::KvaNorm, kv, KW, n, R, p.latent_eps);
  b.rope(kv + R, KW, n, 1, rd, rd, p.rope_interleaved);
  b.rope(q + nope, Q, n, nh, hd, rd, p.rope_interleaved);
  b.kv_store(l, kv, KW, nullptr, 0);
  // Absorbed queries per head: [W_uk[h]^T q_nope[h] (R) | rotary q (rd)]
  // (attn_k_b holds W_uk[h]^T as [R, nope] per head).
  float* qcat = b.act(Act::Qcat);
  b.linear_heads(q, Q, hd, n, {l, Mat::Kb}, nh, nope, R, qcat, nh * KW, KW);
  b.copy_rows(q + nope, hd, qcat + R, KW, n * nh, rd);
  float* lat_o = b.act(Act::LatO);
  AttentionOp a;
  a.q = qcat, a.ldq = nh * KW, a.q_head_stride = KW;
  a.heads = nh, a.group = nh, a.dk = KW, a.dv = R, a.latent = true;
  a.out = lat_o, a.ldo = nh * R, a.o_head_stride = R;
  a.window = L.window, a.scale = p.attn_scale;
  b.attention(l, a);
  // Values: out[h] = W_uv[h] (sum_t p_t latent_t).
  float* att = b.act(Act::Att);
  b.linear_heads(lat_o, nh * R, R, n, {l, Mat::Vb}, nh, R, vd, att, ATT, vd);
  b.linear(att, ATT, n, ATT, {l, Mat::O}, H, b.act(Act::Tmp), H);
  if (L.bias_o) b.add_bias(b.act(Act::Tmp), H, n, H, l, Vec::BiasO);
}

// The feed-forward block of layer l on Xn into Moe: a dense MLP, or the
// router on this rank, the routed experts wherever the placement says, and
// the shared expert.
void feed_forward(const ModelPlan& p, const LayerPlan& L, int l, DenseBackend& b, ForwardHost& host, int64_t n) {
  const int64_t H = p.hidden;
  float *xn = b.act(Act::Xn), *moe = b.act(Act::Moe), *tmp = b.act(Act::Tmp);
  if (L.ffn == FeedForwardKind::Dense) {
    b.ffn(l, false, xn, n, moe);
    return;
  }
  b.route(l, xn, n);
  b.lap(Stage::Router);
  // NOTE: before the routed experts, so that a GPU computes it while the host
  // exchanges the rows.
  if (L.shared != SharedExpert::None) {
    b.ffn(l, true, xn, n, tmp);
    if (L.shared == SharedExpert::Gated) b.sigmoid_gate(xn, l, tmp, n);
    b.lap(Stage::Dense);
  }
  const MoeIo io = b.moe_inputs(l, n);
  host.routed(L.moe, n, io);
  b.moe_output(n);
  if (L.shared != SharedExpert::None) b.add(moe, tmp, n * H);
}

}  // namespace

void forward_pass(const ModelPlan& p, DenseBackend& b, ForwardHost& host, int64_t n, bool checks, float* logits) {
  const int64_t H = p.hidden;
  float *x = b.act(Act::X), *xn = b.act(Act::Xn), *tmp = b.act(Act::Tmp), *moe = b.act(Act::Moe);
  b.embed(x);
  if (checks) host.check("embedding", -1, b.host(x), H, false);
  for (int l = 0; l < p.layers; ++l) {
    const LayerPlan& L = p.layer[static_cast<size_t>(l)];
    b.rmsnorm(x, H, l, Vec::AttnNorm, xn, H, n, H, p.eps);
    b.lap(Stage::Dense);
    if (L.attention == AttentionKind::Latent)
      attention_latent(p, L, l, b, n);
    else
      attention_grouped(p, L, l, b, n);
    b.lap(Stage::Attention);
    if (checks) host.check("attention output", l, b.host(tmp), H, false);
    b.add(x, tmp, n * H);
    if (checks) host.check("residual stream after the attention", l, b.host(x), H, true);
    b.rmsnorm(x, H, l, Vec::FfnNorm, xn, H, n, H, p.eps);
    b.lap(Stage::Dense);
    feed_forward(p, L, l, b, host, n);
    if (checks)
      host.check(L.ffn == FeedForwardKind::Dense ? "dense feed-forward output" : "MoE output (routed and shared experts)",
                 l, b.host(moe), H, false);
    b.add(x, moe, n * H);
    if (checks) host.check("residual stream after the feed-forward", l, b.host(x), H, true);
    b.lap(Stage::Dense);
  }
  float* g = b.act(Act::Gathered);
  const int64_t m = b.gather_wanted(x, H, g);
  if (m > 0) b.rmsnorm(g, H, -1, Vec::FinalNorm, g, H, m, H, p.eps);
  b.lm_head(g, m, logits);
}

}  // namespace colibri
