// simulate.h: an analytical model of one expert-parallel decode step on a
// cluster (colibri simulate): expert compute from a roofline of each rank's
// device, the dispatch/combine exchange from an alpha-beta model of the links
// (NVLink inside a node, InfiniBand between nodes), the step waiting on the most
// loaded rank. Pure functions, no I/O except ClusterSpec::load. Equations,
// assumptions and the cluster file format: docs/scaling.md.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace colibri {

class Placement;
struct ModelConfig;
struct RoutingTrace;
struct ExpertStats;

// One link class: time of a message of b bytes = latency + b / (bandwidth * efficiency).
struct LinkSpec {
  std::string name;
  double gbytes_per_s = 0;  // 10^9 bytes/s, one direction
  double latency_us = 0;    // per message (per peer and exchange)
  double efficiency = 1.0;  // achieved / nominal bandwidth (a calibration knob)
  double bytes_per_s() const { return gbytes_per_s * 1e9 * efficiency; }
  double latency_s() const { return latency_us * 1e-6; }
};

struct DeviceSpec {
  std::string name;
  double tflops = 0;              // peak dense FLOP/s of the expert dtype, 10^12
  double mem_gbytes_per_s = 0;    // peak memory read bandwidth, 10^9 bytes/s
  double flops_efficiency = 1.0;  // achieved / peak (calibration knobs)
  double mem_efficiency = 1.0;
  double flops() const { return tflops * 1e12 * flops_efficiency; }
  double mem_bytes_per_s() const { return mem_gbytes_per_s * 1e9 * mem_efficiency; }
};

// A cluster file (configs/cluster/*.json):
//   {"format":"colibri-cluster","version":1,"name":N,"nodes":n,"gpus_per_node":g,
//    "device":{"name","tflops","mem_gbytes_per_s","flops_efficiency"?,"mem_efficiency"?},
//    "intra_node":{"name","gbytes_per_s","latency_us","efficiency"?},
//    "inter_node":{"name","gbytes_per_s","latency_us","efficiency"?,"nics_per_node"}   (needed when nodes > 1)
//    "node_shared":{"cores","mem_gbytes_per_s"}?   (ranks of a node sharing its CPU cores and memory bus)
//    ...}  other keys ("comment", "sources", "calibration") are kept in the echo, not read.
// inter_node.gbytes_per_s is per NIC; a node's NICs are shared evenly by its
// devices (per-device IB bandwidth = nics_per_node * NIC / gpus_per_node).
// When a node's ranks share its cores and memory bus (CPU ranks; absent for
// GPUs, which own theirs): in the expert phase of a layer, the n ranks of a node
// computing at once each get min(1, cores / n) of their device's FLOP/s and at
// most mem_gbytes_per_s / n of memory bandwidth (so one rank alone at most the
// node's); the device efficiencies apply on top.
struct NodeShare {
  double cores = 0;             // 0: not shared
  double mem_gbytes_per_s = 0;  // 0: not shared
  bool shared() const { return cores > 0 || mem_gbytes_per_s > 0; }
  // The device one of `active` ranks computing at once gets.
  DeviceSpec share(const DeviceSpec& d, int active) const;
};

struct ClusterSpec {
  std::string name, source;
  int nodes = 1, gpus_per_node = 1;
  DeviceSpec device;
  NodeShare node_shared;
  LinkSpec intra, inter;
  int nics_per_node = 0;
  nlohmann::json raw;  // the file as read (echoed in --json)

  int world() const { return nodes * gpus_per_node; }
  int node_of(int rank) const { return rank / gpus_per_node; }
  double inter_bytes_per_s_per_device() const;
  // Throws Error(Format) naming the field for a bad file.
  static ClusterSpec from_json(const std::string& text, const std::string& source = "cluster");
  static ClusterSpec load(const std::string& path);  // Error(Io) when unreadable
};

// The roofline: max(flops / device FLOP/s, bytes / device bytes/s).
double roofline_seconds(double flops, double bytes, const DeviceSpec& d);
// True when the bytes term is the larger (memory-bound).
bool roofline_memory_bound(double flops, double bytes, const DeviceSpec& d);

// The simulation's cost model of a model: parameter, cache and FLOP counts per
// layer, from a ModelConfig or from sizes alone (--hidden ... without a model).
// (Not a shape: the engine's one FFN shape is model/ffn.h's FfnShape.)
struct ModelCost {
  std::string architecture;
  int64_t hidden = 0, intermediate = 0, num_experts = 0, top_k = 0, num_layers = 0, vocab = 0;
  std::vector<int> moe_index;            // [layer] index among MoE layers, -1 for a dense layer
  double attn_params = 0;                // per layer (projections)
  double router_params = 0;              // per MoE layer
  double shared_params = 0;              // per MoE layer (shared experts)
  double dense_mlp_params = 0;           // per dense (non-MoE) layer
  double kv_elems_per_token = 0;         // per layer: K and V (GQA) or the latent (MLA)
  double attn_flops_per_token_ctx = 0;   // per layer, per query token and context position
  int num_moe_layers() const;
  static ModelCost from_config(const ModelConfig& c);
  nlohmann::json to_json() const;
};

// One step's routing at one layer: experts[token * top_k + slot], -1 = none.
struct StepRouting {
  int top_k = 0;
  std::vector<int32_t> experts;
  int64_t tokens() const { return top_k ? static_cast<int64_t>(experts.size()) / top_k : 0; }
};

// Deterministic draw of `tokens` tokens, each choosing top_k distinct experts
// with probability proportional to `weight` (sequentially without replacement).
// Experts of weight 0 are never chosen unless fewer than top_k have weight > 0.
StepRouting sample_routing(const std::vector<double>& weight, int top_k, int64_t tokens, uint64_t seed);
// Token rows of one layer of a trace: rows (step * tokens + i) mod rows of that layer.
StepRouting routing_from_trace(const RoutingTrace& trace, int layer, int64_t step, int64_t tokens);

// Where tokens start and end: "coordinator" (Colibri's engine: rank 0 holds all
// tokens and does the dense part) or "data_parallel" (DeepEP/SGLang DP-attention:
// token i starts on rank i % world, every rank does the dense part of its tokens).
enum class TokenSource { Coordinator, DataParallel };
// "per_rank": a token goes to a rank once however many of its experts are there
// (DeepEP), combine returns one reduced row per (token, rank); "per_expert": one
// row per (token, expert) both ways (Colibri's engine today, DESIGN.md step 2).
enum class SendUnit { PerRank, PerExpert };

// The load of one layer: what each rank computes and what goes between ranks.
struct LayerTraffic {
  int world = 0;
  std::vector<int64_t> rows;           // [rank] (token, expert) pairs computed
  std::vector<int64_t> active_experts; // [rank] distinct experts with rows (their weights are read)
  std::vector<int64_t> units;          // [src * world + dst] rows sent in the dispatch (combine: reverse)
};
// Replicas: the engine's Placement::owner_for_row(layer, expert, token index).
LayerTraffic layer_traffic(const Placement& p, int layer, const StepRouting& r, TokenSource src, SendUnit unit);
// mean / max of rows over the host ranks (1 = perfect), 1 when there are no rows.
double balancedness(const LayerTraffic& t, const std::vector<int>& hosts);

// Per-rank exchange time of one direction: for each rank, the sum over peers
// with rows of (latency + rows * bytes_per_row / bandwidth), NVLink for peers of
// the same node and IB for others; a rank's NVLink and IB sums run
// concurrently (max of the two); its time is max(sending, receiving).
// `reverse` swaps src and dst (the combine).
std::vector<double> exchange_seconds(const ClusterSpec& c, const LayerTraffic& t, double bytes_per_row, bool reverse);

struct SimOptions {
  int64_t batch = 1;       // tokens per step (decode: one token per sequence)
  int64_t context = 1024;  // KV positions per sequence (attention reads them)
  int64_t steps = 4;       // steps sampled (results are averaged)
  uint64_t seed = 1;
  TokenSource source = TokenSource::DataParallel;
  SendUnit unit = SendUnit::PerRank;
  double weight_bytes = 2;           // per expert/dense weight (bf16)
  double dispatch_bytes_per_elem = 2;  // bf16; fp8 with a f32 scale per 128: 1 + 4/128
  double combine_bytes_per_elem = 2;
  double kv_bytes_per_elem = 2;
};

struct LayerResult {
  int layer = 0, moe_index = -1;
  double max_rows = 0, mean_rows = 0, balancedness = 1;  // over host ranks, mean over steps
  double dispatch_s = 0, compute_s = 0, combine_s = 0;   // of the slowest rank (max of their sum)
  bool compute_memory_bound = false;                     // of that rank
  double moe_s = 0;          // max over ranks of dispatch + compute + combine
  double moe_phased_s = 0;   // max dispatch + max compute + max combine (phases separated by barriers)
  double dense_s = 0;        // attention (+ router, shared experts or dense MLP)
  double total_s = 0;        // dense_s + moe_s
};

struct SimResult {
  std::vector<LayerResult> layers;
  double head_s = 0;   // LM head
  double step_s = 0;   // sum of layers + head
  double step_phased_s = 0;
  double tokens_per_s = 0;
  double dispatch_s = 0, compute_s = 0, combine_s = 0, dense_s = 0;  // sums over layers
  double mean_balancedness = 1, worst_balancedness = 1;
};

// Routing per (step, MoE layer). Exactly one of trace / stats may be given; none: uniform.
struct RoutingSource {
  const RoutingTrace* trace = nullptr;
  const ExpertStats* stats = nullptr;
};

// Throws Error(InvalidArgument) for batch < 1, steps < 1, a placement for
// another world or model, or a routing source for another model.
SimResult simulate(const ClusterSpec& c, const ModelCost& m, const Placement& p, const RoutingSource& routing,
                   const SimOptions& o);

// Time and bytes the model predicts for DeepEP's intranode benchmark
// (tests/test_intranode.py): world ranks of one node, `tokens` per rank, experts
// contiguous, uniform top-k. `counted_bytes` is what DeepEP divides by its time
// (bytes received by one rank, its own tokens included).
struct DeepEpCheck {
  double seconds = 0, counted_bytes = 0, nvlink_bytes = 0, counted_gbytes_per_s = 0;
};
DeepEpCheck deepep_intranode_check(const ClusterSpec& c, int64_t tokens, int64_t hidden, int num_experts, int top_k,
                                   double bytes_per_elem, uint64_t seed = 1);

}  // namespace colibri
