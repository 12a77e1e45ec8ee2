// placement.cpp: expert-to-rank maps: the placement file, its validation, the
// policy builders and predicted balancedness.
#include "model/placement.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>

#include "model/error.h"
#include "model/file_io.h"
#include "model/json_util.h"
#include "model/routing_trace.h"

namespace colibri {

using nlohmann::json;


namespace {

constexpr int64_t kMaxWorld = 1 << 20;
constexpr int64_t kMaxLayers = 1 << 16;
constexpr int64_t kMaxExperts = 1 << 16;

std::string at(int layer, int expert) { return "layer " + std::to_string(layer) + ", expert " + std::to_string(expert); }

// a < b beyond rounding: the loads of replicated experts are sums of fractions,
// and equal loads must tie (and go to the lower rank) on every machine.
bool clearly_less(double a, double b) { return a < b - 1e-9 * std::max({1.0, std::fabs(a), std::fabs(b)}); }

}  // namespace

// ---- the map ----------------------------------------------------------------

Placement Placement::single(int num_layers, int num_experts, int rank) {
  Placement p;
  p.layers_ = num_layers;
  p.experts_ = num_experts;
  p.world_ = rank + 1;
  p.coordinator_hosts_experts_ = rank == 0;
  p.policy_ = "single";
  p.owners_.assign(static_cast<size_t>(num_layers) * num_experts, std::vector<int>{rank});
  return p;
}

Placement Placement::from_owners(int world_size, int num_layers, int num_experts, std::vector<std::vector<int>> owners,
                                 bool coordinator_hosts_experts, std::string policy) {
  if (world_size < 1 || world_size > kMaxWorld || num_layers < 1 || num_layers > kMaxLayers || num_experts < 1 ||
      num_experts > kMaxExperts)
    throw Error(Status::InvalidArgument, "placement: bad sizes (world " + std::to_string(world_size) + ", " +
                                             std::to_string(num_layers) + " layers, " + std::to_string(num_experts) +
                                             " experts)");
  if (owners.size() != static_cast<size_t>(num_layers) * num_experts)
    throw Error(Status::InvalidArgument, "placement: " + std::to_string(owners.size()) + " owner lists for " +
                                             std::to_string(num_layers) + " layers x " + std::to_string(num_experts) +
                                             " experts");
  Placement p;
  p.layers_ = num_layers;
  p.experts_ = num_experts;
  p.world_ = world_size;
  p.coordinator_hosts_experts_ = coordinator_hosts_experts;
  p.policy_ = std::move(policy);
  p.owners_ = std::move(owners);
  p.validate();
  return p;
}

void Placement::validate() const {
  auto fail = [&](const std::string& m) { throw Error(Status::InvalidArgument, "placement (" + policy_ + "): " + m); };
  if (world_ < 1) fail("world_size must be >= 1");
  if (owners_.size() != static_cast<size_t>(layers_) * experts_) fail("owner table does not match its dimensions");
  const bool zero_ok = coordinator_hosts_experts_ || world_ == 1;
  for (int l = 0; l < layers_; ++l)
    for (int e = 0; e < experts_; ++e) {
      const auto& o = owners(l, e);
      if (o.empty()) fail(at(l, e) + " has no owner (every expert needs at least one rank)");
      for (size_t i = 0; i < o.size(); ++i) {
        if (o[i] < 0 || o[i] >= world_)
          fail(at(l, e) + ": rank " + std::to_string(o[i]) + " is out of range [0, " + std::to_string(world_) +
               ") (world_size " + std::to_string(world_) + ")");
        if (o[i] == 0 && !zero_ok)
          fail(at(l, e) + ": rank 0 is the coordinator and coordinator_hosts_experts is false");
        for (size_t j = 0; j < i; ++j)
          if (o[j] == o[i]) fail(at(l, e) + ": rank " + std::to_string(o[i]) + " is listed twice");
      }
    }
}

void Placement::check_fits(int world_size, int num_layers, int num_experts) const {
  if (world_ != world_size)
    throw Error(Status::InvalidArgument, "placement (" + policy_ + ") was made for " + std::to_string(world_) +
                                             " ranks, this run has " + std::to_string(world_size));
  if (layers_ != num_layers || experts_ != num_experts)
    throw Error(Status::InvalidArgument, "placement (" + policy_ + ") is for " + std::to_string(layers_) +
                                             " layers x " + std::to_string(experts_) + " experts, the model has " +
                                             std::to_string(num_layers) + " x " + std::to_string(num_experts));
}

bool Placement::owns(int rank, int layer, int expert) const {
  const auto& o = owners(layer, expert);
  return std::find(o.begin(), o.end(), rank) != o.end();
}

std::vector<int> Placement::local_experts(int rank, int layer) const {
  std::vector<int> out;
  for (int e = 0; e < experts_; ++e)
    if (owns(rank, layer, e)) out.push_back(e);
  return out;
}

int Placement::redundant(int layer) const {
  int n = 0;
  for (int e = 0; e < experts_; ++e) n += static_cast<int>(owners(layer, e).size()) - 1;
  return n;
}

// ---- the file -----------------------------------------------------------------

Placement Placement::from_json(const std::string& text, const std::string& source) {
  auto fail = [&](const std::string& m) -> void { throw Error(Status::Format, source + ": " + m); };
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw Error(Status::Format, source + ": malformed JSON: " + e.what());
  }
  if (!j.is_object()) fail("not a JSON object");
  auto f = j.find("format");
  if (f == j.end() || !f->is_string() || f->get<std::string>() != "colibri-placement")
    fail("\"format\" is not \"colibri-placement\"" + (f == j.end() ? std::string(" (missing)") : " (found " + json_show(*f) + ")"));
  auto v = j.find("version");
  if (v == j.end() || !v->is_number_integer() || v->get<int64_t>() != 1)
    fail("unsupported version " + (v == j.end() ? std::string("(missing)") : json_show(*v)) + " (this build reads 1)");
  auto dim = [&](const char* key, int64_t hi) -> int {
    auto it = j.find(key);
    if (it == j.end()) fail(std::string("missing \"") + key + "\"");
    if (!it->is_number_integer() || it->get<int64_t>() < 1 || it->get<int64_t>() > hi)
      fail(std::string("\"") + key + "\" must be an integer in [1, " + std::to_string(hi) + "], found " + json_show(*it));
    return static_cast<int>(it->get<int64_t>());
  };
  const int world = dim("world_size", kMaxWorld);
  const int L = dim("num_layers", kMaxLayers);
  const int E = dim("num_experts", kMaxExperts);
  std::string policy = "custom";
  if (auto p = j.find("policy"); p != j.end()) {
    if (!p->is_string()) fail("\"policy\" is not a string");
    policy = p->get<std::string>();
  }
  bool coord = false;
  if (auto c = j.find("coordinator_hosts_experts"); c != j.end()) {
    if (!c->is_boolean()) fail("\"coordinator_hosts_experts\" is not true or false");
    coord = c->get<bool>();
  }
  auto layers = j.find("layers");
  if (layers == j.end() || !layers->is_array()) fail("\"layers\" must be an array (one entry per layer)");
  if (layers->size() != static_cast<size_t>(L))
    fail("\"layers\" has " + std::to_string(layers->size()) + " entries, num_layers is " + std::to_string(L));
  for (int l = 0; l < L; ++l) {
    const auto& layer = (*layers)[l];
    if (!layer.is_array() || layer.size() != static_cast<size_t>(E))
      fail("layer " + std::to_string(l) + " must list the owners of " + std::to_string(E) + " experts (num_experts)" +
           (layer.is_array() ? ", found " + std::to_string(layer.size()) : ""));
  }
  std::vector<std::vector<int>> owners(static_cast<size_t>(L) * E);
  for (int l = 0; l < L; ++l) {
    const auto& layer = (*layers)[l];
    for (int e = 0; e < E; ++e) {
      const auto& o = layer[e];
      if (!o.is_array()) fail(at(l, e) + ": owners must be an array of ranks, found " + json_show(o));
      auto& dst = owners[static_cast<size_t>(l) * E + e];
      for (const auto& r : o) {
        if (!r.is_number_integer()) fail(at(l, e) + ": owner " + json_show(r) + " is not an integer rank");
        // NOTE: checked here, before narrowing to int; validate() checks the rest.
        const int64_t rv = r.is_number_unsigned() ? static_cast<int64_t>(std::min<uint64_t>(r.get<uint64_t>(), INT64_MAX))
                                                  : r.get<int64_t>();
        if (rv < 0 || rv >= world)
          throw Error(Status::InvalidArgument, source + ": " + at(l, e) + ": rank " + std::to_string(rv) +
                                                   " is out of range [0, " + std::to_string(world) + ") (world_size " +
                                                   std::to_string(world) + ")");
        dst.push_back(static_cast<int>(rv));
      }
    }
  }
  try {
    return from_owners(world, L, E, std::move(owners), coord, policy);
  } catch (const Error& e) {
    throw Error(e.status(), source + ": " + e.what());
  }
}

std::string Placement::to_json() const {
  std::ostringstream o;
  o << "{\n  \"format\": \"colibri-placement\",\n  \"version\": 1,\n  \"policy\": " << json(policy_).dump()
    << ",\n  \"world_size\": " << world_ << ",\n  \"num_layers\": " << layers_ << ",\n  \"num_experts\": " << experts_
    << ",\n  \"coordinator_hosts_experts\": " << (coordinator_hosts_experts_ ? "true" : "false")
    << ",\n  \"layers\": [\n";
  for (int l = 0; l < layers_; ++l) {
    o << "    [";
    for (int e = 0; e < experts_; ++e) {
      o << (e ? ", [" : "[");
      const auto& w = owners(l, e);
      for (size_t i = 0; i < w.size(); ++i) o << (i ? ", " : "") << w[i];
      o << "]";
    }
    o << "]" << (l + 1 < layers_ ? ",\n" : "\n");
  }
  o << "  ]\n}\n";
  return o.str();
}

Placement Placement::load(const std::string& path) {
  return from_json(read_input(path, "placement"), "placement '" + path + "'");
}

Placement Placement::load(const std::string& path, int world_size, int num_layers, int num_experts) {
  Placement p = load(path);
  try {
    p.check_fits(world_size, num_layers, num_experts);
  } catch (const Error& e) {
    throw Error(e.status(), "'" + path + "': " + e.what());
  }
  return p;
}

void Placement::save(const std::string& path) const {
  write_output(path, to_json());
}

// ---- policies -----------------------------------------------------------------

std::vector<int> host_ranks(int world_size, bool coordinator_hosts_experts) {
  std::vector<int> h;
  const int first = (coordinator_hosts_experts || world_size == 1) ? 0 : 1;
  for (int r = first; r < world_size; ++r) h.push_back(r);
  return h;
}

const std::vector<std::string>& placement_policies() {
  static const std::vector<std::string> p = {"contiguous", "round_robin", "balanced", "replicated"};
  return p;
}

Placement make_placement(const std::string& policy, int num_layers, int num_experts, int world_size,
                         bool coordinator_hosts_experts, const ExpertStats* stats, int redundant) {
  const auto& known = placement_policies();
  if (std::find(known.begin(), known.end(), policy) == known.end())
    throw Error(Status::InvalidArgument,
                "unknown placement policy '" + policy + "' (contiguous, round_robin, balanced, replicated)");
  if (num_layers < 1 || num_experts < 1 || world_size < 1 || num_layers > kMaxLayers || num_experts > kMaxExperts ||
      world_size > kMaxWorld)
    throw Error(Status::InvalidArgument, "placement: bad sizes (" + std::to_string(num_layers) + " layers, " +
                                             std::to_string(num_experts) + " experts, " + std::to_string(world_size) +
                                             " ranks)");
  if (redundant < 0) throw Error(Status::InvalidArgument, "placement: redundant copies must be >= 0");
  if (redundant > 0 && policy != "replicated")
    throw Error(Status::InvalidArgument, "placement: redundant copies apply only to the replicated policy, not '" +
                                             policy + "'");
  if (stats) {
    if (stats->num_layers != num_layers || stats->num_experts != num_experts ||
        stats->load.size() != static_cast<size_t>(num_layers))
      throw Error(Status::InvalidArgument, "expert stats '" + stats->source + "' are for " +
                                               std::to_string(stats->num_layers) + " layers x " +
                                               std::to_string(stats->num_experts) + " experts, the placement is for " +
                                               std::to_string(num_layers) + " x " + std::to_string(num_experts));
    for (const auto& row : stats->load)
      if (row.size() != static_cast<size_t>(num_experts))
        throw Error(Status::InvalidArgument, "expert stats '" + stats->source + "': a load row is not " +
                                                 std::to_string(num_experts) + " experts long");
  }
  if (policy == "balanced" && !stats)
    throw Error(Status::InvalidArgument, "the balanced policy needs expert stats (--stats STATS.json, made by colibri stats TRACE --out STATS.json)");

  const std::vector<int> hosts = host_ranks(world_size, coordinator_hosts_experts);
  const int H = static_cast<int>(hosts.size());
  const int E = num_experts;
  if (policy == "replicated" && static_cast<int64_t>(redundant) > static_cast<int64_t>(E) * (H - 1))
    throw Error(Status::InvalidArgument, "placement: " + std::to_string(redundant) + " redundant copies per layer do not fit: " +
                                             std::to_string(H) + " host ranks hold at most " +
                                             std::to_string(static_cast<int64_t>(E) * (H - 1)) + " extra copies of " +
                                             std::to_string(E) + " experts");
  std::vector<std::vector<int>> owners(static_cast<size_t>(num_layers) * E);
  auto own = [&](int l, int e) -> std::vector<int>& { return owners[static_cast<size_t>(l) * E + e]; };

  if (policy == "contiguous") {
    // Blocks of q or q + 1: host i holds experts [i * q + min(i, r), ...).
    const int q = E / H, r = E % H;
    for (int l = 0; l < num_layers; ++l)
      for (int i = 0, e = 0; i < H; ++i)
        for (int n = 0; n < q + (i < r ? 1 : 0); ++n, ++e) own(l, e).push_back(hosts[i]);
  } else if (policy == "round_robin") {
    for (int l = 0; l < num_layers; ++l)
      for (int e = 0; e < E; ++e) own(l, e).push_back(hosts[e % H]);
  } else if (policy == "balanced") {
    // Integer loads: exact comparisons, so ties are ties.
    for (int l = 0; l < num_layers; ++l) {
      const auto& load = stats->load[l];
      std::vector<int> order(E);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return load[a] > load[b]; });
      std::vector<uint64_t> hl(H, 0);
      for (int e : order) {
        int best = 0;
        for (int h = 1; h < H; ++h)
          if (hl[h] < hl[best]) best = h;
        own(l, e).push_back(hosts[best]);
        hl[best] += load[e];
      }
    }
  } else {
    // replicated, as DeepSeek's EPLB: first the replica counts (each extra copy
    // to the expert with the highest load per replica), then the E + R replicas,
    // each carrying load / replicas, packed like balanced (largest first, to the
    // least-loaded host not holding that expert yet). With R = 0 this is
    // balanced (round_robin under equal loads).
    // NOTE: keeping the balanced map and adding copies to it instead measured
    // worse than balanced itself on the Mixtral traces (docs/placement.md).
    for (int l = 0; l < num_layers; ++l) {
      std::vector<double> load(E, 1.0);  // equal load when no stats
      if (stats)
        for (int e = 0; e < E; ++e) load[e] = static_cast<double>(stats->load[l][e]);
      // NOTE: load / reps is compared exactly: equal ratios of integers divide to
      // the same double. Only the host sums below need the tolerance.
      std::vector<int> reps(E, 1);
      for (int n = 0; n < redundant; ++n) {
        int pick = -1;
        for (int e = 0; e < E; ++e) {
          if (reps[e] >= H) continue;
          if (pick < 0 || load[pick] / reps[pick] < load[e] / reps[e]) pick = e;
        }
        ++reps[pick];  // pick >= 0: the capacity check above leaves a free slot
      }
      std::vector<std::pair<double, int>> units;  // (load share, expert)
      for (int e = 0; e < E; ++e)
        for (int k = 0; k < reps[e]; ++k) units.emplace_back(load[e] / reps[e], e);
      std::stable_sort(units.begin(), units.end(),
                       [](const auto& a, const auto& b) { return a.first > b.first; });
      std::vector<double> hl(H, 0.0);
      std::vector<std::vector<bool>> has(E, std::vector<bool>(H, false));
      for (const auto& [share, e] : units) {
        int best = -1;
        for (int h = 0; h < H; ++h)
          if (!has[e][h] && (best < 0 || clearly_less(hl[h], hl[best]))) best = h;
        has[e][best] = true;
        hl[best] += share;
        own(l, e).push_back(hosts[best]);
      }
    }
  }
  return Placement::from_owners(world_size, num_layers, num_experts, std::move(owners),
                                coordinator_hosts_experts || world_size == 1, policy);
}

Balancedness predicted_balancedness(const Placement& p, const ExpertStats& s) {
  if (s.num_layers != p.num_layers() || s.num_experts != p.num_experts() ||
      s.load.size() != static_cast<size_t>(p.num_layers()))
    throw Error(Status::InvalidArgument, "expert stats '" + s.source + "' are for " + std::to_string(s.num_layers) +
                                             " layers x " + std::to_string(s.num_experts) +
                                             " experts, the placement is for " + std::to_string(p.num_layers()) +
                                             " x " + std::to_string(p.num_experts()));
  Balancedness b;
  b.hosts = host_ranks(p.world_size(), p.coordinator_hosts_experts());
  std::vector<int> col(p.world_size(), -1);
  for (size_t i = 0; i < b.hosts.size(); ++i) col[b.hosts[i]] = static_cast<int>(i);
  const int H = static_cast<int>(b.hosts.size());
  for (int l = 0; l < p.num_layers(); ++l) {
    if (s.load[l].size() != static_cast<size_t>(p.num_experts()))
      throw Error(Status::InvalidArgument, "expert stats '" + s.source + "': layer " + std::to_string(l) +
                                               " does not have " + std::to_string(p.num_experts()) + " experts");
    std::vector<double> hl(H, 0.0);
    for (int e = 0; e < p.num_experts(); ++e) {
      const auto& o = p.owners(l, e);
      const double share = static_cast<double>(s.load[l][e]) / static_cast<double>(o.size());
      for (int r : o) hl[col.at(r)] += share;
    }
    const double sum = std::accumulate(hl.begin(), hl.end(), 0.0);
    const double mx = *std::max_element(hl.begin(), hl.end());
    const double v = mx > 0 ? (sum / H) / mx : 1.0;
    b.per_layer.push_back(v);
    b.rank_load.push_back(std::move(hl));
    if (l == 0 || v < b.worst) {
      b.worst = v;
      b.worst_layer = l;
    }
  }
  b.mean = b.per_layer.empty() ? 1.0 : std::accumulate(b.per_layer.begin(), b.per_layer.end(), 0.0) / b.per_layer.size();
  return b;
}

}  // namespace colibri
