// cmd_stats.cpp: colibri stats TRACE [--out STATS.json]: aggregates a routing
// trace (ours or an imported Mixtral trace) into per-layer expert loads.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdio>
#include <numeric>

#include "launcher/commands.h"
#include "launcher/options.h"
#include "model/error.h"
#include "model/routing_trace.h"

namespace colibri::cli {

int cmd_stats(int argc, char** argv) {
  cxxopts::Options o("colibri stats",
                     "Aggregate a routing trace into expert-load statistics (how many tokens chose each expert of\n"
                     "each layer) and print a summary. The trace is ours (--record-routing on generate/run) or\n"
                     "a Mixtral-8x7B import (../shared/traces/), detected from its first line.");
  o.add_options()("trace", "Routing trace (JSONL)", cxxopts::value<std::string>())(
      "o,out", "Write the statistics as JSON (for colibri place --stats and --cache-policy pinned)",
      cxxopts::value<std::string>())("top", "Hottest experts to show per layer, 0..65536",
                                     cxxopts::value<int>()->default_value("3"));
  add_common_options(o);
  o.parse_positional({"trace"});
  o.positional_help("TRACE");
  auto r = o.parse(argc, argv);
  if (handle_common(o, r)) return 0;
  if (!r.count("trace")) throw Error(Status::InvalidArgument, "stats needs a TRACE file (colibri stats TRACE --out STATS.json)");
  if (!r.unmatched().empty()) throw Error(Status::InvalidArgument, "stats takes one TRACE, got also '" + r.unmatched()[0] + "'");
  const int top = option_in_range(r, "top", Range<int>{0, 65536});

  check_output_options(r, {"out"}, option_paths(r, {"trace"}));
  const RoutingTrace trace = read_routing_trace(r["trace"].as<std::string>());
  if (trace.records.empty()) throw Error(Status::Format, "routing trace '" + trace.source + "' holds no routing rows");
  const ExpertStats s = aggregate_stats(trace);
  const int64_t steps = trace.records.back().step - trace.records.front().step + 1;

  std::printf("trace %s (%s): %zu rows, %lld steps\n", trace.source.c_str(), trace.format.c_str(),
              trace.records.size(), static_cast<long long>(steps));
  std::printf("%d layers, %d experts, top-%d, %llu tokens (at layer 0)\n", s.num_layers, s.num_experts, trace.top_k,
              static_cast<unsigned long long>(s.tokens));
  // Imbalance of a layer: the hottest expert's load over the mean expert load
  // (1.0 = every expert equally used; E = one expert takes everything).
  std::printf("layer  selections  max/mean  hottest experts (share of the layer's selections)\n");
  double sum_imb = 0, worst_imb = 0;
  int worst_layer = 0;
  for (int l = 0; l < s.num_layers; ++l) {
    const auto& load = s.load[l];
    const uint64_t total = std::accumulate(load.begin(), load.end(), uint64_t{0});
    std::vector<int> order(s.num_experts);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return load[a] > load[b]; });
    const double mean = static_cast<double>(total) / s.num_experts;
    const double imb = total ? static_cast<double>(load[order[0]]) / mean : 1.0;
    sum_imb += imb;
    if (imb > worst_imb) worst_imb = imb, worst_layer = l;
    std::string hot;
    for (int i = 0; i < std::min(top, s.num_experts); ++i) {
      char b[64];
      std::snprintf(b, sizeof b, "%se%d %.1f%%", i ? ", " : "", order[i], total ? 100.0 * load[order[i]] / total : 0.0);
      hot += b;
    }
    std::printf("%5d  %10llu  %8.2f  %s\n", l, static_cast<unsigned long long>(total), imb, hot.c_str());
  }
  std::printf("expert load imbalance (max/mean): mean over layers %.3f, worst %.3f (layer %d)\n",
              sum_imb / s.num_layers, worst_imb, worst_layer);

  if (r.count("out")) {
    save_expert_stats(s, r["out"].as<std::string>());
    spdlog::info("wrote expert stats to {}", r["out"].as<std::string>());
  }
  return 0;
}

}  // namespace colibri::cli
