// placement.h: which rank(s) own each (layer, expert). Placement decides only
// speed, never results. Also the placement file (JSON, see
// configs/placements/README.md), the policy builders of `colibri place` and the
// predicted balancedness of a placement under measured expert load.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace colibri {

struct ExpertStats;  // model/routing_trace.h

class Placement {
 public:
  // Every expert of every layer on `rank` (the one-process engine).
  static Placement single(int num_layers, int num_experts, int rank = 0);

  // A placement from explicit owner lists, owners[layer * num_experts + expert],
  // validated (see validate()). Throws Error(InvalidArgument).
  static Placement from_owners(int world_size, int num_layers, int num_experts, std::vector<std::vector<int>> owners,
                               bool coordinator_hosts_experts = false, std::string policy = "custom");

  // The placement file:
  //   {"format":"colibri-placement","version":1,"policy":P,"world_size":N,
  //    "num_layers":L,"num_experts":E,"coordinator_hosts_experts":B,
  //    "layers":[[[owners of expert 0],[owners of expert 1],...] per layer]}
  // "policy" (default "custom") and "coordinator_hosts_experts" (default false)
  // are optional; other keys (e.g. "comment") are ignored. `source` names the
  // text in messages. Throws Error(Format) for bad JSON, a missing field or a
  // wrong type, Error(InvalidArgument) for an invalid map (see validate()).
  static Placement from_json(const std::string& text, const std::string& source = "placement");
  std::string to_json() const;  // one expert list per line per layer, readable
  // load: throws Error(Io) when the file cannot be read. The second form also
  // checks the placement fits the run (check_fits).
  static Placement load(const std::string& path);
  static Placement load(const std::string& path, int world_size, int num_layers, int num_experts);
  void save(const std::string& path) const;  // writes PATH.tmp.XXXXXX, renamed to PATH; throws Error(Io)

  // Every (layer, expert) has >= 1 owner, owners in [0, world_size), no owner
  // twice in one list, and rank 0 owns nothing unless coordinator_hosts_experts
  // or world_size == 1. Throws Error(InvalidArgument) naming layer/expert/rank.
  void validate() const;
  // Throws Error(InvalidArgument) unless made for this world size and model.
  void check_fits(int world_size, int num_layers, int num_experts) const;

  int num_layers() const { return layers_; }
  int num_experts() const { return experts_; }
  int world_size() const { return world_; }
  bool coordinator_hosts_experts() const { return coordinator_hosts_experts_; }
  const std::string& policy() const { return policy_; }
  // The owning ranks of an expert (at least one; more when replicated).
  const std::vector<int>& owners(int layer, int expert) const {
    return owners_[static_cast<size_t>(layer) * experts_ + expert];
  }
  // The rank that serves (row, expert): replicas are chosen by row, so the
  // choice is deterministic and spreads rows over replicas.
  int owner_for_row(int layer, int expert, int64_t row) const {
    const auto& o = owners(layer, expert);
    return o[static_cast<size_t>(row) % o.size()];
  }
  // True when `rank` owns (layer, expert).
  bool owns(int rank, int layer, int expert) const;
  // The experts of `layer` that `rank` owns, ascending.
  std::vector<int> local_experts(int rank, int layer) const;
  // Owner entries of one layer beyond one per expert (the replicas added).
  int redundant(int layer) const;

 private:
  int layers_ = 0, experts_ = 0;
  int world_ = 1;
  bool coordinator_hosts_experts_ = true;
  std::string policy_ = "single";
  std::vector<std::vector<int>> owners_;  // [layer * experts + expert]
};

// The ranks that host experts: 1..N-1, or 0..N-1 when the coordinator hosts
// experts or N == 1.
std::vector<int> host_ranks(int world_size, bool coordinator_hosts_experts);

// Balancedness of one layer: mean / max of load[r] over the host ranks (1 = even,
// 1/hosts = all on one), as SGLang and vLLM report it; 1 when every load is 0.
template <class PerRank>
double host_balancedness(const std::vector<int>& hosts, const PerRank& load) {
  double sum = 0, mx = 0;
  for (int h : hosts) {
    const double v = static_cast<double>(load[static_cast<size_t>(h)]);
    sum += v;
    mx = v > mx ? v : mx;
  }
  return mx > 0 ? sum / static_cast<double>(hosts.size()) / mx : 1.0;
}

// The policies of `colibri place`, in the order it compares them.
const std::vector<std::string>& placement_policies();

// Builds a placement over the host ranks (H of them), the same rule for every
// layer unless stated:
// - "contiguous": experts in contiguous blocks, the first E % H hosts one more;
// - "round_robin": expert e on host e % H;
// - "balanced": per layer, greedy longest-processing-time: experts by measured
//   load descending (ties: lower expert id), each to the host with the least
//   load so far (ties: lower rank). Needs `stats`;
// - "replicated": as DeepSeek's EPLB: `redundant` extra copies per layer, each
//   given to the expert with the highest load per replica (ties: lower id);
//   then the E + R replicas, each carrying its expert's load / replicas (the
//   load splits evenly over replicas), are packed like balanced: largest first
//   (ties: lower id), each to the least-loaded host that does not hold that
//   expert yet (ties: lower rank). With R = 0 it is balanced; without stats the
//   loads are taken as equal, which packs like round_robin.
//   (Keeping the balanced map and adding copies to it measured worse than
//   balanced itself on the Mixtral traces: see docs/placement.md.)
// `redundant` must be 0 for the other policies. Throws Error(InvalidArgument)
// for an unknown policy, bad sizes, missing or mismatched stats, or more
// replicas than the host ranks can hold.
Placement make_placement(const std::string& policy, int num_layers, int num_experts, int world_size,
                         bool coordinator_hosts_experts, const ExpertStats* stats, int redundant);

// Balancedness of one layer: mean / max of the tokens each host rank serves,
// 1.0 = perfect (as SGLang and vLLM report it). An expert's load splits evenly
// over its replicas; a host rank that owns nothing counts with 0; a layer with
// no load counts as 1.0.
struct Balancedness {
  std::vector<double> per_layer;
  std::vector<std::vector<double>> rank_load;  // [layer][host index]: predicted tokens per host rank
  std::vector<int> hosts;                      // the host ranks, the columns of rank_load
  double mean = 0;                             // mean of per_layer
  double worst = 0;                            // min of per_layer
  int worst_layer = 0;
};
// Throws Error(InvalidArgument) when the stats do not match the placement's
// layers and experts.
Balancedness predicted_balancedness(const Placement& placement, const ExpertStats& stats);

}  // namespace colibri
