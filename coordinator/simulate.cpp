// simulate.cpp: the analytical cluster model of colibri simulate (see simulate.h
// and docs/scaling.md for the equations and what is not modelled).
#include "coordinator/simulate.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "model/config.h"
#include "model/error.h"
#include "model/file_io.h"
#include "model/placement.h"
#include "model/routing_trace.h"

namespace colibri {

namespace {

using nlohmann::json;

[[noreturn]] void bad(const std::string& source, const std::string& field, const std::string& what) {
  throw Error(Status::Format, "cluster file '" + source + "': field '" + field + "' " + what);
}

const json& need(const json& j, const std::string& key, const std::string& path, const std::string& source) {
  if (!j.contains(key)) bad(source, path + key, "is missing");
  return j.at(key);
}

double num(const json& j, const std::string& key, const std::string& path, const std::string& source, bool required,
           double dflt, bool positive) {
  if (!j.contains(key)) {
    if (required) bad(source, path + key, "is missing");
    return dflt;
  }
  const json& v = j.at(key);
  if (!v.is_number()) bad(source, path + key, "must be a number");
  const double x = v.get<double>();
  if (!std::isfinite(x) || x < 0 || (positive && x == 0))
    bad(source, path + key, positive ? "must be > 0" : "must be >= 0");
  return x;
}

std::string str(const json& j, const std::string& key, const std::string& path, const std::string& source,
                const std::string& dflt) {
  if (!j.contains(key)) return dflt;
  if (!j.at(key).is_string()) bad(source, path + key, "must be a string");
  return j.at(key).get<std::string>();
}

LinkSpec parse_link(const json& j, const std::string& path, const std::string& source) {
  if (!j.is_object()) bad(source, path, "must be an object");
  LinkSpec l;
  l.name = str(j, "name", path + ".", source, path);
  l.gbytes_per_s = num(j, "gbytes_per_s", path + ".", source, true, 0, true);
  l.latency_us = num(j, "latency_us", path + ".", source, true, 0, false);
  l.efficiency = num(j, "efficiency", path + ".", source, false, 1.0, true);
  if (l.efficiency > 1) bad(source, path + ".efficiency", "must be in (0, 1]");
  return l;
}

// splitmix64: a portable deterministic generator (std distributions are not
// the same across standard libraries).
struct Rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
};

}  // namespace

DeviceSpec NodeShare::share(const DeviceSpec& d, int active) const {
  DeviceSpec r = d;
  const double n = static_cast<double>(std::max(active, 1));
  if (cores > 0) r.tflops *= std::min(1.0, cores / n);
  if (mem_gbytes_per_s > 0) r.mem_gbytes_per_s = std::min(r.mem_gbytes_per_s, mem_gbytes_per_s / n);
  return r;
}

double ClusterSpec::inter_bytes_per_s_per_device() const {
  return inter.bytes_per_s() * nics_per_node / std::max(gpus_per_node, 1);
}

ClusterSpec ClusterSpec::from_json(const std::string& text, const std::string& source) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw Error(Status::Format, "cluster file '" + source + "': not valid JSON: " + e.what());
  }
  if (!j.is_object()) throw Error(Status::Format, "cluster file '" + source + "': not a JSON object");
  if (!j.contains("format") || j["format"] != "colibri-cluster") bad(source, "format", "must be \"colibri-cluster\"");
  if (num(j, "version", "", source, true, 0, true) != 1) bad(source, "version", "must be 1");
  ClusterSpec c;
  c.source = source;
  c.raw = j;
  c.name = str(j, "name", "", source, source);
  const double nodes = num(j, "nodes", "", source, true, 0, true);
  const double gpn = num(j, "gpus_per_node", "", source, true, 0, true);
  if (nodes != std::floor(nodes) || nodes > 65536) bad(source, "nodes", "must be an integer in [1, 65536]");
  if (gpn != std::floor(gpn) || gpn > 1024) bad(source, "gpus_per_node", "must be an integer in [1, 1024]");
  c.nodes = static_cast<int>(nodes);
  c.gpus_per_node = static_cast<int>(gpn);
  const json& d = need(j, "device", "", source);
  if (!d.is_object()) bad(source, "device", "must be an object");
  c.device.name = str(d, "name", "device.", source, "device");
  c.device.tflops = num(d, "tflops", "device.", source, true, 0, true);
  c.device.mem_gbytes_per_s = num(d, "mem_gbytes_per_s", "device.", source, true, 0, true);
  c.device.flops_efficiency = num(d, "flops_efficiency", "device.", source, false, 1.0, true);
  c.device.mem_efficiency = num(d, "mem_efficiency", "device.", source, false, 1.0, true);
  if (c.device.flops_efficiency > 1) bad(source, "device.flops_efficiency", "must be in (0, 1]");
  if (c.device.mem_efficiency > 1) bad(source, "device.mem_efficiency", "must be in (0, 1]");
  c.intra = parse_link(need(j, "intra_node", "", source), "intra_node", source);
  if (j.contains("inter_node")) {
    c.inter = parse_link(j["inter_node"], "inter_node", source);
    const double n = num(j["inter_node"], "nics_per_node", "inter_node.", source, true, 0, true);
    if (n != std::floor(n) || n > 1024) bad(source, "inter_node.nics_per_node", "must be an integer in [1, 1024]");
    c.nics_per_node = static_cast<int>(n);
  } else if (c.nodes > 1) {
    bad(source, "inter_node", "is missing (needed when nodes > 1)");
  }
  if (j.contains("node_shared")) {
    const json& n = j["node_shared"];
    if (!n.is_object()) bad(source, "node_shared", "must be an object");
    c.node_shared.cores = num(n, "cores", "node_shared.", source, false, 0, true);
    c.node_shared.mem_gbytes_per_s = num(n, "mem_gbytes_per_s", "node_shared.", source, false, 0, true);
    if (!n.contains("cores") && !n.contains("mem_gbytes_per_s"))
      bad(source, "node_shared", "needs cores and/or mem_gbytes_per_s");
  }
  return c;
}

ClusterSpec ClusterSpec::load(const std::string& path) {
  return from_json(read_input(path, "cluster file"), path);
}

double roofline_seconds(double flops, double bytes, const DeviceSpec& d) {
  return std::max(flops / d.flops(), bytes / d.mem_bytes_per_s());
}

bool roofline_memory_bound(double flops, double bytes, const DeviceSpec& d) {
  return bytes / d.mem_bytes_per_s() > flops / d.flops();
}

int ModelCost::num_moe_layers() const {
  return static_cast<int>(std::count_if(moe_index.begin(), moe_index.end(), [](int i) { return i >= 0; }));
}

ModelCost ModelCost::from_config(const ModelConfig& c) {
  ModelCost m;
  m.architecture = c.architecture;
  m.hidden = c.hidden_size;
  m.intermediate = c.intermediate_size;
  m.num_experts = c.num_experts;
  m.top_k = c.experts_per_token;
  m.num_layers = c.num_layers;
  m.vocab = c.vocab_size;
  for (int64_t l = 0; l < c.num_layers; ++l) m.moe_index.push_back(c.moe_index(l));
  const double H = static_cast<double>(c.hidden_size), nh = static_cast<double>(c.num_heads);
  if (c.attention == "mla") {
    const double qk = static_cast<double>(c.qk_nope_head_dim + c.qk_rope_head_dim);
    const double q = c.q_lora_rank > 0 ? H * c.q_lora_rank + static_cast<double>(c.q_lora_rank) * nh * qk : H * nh * qk;
    m.attn_params = q + H * static_cast<double>(c.kv_lora_rank + c.qk_rope_head_dim) +
                    static_cast<double>(c.kv_lora_rank) * nh * static_cast<double>(c.qk_nope_head_dim + c.v_head_dim) +
                    nh * static_cast<double>(c.v_head_dim) * H;
    // The compressed cache (latent + rope key), attention in the absorbed form.
    m.kv_elems_per_token = static_cast<double>(c.kv_lora_rank + c.qk_rope_head_dim);
    m.attn_flops_per_token_ctx = 2.0 * nh * static_cast<double>(2 * c.kv_lora_rank + c.qk_rope_head_dim);
  } else {
    const double hd = static_cast<double>(c.head_dim), kvh = static_cast<double>(c.num_kv_heads);
    m.attn_params = 2.0 * H * nh * hd + 2.0 * H * kvh * hd;
    m.kv_elems_per_token = 2.0 * kvh * hd;
    m.attn_flops_per_token_ctx = 4.0 * nh * hd;
  }
  m.router_params = H * static_cast<double>(c.num_experts);
  m.shared_params = 3.0 * H * static_cast<double>(c.shared_intermediate_size);
  m.dense_mlp_params = 3.0 * H * static_cast<double>(c.dense_intermediate_size);
  return m;
}

json ModelCost::to_json() const {
  return {{"architecture", architecture},
          {"hidden", hidden},
          {"intermediate", intermediate},
          {"num_experts", num_experts},
          {"top_k", top_k},
          {"num_layers", num_layers},
          {"num_moe_layers", num_moe_layers()},
          {"vocab", vocab},
          {"attn_params_per_layer", attn_params},
          {"router_params_per_moe_layer", router_params},
          {"shared_params_per_moe_layer", shared_params},
          {"dense_mlp_params_per_dense_layer", dense_mlp_params},
          {"kv_elems_per_token_layer", kv_elems_per_token}};
}

StepRouting sample_routing(const std::vector<double>& weight, int top_k, int64_t tokens, uint64_t seed) {
  const int E = static_cast<int>(weight.size());
  if (E < 1 || top_k < 1 || top_k > E || tokens < 0)
    throw Error(Status::InvalidArgument, "sample_routing: bad sizes (" + std::to_string(E) + " experts, top-" +
                                             std::to_string(top_k) + ", " + std::to_string(tokens) + " tokens)");
  std::vector<double> w(weight);
  int positive = 0;
  for (double& x : w) {
    if (!(x > 0) || !std::isfinite(x)) x = 0;
    positive += x > 0;
  }
  // Too few experts with load: the others share a tiny weight so k distinct exist.
  if (positive < top_k) {
    double total = 0;
    for (double x : w) total += x;
    const double tiny = (total > 0 ? total : 1.0) * 1e-12;
    for (double& x : w)
      if (x == 0) x = tiny;
  }
  std::vector<double> cum(E);
  double run = 0;
  for (int e = 0; e < E; ++e) cum[e] = (run += w[e]);
  StepRouting r;
  r.top_k = top_k;
  r.experts.resize(static_cast<size_t>(tokens) * top_k);
  Rng rng{seed * 0x2545f4914f6cdd1dULL + 0x1234567ULL};
  std::vector<int32_t> chosen;
  for (int64_t t = 0; t < tokens; ++t) {
    chosen.clear();
    for (int k = 0; k < top_k; ++k) {
      int e = -1;
      // Rejection of repeats; after 64 rejections draw among the rest exactly.
      for (int tries = 0; tries < 64 && e < 0; ++tries) {
        const double u = rng.uniform() * run;
        int cand = static_cast<int>(std::upper_bound(cum.begin(), cum.end(), u) - cum.begin());
        cand = std::min(cand, E - 1);
        if (w[cand] > 0 && std::find(chosen.begin(), chosen.end(), cand) == chosen.end()) e = cand;
      }
      if (e < 0) {
        double rest = 0;
        for (int x = 0; x < E; ++x)
          if (std::find(chosen.begin(), chosen.end(), x) == chosen.end()) rest += w[x];
        double u = rng.uniform() * rest;
        for (int x = 0; x < E; ++x) {
          if (std::find(chosen.begin(), chosen.end(), x) != chosen.end() || w[x] == 0) continue;
          e = x;
          if ((u -= w[x]) < 0) break;
        }
      }
      chosen.push_back(e);
      r.experts[static_cast<size_t>(t) * top_k + k] = e;
    }
  }
  return r;
}

StepRouting routing_from_trace(const RoutingTrace& trace, int layer, int64_t step, int64_t tokens) {
  std::vector<const RoutingRecord*> rows;
  for (const auto& rec : trace.records)
    if (rec.layer == layer) rows.push_back(&rec);
  if (rows.empty())
    throw Error(Status::InvalidArgument,
                "routing trace '" + trace.source + "' has no rows for MoE layer " + std::to_string(layer));
  StepRouting r;
  r.top_k = std::max(trace.top_k, 1);
  r.experts.assign(static_cast<size_t>(tokens) * r.top_k, -1);
  const size_t n = rows.size();
  for (int64_t i = 0; i < tokens; ++i) {
    const RoutingRecord& rec = *rows[static_cast<size_t>((static_cast<uint64_t>(step) * tokens + i) % n)];
    for (size_t k = 0; k < rec.experts.size() && k < static_cast<size_t>(r.top_k); ++k)
      r.experts[static_cast<size_t>(i) * r.top_k + k] = rec.experts[k];
  }
  return r;
}

LayerTraffic layer_traffic(const Placement& p, int layer, const StepRouting& r, TokenSource src, SendUnit unit) {
  const int W = p.world_size();
  LayerTraffic t;
  t.world = W;
  t.rows.assign(W, 0);
  t.active_experts.assign(W, 0);
  t.units.assign(static_cast<size_t>(W) * W, 0);
  std::vector<uint8_t> active(static_cast<size_t>(W) * p.num_experts(), 0);
  std::vector<int> dests;
  const int64_t T = r.tokens();
  for (int64_t i = 0; i < T; ++i) {
    const int from = src == TokenSource::Coordinator ? 0 : static_cast<int>(i % W);
    dests.clear();
    for (int k = 0; k < r.top_k; ++k) {
      const int e = r.experts[static_cast<size_t>(i) * r.top_k + k];
      if (e < 0) continue;
      if (e >= p.num_experts())
        throw Error(Status::InvalidArgument, "routing names expert " + std::to_string(e) + " of layer " +
                                                 std::to_string(layer) + ", the model has " +
                                                 std::to_string(p.num_experts()));
      const int to = p.owner_for_row(layer, e, i);
      ++t.rows[to];
      uint8_t& a = active[static_cast<size_t>(to) * p.num_experts() + e];
      if (!a) a = 1, ++t.active_experts[to];
      if (unit == SendUnit::PerExpert || std::find(dests.begin(), dests.end(), to) == dests.end()) {
        dests.push_back(to);
        ++t.units[static_cast<size_t>(from) * W + to];
      }
    }
  }
  return t;
}

double balancedness(const LayerTraffic& t, const std::vector<int>& hosts) { return host_balancedness(hosts, t.rows); }

std::vector<double> exchange_seconds(const ClusterSpec& c, const LayerTraffic& t, double bytes_per_row, bool reverse) {
  const int W = t.world;
  const double nv_bw = c.intra.bytes_per_s(), ib_bw = c.inter_bytes_per_s_per_device();
  std::vector<double> send_nv(W, 0), send_ib(W, 0), recv_nv(W, 0), recv_ib(W, 0);
  for (int s = 0; s < W; ++s)
    for (int d = 0; d < W; ++d) {
      if (s == d) continue;  // a rank's rows to itself do not cross a link
      const int64_t n = t.units[static_cast<size_t>(s) * W + d];
      if (n == 0) continue;
      const int a = reverse ? d : s, b = reverse ? s : d;  // a sends to b
      const double bytes = static_cast<double>(n) * bytes_per_row;
      if (c.node_of(a) == c.node_of(b)) {
        const double x = c.intra.latency_s() + bytes / nv_bw;
        send_nv[a] += x, recv_nv[b] += x;
      } else {
        if (ib_bw <= 0) throw Error(Status::InvalidArgument, "cluster '" + c.name + "' has no inter_node link");
        const double x = c.inter.latency_s() + bytes / ib_bw;
        send_ib[a] += x, recv_ib[b] += x;
      }
    }
  std::vector<double> out(W);
  for (int r = 0; r < W; ++r) out[r] = std::max(std::max(send_nv[r], send_ib[r]), std::max(recv_nv[r], recv_ib[r]));
  return out;
}

namespace {

// Dense part of one layer on one device for `tokens` tokens.
double dense_layer_seconds(const ModelCost& m, int layer, const SimOptions& o, const DeviceSpec& d, double tokens,
                           double* params_out = nullptr) {
  double params = m.attn_params;
  if (m.moe_index[layer] >= 0)
    params += m.router_params + m.shared_params;
  else
    params += m.dense_mlp_params;
  if (params_out) *params_out = params;
  if (tokens <= 0) return 0;
  const double ctx = static_cast<double>(o.context);
  const double flops = 2.0 * params * tokens + m.attn_flops_per_token_ctx * ctx * tokens;
  const double bytes = params * o.weight_bytes + tokens * ctx * m.kv_elems_per_token * o.kv_bytes_per_elem;
  return roofline_seconds(flops, bytes, d);
}

}  // namespace

SimResult simulate(const ClusterSpec& c, const ModelCost& m, const Placement& p, const RoutingSource& routing,
                   const SimOptions& o) {
  if (o.batch < 1) throw Error(Status::InvalidArgument, "simulate: the batch must be >= 1 tokens, got " + std::to_string(o.batch));
  if (o.steps < 1) throw Error(Status::InvalidArgument, "simulate: steps must be >= 1, got " + std::to_string(o.steps));
  if (o.context < 0) throw Error(Status::InvalidArgument, "simulate: the context must be >= 0");
  const int L = m.num_moe_layers();
  if (L < 1) throw Error(Status::InvalidArgument, "simulate: the model has no MoE layer");
  p.check_fits(c.world(), L, static_cast<int>(m.num_experts));
  if (routing.trace && routing.stats) throw Error(Status::InvalidArgument, "simulate: give a trace or stats, not both");
  if (routing.trace && (routing.trace->num_layers != L || routing.trace->num_experts != m.num_experts))
    throw Error(Status::InvalidArgument, "routing trace '" + routing.trace->source + "' is for " +
                                             std::to_string(routing.trace->num_layers) + " MoE layers x " +
                                             std::to_string(routing.trace->num_experts) + " experts, the model has " +
                                             std::to_string(L) + " x " + std::to_string(m.num_experts));
  if (routing.stats && (routing.stats->num_layers != L || routing.stats->num_experts != m.num_experts ||
                        routing.stats->load.size() != static_cast<size_t>(L)))
    throw Error(Status::InvalidArgument, "expert stats '" + routing.stats->source + "' are for " +
                                             std::to_string(routing.stats->num_layers) + " MoE layers x " +
                                             std::to_string(routing.stats->num_experts) + " experts, the model has " +
                                             std::to_string(L) + " x " + std::to_string(m.num_experts));
  const int W = c.world();
  const std::vector<int> hosts = host_ranks(W, p.coordinator_hosts_experts());
  const double H = static_cast<double>(m.hidden), I = static_cast<double>(m.intermediate);
  const double expert_bytes = 3.0 * H * I * o.weight_bytes;
  const double dense_tokens = o.source == TokenSource::Coordinator
                                  ? static_cast<double>(o.batch)
                                  : std::ceil(static_cast<double>(o.batch) / W);  // the busiest DP rank

  SimResult res;
  for (int layer = 0; layer < m.num_layers; ++layer) {
    LayerResult lr;
    lr.layer = layer;
    lr.moe_index = m.moe_index[layer];
    lr.dense_s = dense_layer_seconds(m, layer, o, c.device, dense_tokens);
    if (lr.moe_index >= 0) {
      const int li = lr.moe_index;
      lr.balancedness = 0;
      for (int64_t s = 0; s < o.steps; ++s) {
        StepRouting r;
        if (routing.trace) {
          r = routing_from_trace(*routing.trace, li, s, o.batch);
        } else {
          std::vector<double> w(m.num_experts, 1.0);
          if (routing.stats)
            for (int e = 0; e < m.num_experts; ++e) w[e] = static_cast<double>(routing.stats->load[li][e]);
          r = sample_routing(w, static_cast<int>(m.top_k), o.batch,
                             o.seed + 0x9e37ULL * static_cast<uint64_t>(li) + 0x85ebca6bULL * static_cast<uint64_t>(s));
        }
        const LayerTraffic t = layer_traffic(p, li, r, o.source, o.unit);
        const auto disp = exchange_seconds(c, t, H * o.dispatch_bytes_per_elem, false);
        const auto comb = exchange_seconds(c, t, H * o.combine_bytes_per_elem, true);
        double best = -1, sum_rows = 0, max_rows = 0, max_d = 0, max_c = 0, max_x = 0;
        LayerResult slow;
        // Ranks of each node computing experts at the same time (node_shared).
        std::vector<int> busy(static_cast<size_t>(c.nodes), 0);
        for (int rk = 0; rk < W; ++rk) busy[static_cast<size_t>(c.node_of(rk))] += t.rows[rk] > 0;
        for (int rk = 0; rk < W; ++rk) {
          const double rows = static_cast<double>(t.rows[rk]);
          const double flops = 2.0 * 3.0 * H * I * rows;
          const double bytes = expert_bytes * static_cast<double>(t.active_experts[rk]);
          const DeviceSpec dev = c.node_shared.share(c.device, busy[static_cast<size_t>(c.node_of(rk))]);
          const double comp = rows > 0 ? roofline_seconds(flops, bytes, dev) : 0.0;
          const double tot = disp[rk] + comp + comb[rk];
          if (tot > best) {
            best = tot;
            slow.dispatch_s = disp[rk], slow.compute_s = comp, slow.combine_s = comb[rk];
            slow.compute_memory_bound = rows > 0 && roofline_memory_bound(flops, bytes, dev);
          }
          max_d = std::max(max_d, disp[rk]), max_c = std::max(max_c, comp), max_x = std::max(max_x, comb[rk]);
        }
        for (int h : hosts) sum_rows += static_cast<double>(t.rows[h]), max_rows = std::max(max_rows, static_cast<double>(t.rows[h]));
        const double k = 1.0 / static_cast<double>(o.steps);
        lr.max_rows += max_rows * k;
        lr.mean_rows += sum_rows / hosts.size() * k;
        lr.balancedness += balancedness(t, hosts) * k;
        lr.dispatch_s += slow.dispatch_s * k, lr.compute_s += slow.compute_s * k, lr.combine_s += slow.combine_s * k;
        lr.compute_memory_bound = lr.compute_memory_bound || slow.compute_memory_bound;
        lr.moe_s += best * k;
        lr.moe_phased_s += (max_d + max_c + max_x) * k;
      }
    }
    lr.total_s = lr.dense_s + lr.moe_s;
    res.layers.push_back(lr);
  }
  // LM head on the device(s) doing the dense part.
  const double head_params = H * static_cast<double>(m.vocab);
  res.head_s = roofline_seconds(2.0 * head_params * dense_tokens, head_params * o.weight_bytes, c.device);
  double bsum = 0;
  int nmoe = 0;
  res.worst_balancedness = 1.0;
  for (const auto& lr : res.layers) {
    res.step_s += lr.total_s;
    res.step_phased_s += lr.dense_s + lr.moe_phased_s;
    res.dense_s += lr.dense_s, res.dispatch_s += lr.dispatch_s, res.compute_s += lr.compute_s,
        res.combine_s += lr.combine_s;
    if (lr.moe_index >= 0) {
      bsum += lr.balancedness, ++nmoe;
      res.worst_balancedness = std::min(res.worst_balancedness, lr.balancedness);
    }
  }
  res.step_s += res.head_s;
  res.step_phased_s += res.head_s;
  res.mean_balancedness = nmoe ? bsum / nmoe : 1.0;
  res.tokens_per_s = res.step_s > 0 ? static_cast<double>(o.batch) / res.step_s : 0;
  return res;
}

DeepEpCheck deepep_intranode_check(const ClusterSpec& c, int64_t tokens, int64_t hidden, int num_experts, int top_k,
                                   double bytes_per_elem, uint64_t seed) {
  const int W = c.world();
  if (c.nodes != 1) throw Error(Status::InvalidArgument, "deepep_intranode_check: the cluster must be one node");
  const Placement p = make_placement("contiguous", 1, num_experts, W, true, nullptr, 0);
  // DeepEP's test: every rank has `tokens` tokens with its own uniform routing.
  // Token i of the whole batch starts on rank i % W, so give W * tokens rows.
  const StepRouting r = sample_routing(std::vector<double>(num_experts, 1.0), top_k, tokens * W, seed);
  const LayerTraffic t = layer_traffic(p, 0, r, TokenSource::DataParallel, SendUnit::PerRank);
  const double row = static_cast<double>(hidden) * bytes_per_elem;
  const auto disp = exchange_seconds(c, t, row, false);
  DeepEpCheck out;
  out.seconds = *std::max_element(disp.begin(), disp.end());
  // Rank 0's received rows, its own included (DeepEP: recv_x.numel() * elem bytes).
  double recv = 0, recv_remote = 0;
  for (int s = 0; s < W; ++s) {
    recv += static_cast<double>(t.units[static_cast<size_t>(s) * W]);
    if (s != 0) recv_remote += static_cast<double>(t.units[static_cast<size_t>(s) * W]);
  }
  out.counted_bytes = recv * row;
  out.nvlink_bytes = recv_remote * row;
  out.counted_gbytes_per_s = out.counted_bytes / out.seconds / 1e9;
  return out;
}

}  // namespace colibri
