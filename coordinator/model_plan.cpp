// model_plan.cpp: the per-layer plan and the dense weights, from a file.
#include "coordinator/model_plan.h"

#include <algorithm>
#include <string>

#include "kernels/cpu/kernels.h"
#include "model/error.h"

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

}  // namespace

ModelPlan ModelPlan::of(const ColibriFile& f) {
  const ModelConfig& c = f.config();
  ModelPlan p;
  const bool latent = c.attention == "mla";
  p.hidden = c.hidden_size, p.vocab = c.vocab_size, p.layers = c.num_layers;
  p.heads = c.num_heads, p.kv_heads = c.num_kv_heads, p.head_dim = c.head_dim;
  p.q_width = c.num_heads * c.head_dim;
  p.kv_width = latent ? c.kv_lora_rank + c.qk_rope_head_dim : c.num_kv_heads * c.head_dim;
  p.v_width = latent ? 0 : p.kv_width;
  p.att_width = latent ? c.num_heads * c.v_head_dim : p.q_width;
  p.rope_dim = c.rope_dim;
  p.rope_interleaved = c.rope_interleaved;
  if (latent) {
    p.kv_lora_rank = c.kv_lora_rank, p.q_lora_rank = c.q_lora_rank;
    p.nope_dim = c.qk_nope_head_dim, p.v_head_dim = c.v_head_dim;
  }
  p.eps = static_cast<float>(c.rms_norm_eps);
  p.attn_scale = static_cast<float>(c.attn_scale);
  p.clip_qkv = static_cast<float>(c.clip_qkv);
  p.experts = c.num_experts, p.top_k = c.experts_per_token;
  p.dense_inter = c.dense_intermediate_size, p.shared_inter = c.shared_intermediate_size;
  p.route = RoutePlan::of(c.routing);
  p.layer.resize(static_cast<size_t>(c.num_layers));
  for (int l = 0; l < c.num_layers; ++l) {
    LayerPlan& L = p.layer[static_cast<size_t>(l)];
    auto has = [&](const char* what) { return f.find(tname::layer(l, what)) != nullptr; };
    L.attention = latent ? AttentionKind::Latent : AttentionKind::Grouped;
    L.window = c.window(l);
    L.bias_o = has("attn_output_bias");
    if (latent) {
      L.q_lora = c.q_lora_rank > 0;
    } else {
      L.bias_q = has("attn_q_bias"), L.bias_k = has("attn_k_bias"), L.bias_v = has("attn_v_bias");
      L.sinks = has("attn_sinks");
      const TensorView* qn = f.find(tname::layer(l, "attn_q_norm"));
      if (qn && !has("attn_k_norm"))
        throw Error(Status::Format, f.path() + ": layer " + std::to_string(l) + " has a q norm but no k norm");
      // The norm's width tells per-head ([head_dim]) from full width (OLMoE).
      if (qn) L.qk_norm = qn->numel() == c.head_dim ? QkNorm::PerHead : QkNorm::Full;
    }
    L.moe = c.moe_index(l);
    if (L.moe < 0) {
      L.ffn = FeedForwardKind::Dense;
      p.any_dense = true;
      p.ffn_inter = std::max(p.ffn_inter, c.dense_intermediate_size);
      continue;
    }
    L.ffn = FeedForwardKind::Moe;
    L.router_bias = has("ffn_gate_inp_bias");
    L.score_bias = has("exp_probs_b");
    if (c.shared_intermediate_size > 0) {
      L.shared = has("ffn_gate_inp_shexp") ? SharedExpert::Gated : SharedExpert::Plain;
      p.ffn_inter = std::max(p.ffn_inter, c.shared_intermediate_size);
    }
  }
  return p;
}

std::vector<LayerWeights> load_layer_weights(const ColibriFile& f, const ModelPlan& p) {
  std::vector<LayerWeights> layers(static_cast<size_t>(p.layers));
  for (int l = 0; l < p.layers; ++l) {
    const LayerPlan& L = p.layer[static_cast<size_t>(l)];
    LayerWeights& w = layers[static_cast<size_t>(l)];
    auto name = [&](const char* what) { return tname::layer(l, what); };
    w.attn_norm = to_f32_vector(f.tensor(name("attn_norm")));
    w.ffn_norm = to_f32_vector(f.tensor(name("ffn_norm")));
    w.window = L.window;
    w.wo = &f.tensor(name("attn_output"));
    w.bo = optional_f32(f, name("attn_output_bias"));
    if (L.attention == AttentionKind::Latent) {
      if (L.q_lora) {
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
    w.moe = L.moe;
    if (L.ffn == FeedForwardKind::Dense) {
      w.dense = ffn_weights(f, l, "ffn_gate", "ffn_up", "ffn_down");
      continue;
    }
    w.router = &f.tensor(name("ffn_gate_inp"));
    w.router_bias = optional_f32(f, name("ffn_gate_inp_bias"));
    w.score_bias = optional_f32(f, name("exp_probs_b"));
    if (L.shared != SharedExpert::None) {
      w.shared = ffn_weights(f, l, "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp");
      w.shared_gate = optional_f32(f, name("ffn_gate_inp_shexp"));
    }
  }
  return layers;
}

}  // namespace colibri
