// cmd_cache_sim.cpp: colibri cache-sim --trace FILE --capacity C: replays a
// routing trace through the expert-cache policies (the worker's very code) and
// Belady's MIN, the offline bound. Semantics: docs/caching.md.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>

#include "launcher/commands.h"
#include "launcher/options.h"
#include "model/error.h"
#include "model/routing_trace.h"
#include "worker/expert_cache.h"

namespace colibri::cli {

namespace {

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

// The trace as access batches. Keys are layer * E + expert. Token granularity:
// every record (one token at one layer) is a batch, its experts in slot order.
// Step granularity: every (step, layer) is a batch of the distinct experts its
// tokens chose, in order of first appearance (a worker loads each once per batch).
// Per-layer: a batch goes to its layer's cache; global: all to one cache.
AccessTrace make_access_trace(const RoutingTrace& t, bool per_layer, bool by_step) {
  AccessTrace a;
  a.num_groups = per_layer ? static_cast<uint32_t>(std::max(t.num_layers, 1)) : 1;
  const uint64_t E = static_cast<uint64_t>(t.num_experts);
  a.keys.reserve(t.records.size() * std::max(t.top_k, 1));
  std::vector<uint8_t> seen(t.num_experts, 0);
  for (size_t i = 0; i < t.records.size();) {
    const RoutingRecord& r = t.records[i];
    size_t j = i + 1;
    if (by_step)
      while (j < t.records.size() && t.records[j].step == r.step && t.records[j].layer == r.layer) ++j;
    AccessBatch b;
    b.group = per_layer ? static_cast<uint32_t>(r.layer) : 0;
    b.begin = a.keys.size();
    for (size_t k = i; k < j; ++k)
      for (int32_t e : t.records[k].experts) {
        if (e < 0 || e >= t.num_experts || t.records[k].layer < 0 || t.records[k].layer >= t.num_layers)
          throw Error(Status::Format, "cache-sim: expert " + std::to_string(e) + " of layer " +
                                          std::to_string(t.records[k].layer) + " is out of range");
        if (by_step) {
          if (seen[e]) continue;
          seen[e] = 1;
        }
        a.keys.push_back(static_cast<uint64_t>(t.records[k].layer) * E + static_cast<uint64_t>(e));
      }
    b.end = a.keys.size();
    if (by_step)
      for (uint64_t k = b.begin; k < b.end; ++k) seen[a.keys[k] % E] = 0;
    if (b.end > b.begin) a.batches.push_back(b);
    i = j;
  }
  return a;
}

// The `n` most loaded keys of each group (per layer) or overall (global): what
// the pinned policy would take from STATS.json. Ties: the lower key.
std::vector<std::vector<uint64_t>> hottest_keys(const AccessTrace& a, uint64_t num_keys, size_t n) {
  std::vector<uint64_t> load(num_keys, 0);
  std::vector<uint32_t> group_of(num_keys, 0);
  for (const AccessBatch& b : a.batches)
    for (uint64_t i = b.begin; i < b.end; ++i) {
      ++load[a.keys[i]];
      group_of[a.keys[i]] = b.group;
    }
  std::vector<std::vector<uint64_t>> out(a.num_groups);
  std::vector<uint64_t> order(num_keys);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](uint64_t x, uint64_t y) { return load[x] > load[y]; });
  for (uint64_t k : order)
    if (load[k] && out[group_of[k]].size() < n) out[group_of[k]].push_back(k);
  return out;
}

std::string pct(double x) {
  char b[32];
  std::snprintf(b, sizeof b, "%6.2f%%", 100.0 * x);
  return b;
}

nlohmann::json stats_json(const CacheStats& s) {
  return {{"hits", s.hits},       {"misses", s.misses},           {"evictions", s.evictions},
          {"bytes_loaded", s.bytes_loaded}, {"hit_rate", s.hit_rate()}};
}

}  // namespace

int cmd_cache_sim(int argc, char** argv) {
  cxxopts::Options o("colibri cache-sim",
                     "Replay a routing trace through the expert-cache policies and Belady's optimum (the bound).");
  o.add_options()("trace", "Routing trace (our JSONL or the Mixtral import format)", cxxopts::value<std::string>())(
      "capacity", "Slots per cache (per layer, or in all with --global), 1..2^24; a list such as 3,4,5,6 runs each",
      cxxopts::value<std::string>())(
      "policy", "all, or a comma-separated list of: " + [] {
        std::string s;
        for (const auto& n : ExpertCache::policy_names()) s += (s.empty() ? "" : ", ") + n;
        return s;
      }(), cxxopts::value<std::string>()->default_value("all"))(
      "per-layer", "One cache of C slots per layer (default)")("global", "One cache of C slots for all layers")(
      "granularity", "token: every token at a layer is a batch; step: every (step, layer) is one",
      cxxopts::value<std::string>()->default_value("token"))(
      "decay", "hybrid: score = count * decay^(now - last use), decay in (0, 1]", cxxopts::value<double>()->default_value("0.9"))(
      "pin", "pinned: keys pinned per cache, the trace's hottest (default: C / 2)", cxxopts::value<int64_t>())(
      "hints", "on: tell caches each batch's keys first (hint_upcoming); off: demand only; both: a column each",
      cxxopts::value<std::string>()->default_value("both"))(
      "bytes-per-slot", "Bytes of one expert, for bytes_loaded", cxxopts::value<uint64_t>()->default_value("0"))(
      "json", "Print JSON instead of text");
  add_common_options(o);
  auto r = o.parse(argc, argv);
  if (handle_common(o, r)) return 0;
  if (!r.count("trace"))
    throw Error(Status::InvalidArgument, "cache-sim needs --trace FILE (see colibri cache-sim --help)");
  if (!r.count("capacity"))
    throw Error(Status::InvalidArgument, "cache-sim needs --capacity C (see colibri cache-sim --help)");
  if (r.count("per-layer") && r.count("global"))
    throw Error(Status::InvalidArgument, "cache-sim: --per-layer and --global exclude each other");
  const bool per_layer = !r.count("global");
  const std::string gran = r["granularity"].as<std::string>();
  if (gran != "token" && gran != "step")
    throw Error(Status::InvalidArgument, "cache-sim: --granularity must be token or step, got '" + gran + "'");
  const std::string hints = r["hints"].as<std::string>();
  if (hints != "on" && hints != "off" && hints != "both")
    throw Error(Status::InvalidArgument, "cache-sim: --hints must be on, off or both, got '" + hints + "'");
  std::vector<size_t> capacities;
  for (const auto& c : split_list(r["capacity"].as<std::string>())) {
    size_t used = 0;
    long long v = -1;
    try {
      v = std::stoll(c, &used);
    } catch (const std::exception&) {
    }
    if (used != c.size())
      throw Error(Status::InvalidArgument,
                  "cache-sim: --capacity takes slot counts such as 5 or 3,4,5,6, got '" + c + "'");
    check_option("capacity", v, Range<long long>{1, kMaxPositions, false, "(a cache must hold at least one expert)"});
    capacities.push_back(static_cast<size_t>(v));
  }
  if (capacities.empty()) throw Error(Status::InvalidArgument, "cache-sim: --capacity is empty");
  std::vector<std::string> policies;
  const std::string pol = r["policy"].as<std::string>();
  if (pol == "all") {
    policies = ExpertCache::policy_names();
  } else {
    policies = split_list(pol);
    const auto known = ExpertCache::policy_names();
    for (const auto& p : policies)
      if (std::find(known.begin(), known.end(), p) == known.end())
        ExpertCache::create(p, 1, CacheOptions{});  // throws the unknown-policy error with the list
  }
  CacheOptions base;
  base.decay = option_in_range(r, "decay", Range<double>{0, 1, true});
  base.bytes_per_slot = option_in_range(r, "bytes-per-slot", Range<uint64_t>{0, uint64_t{1} << 40});
  for (const auto& p : policies) ExpertCache::create(p, 1, base);  // option errors before any output
  const bool pin_given = r.count("pin") > 0;
  const int64_t pin_opt = option_or(r, "pin", 0, Range<int64_t>{0, kMaxPositions});
  for (size_t cap : capacities)
    if (pin_given && (pin_opt < 0 || static_cast<size_t>(pin_opt) > cap))
      throw Error(Status::InvalidArgument, "cache-sim: --pin " + std::to_string(pin_opt) +
                                               " must be in [0, capacity " + std::to_string(cap) + "]");

  const RoutingTrace trace = read_routing_trace(r["trace"].as<std::string>());
  if (trace.records.empty() || trace.num_experts <= 0 || trace.num_layers <= 0)
    throw Error(Status::Format, "cache-sim: trace '" + trace.source + "' has no routing records");
  const bool by_step = gran == "step";
  const AccessTrace at = make_access_trace(trace, per_layer, by_step);
  const uint64_t num_keys = static_cast<uint64_t>(trace.num_layers) * static_cast<uint64_t>(trace.num_experts);
  base.max_keys = num_keys;
  base.num_experts = static_cast<uint32_t>(trace.num_experts);

  const bool json_out = r.count("json") > 0;
  nlohmann::json results = nlohmann::json::array();
  if (!json_out) {
    std::printf("trace: %s (%s): %d layers x %d experts, %zu records; %zu accesses in %zu batches\n",
                trace.source.c_str(), trace.format.c_str(), trace.num_layers, trace.num_experts,
                trace.records.size(), at.keys.size(), at.batches.size());
    std::printf("replay: %s, %s\n",
                per_layer ? "one cache of C slots per layer" : "one cache of C slots for all layers",
                by_step ? "one batch per (step, layer): its distinct experts"
                        : "one batch per token and layer: its experts in slot order");
  }
  for (size_t cap : capacities) {
    const int64_t pin = pin_given ? pin_opt : static_cast<int64_t>(cap / 2);
    const auto pinned = hottest_keys(at, num_keys, static_cast<size_t>(pin));
    const CacheStats bel = replay_belady(at, cap, base.bytes_per_slot);
    if (!json_out) {
      std::printf("\ncapacity %zu%s\n", cap, per_layer ? " per layer" : "");
      // misses and evictions: of the hinted replay unless --hints off
      std::printf("  %-9s %9s %9s %9s %9s\n", "policy", hints == "on" ? "" : "demand", hints == "off" ? "" : "hinted",
                  hints == "off" ? "misses" : "misses(h)", hints == "off" ? "evictions" : "evict.(h)");
    }
    for (const auto& p : policies) {
      CacheStats st[2];  // [0] demand only, [1] with hints
      for (int h = 0; h < 2; ++h) {
        if ((h == 0 && hints == "on") || (h == 1 && hints == "off")) continue;
        st[h] = replay(
            at,
            [&](uint32_t g) {
              CacheOptions opts = base;
              if (p == "pinned") opts.pinned = pinned[g];
              return ExpertCache::create(p, cap, opts);
            },
            h == 1);
        nlohmann::json j = stats_json(st[h]);
        j["capacity"] = cap;
        j["policy"] = p;
        j["hints"] = h == 1;
        if (p == "pinned") j["pinned_per_cache"] = pin;
        results.push_back(j);
      }
      if (!json_out) {
        const CacheStats& shown = hints == "off" ? st[0] : st[1];
        std::printf("  %-9s %9s %9s %9llu %9llu\n", p.c_str(), hints == "on" ? "" : pct(st[0].hit_rate()).c_str(),
                    hints == "off" ? "" : pct(st[1].hit_rate()).c_str(), static_cast<unsigned long long>(shown.misses),
                    static_cast<unsigned long long>(shown.evictions));
      }
    }
    nlohmann::json j = stats_json(bel);
    j["capacity"] = cap;
    j["policy"] = "belady";
    results.push_back(j);
    if (!json_out)
      std::printf("  %-9s %9s %9s %9llu %9llu   (offline optimum: the bound)\n", "belady",
                  hints == "on" ? "" : pct(bel.hit_rate()).c_str(), hints == "off" ? "" : pct(bel.hit_rate()).c_str(),
                  static_cast<unsigned long long>(bel.misses),
                  static_cast<unsigned long long>(bel.evictions));
  }
  if (json_out) {
    nlohmann::json out = {{"trace", trace.source},
                          {"format", trace.format},
                          {"num_layers", trace.num_layers},
                          {"num_experts", trace.num_experts},
                          {"records", trace.records.size()},
                          {"accesses", at.keys.size()},
                          {"batches", at.batches.size()},
                          {"mode", per_layer ? "per-layer" : "global"},
                          {"granularity", gran},
                          {"decay", base.decay},
                          {"results", results}};
    std::printf("%s\n", out.dump(2).c_str());
  }
  return 0;
}

}  // namespace colibri::cli
