// router.cpp: top-k routing for every family: softmax / sigmoid / top-k-then-
// softmax scoring, optional group-limited selection, renormalisation, scaling.
#include "coordinator/router.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "model/error.h"

namespace colibri {

RouteScoring route_scoring(const RoutingConfig& cfg) {
  if (cfg.scoring == "softmax") return RouteScoring::Softmax;
  if (cfg.scoring == "sigmoid") return RouteScoring::Sigmoid;
  if (cfg.scoring == "topk_softmax") return RouteScoring::TopkSoftmax;
  throw Error(Status::Unsupported, "routing scoring '" + cfg.scoring + "'");
}

RouteGroups route_groups(const RoutingConfig& cfg) {
  if (cfg.group_select == "none") return RouteGroups::None;
  if (cfg.group_select == "max") return RouteGroups::Max;
  if (cfg.group_select == "top2_sum") return RouteGroups::Top2Sum;
  throw Error(Status::Unsupported, "routing group_select '" + cfg.group_select + "'");
}

RoutePlan RoutePlan::of(const RoutingConfig& cfg) {
  RoutePlan p;
  p.scoring = route_scoring(cfg);
  p.groups = route_groups(cfg);
  p.n_group = cfg.n_group;
  p.topk_group = cfg.topk_group;
  p.norm_topk_prob = cfg.norm_topk_prob;
  p.routed_scaling_factor = cfg.routed_scaling_factor;
  return p;
}

void route(const RoutePlan& cfg, const float* logits, int64_t rows, int64_t num_experts, int64_t k,
           const float* score_bias, int32_t* experts, float* weights) {
  using Scoring = RouteScoring;
  using Groups = RouteGroups;
  const Scoring sc = cfg.scoring;
  const Groups gs = cfg.groups;
  const int64_t E = num_experts, G = gs == Groups::None ? 1 : cfg.n_group, per = E / G;
  if (k < 1 || k > E || G < 1 || E % G != 0 || cfg.topk_group < 1 || cfg.topk_group > G)
    throw Error(Status::InvalidArgument, "route: bad sizes");
  // NOTE: thread-local scratch: no allocation per call after the first.
  thread_local std::vector<float> p, choice, gscore;
  thread_local std::vector<uint8_t> allowed, taken, gkeep;
  p.resize(static_cast<size_t>(E));
  choice.resize(static_cast<size_t>(E));
  allowed.resize(static_cast<size_t>(E));
  taken.resize(static_cast<size_t>(E));
  gscore.resize(static_cast<size_t>(G));
  for (int64_t r = 0; r < rows; ++r) {
    const float* l = logits + r * E;
    switch (sc) {
      case Scoring::Softmax: {
        float mx = l[0];
        for (int64_t e = 1; e < E; ++e) mx = std::max(mx, l[e]);
        float sum = 0.f;
        for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(l[e] - mx));
        for (int64_t e = 0; e < E; ++e) p[e] /= sum;
        for (int64_t e = 0; e < E; ++e) choice[e] = p[e];
        break;
      }
      case Scoring::Sigmoid:
        for (int64_t e = 0; e < E; ++e) p[e] = 1.0f / (1.0f + std::exp(-l[e]));
        for (int64_t e = 0; e < E; ++e) choice[e] = p[e];
        break;
      case Scoring::TopkSoftmax:
        for (int64_t e = 0; e < E; ++e) choice[e] = p[e] = l[e];
        break;
    }
    if (score_bias)
      for (int64_t e = 0; e < E; ++e) choice[e] += score_bias[e];
    std::fill(allowed.begin(), allowed.end(), 1);
    if (gs != Groups::None) {
      for (int64_t g = 0; g < G; ++g) {
        const float* c = choice.data() + g * per;
        if (gs == Groups::Max) {
          float m = c[0];
          for (int64_t i = 1; i < per; ++i) m = std::max(m, c[i]);
          gscore[g] = m;
        } else {
          // The sum of the group's two best (torch.topk(2).sum()).
          int64_t a = 0;
          for (int64_t i = 1; i < per; ++i)
            if (c[i] > c[a]) a = i;
          int64_t b = -1;
          for (int64_t i = 0; i < per; ++i)
            if (i != a && (b < 0 || c[i] > c[b])) b = i;
          gscore[g] = c[a] + c[b];
        }
      }
      gkeep.assign(static_cast<size_t>(G), 0);
      for (int64_t j = 0; j < cfg.topk_group; ++j) {
        int64_t best = -1;
        for (int64_t g = 0; g < G; ++g)
          if (!gkeep[g] && (best < 0 || gscore[g] > gscore[best])) best = g;
        gkeep[best] = 1;
      }
      for (int64_t e = 0; e < E; ++e) allowed[e] = gkeep[e / per];
    }
    int32_t* ex = experts + r * k;
    float* w = weights + r * k;
    std::fill(taken.begin(), taken.end(), 0);
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e)
        if (allowed[e] && !taken[e] && (best < 0 || choice[e] > choice[best])) best = e;
      if (best < 0) throw Error(Status::Internal, "route: fewer allowed experts than k");
      taken[best] = 1;
      ex[j] = static_cast<int32_t>(best);
      w[j] = p[best];
    }
    if (sc == Scoring::TopkSoftmax) {
      float mx = w[0];
      for (int64_t j = 1; j < k; ++j) mx = std::max(mx, w[j]);
      float sum = 0.f;
      for (int64_t j = 0; j < k; ++j) sum += (w[j] = std::exp(w[j] - mx));
      for (int64_t j = 0; j < k; ++j) w[j] /= sum;
    } else if (cfg.norm_topk_prob) {
      float s = 0.f;
      for (int64_t j = 0; j < k; ++j) s += w[j];
      if (sc == Scoring::Sigmoid) s += 1e-20f;  // as transformers' DeepSeek-V3 router
      for (int64_t j = 0; j < k; ++j) w[j] /= s;
    }
    if (cfg.routed_scaling_factor != 1.0f)
      for (int64_t j = 0; j < k; ++j) w[j] *= cfg.routed_scaling_factor;
  }
}

}  // namespace colibri
