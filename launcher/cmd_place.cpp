// cmd_place.cpp: colibri place: makes an expert placement (which ranks own which
// experts of every layer), writes it as JSON and, given measured expert loads,
// prints the predicted balancedness of every policy side by side.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdio>

#include "launcher/commands.h"
#include "launcher/options.h"
#include "model/colibri_file.h"
#include "model/error.h"
#include "model/placement.h"
#include "model/printable.h"
#include "model/routing_trace.h"

namespace colibri::cli {

int cmd_place(int argc, char** argv) {
  cxxopts::Options o(
      "colibri place",
      "Make an expert placement for a cluster of N ranks (rank 0 coordinates; ranks 1..N-1 host experts,\n"
      "or 0..N-1 with --coordinator-experts) and write it as JSON for colibri run --placement.\n"
      "With --stats, print the predicted balancedness (mean/max tokens per host rank, 1 = perfect) of\n"
      "every policy side by side, the written one marked with *.\n"
      "With --eval, also on other statistics: a placement is made from past load and serves future load.\n"
      "usage: colibri place (--model FILE | --layers L --experts E) --ranks N --policy P [--stats S] --out P.json");
  o.add_options()("m,model", ".colibri model file (for its layers and experts)", cxxopts::value<std::string>())(
      "layers", "MoE layers, without --model, 1..65536", cxxopts::value<int>())(
      "experts", "Routed experts per layer, without --model, 1..65536", cxxopts::value<int>())(
      "n,ranks", "World size N, the coordinator included, 1..65536", cxxopts::value<int>())(
      "policy", "contiguous, round_robin, balanced (needs --stats) or replicated", cxxopts::value<std::string>())(
      "stats", "Expert-load statistics from colibri stats", cxxopts::value<std::string>())(
      "eval", "Also predict balancedness on these (held-out) statistics", cxxopts::value<std::string>())(
      "redundant", "replicated: extra expert copies per layer, 0..65536 (default: one per host rank)", cxxopts::value<int>())(
      "coordinator-experts", "Rank 0 hosts experts too (always so with one rank)")(
      "o,out", "Write the placement JSON here", cxxopts::value<std::string>());
  add_common_options(o);
  auto r = o.parse(argc, argv);
  if (handle_common(o, r)) return 0;

  check_output_options(r, {"out"}, option_paths(r, {"model", "stats", "eval"}));
  int layers = 0, experts = 0;
  if (r.count("model")) {
    if (r.count("layers") || r.count("experts"))
      throw Error(Status::InvalidArgument, "place: give --model or --layers/--experts, not both");
    ColibriFile::Options fo;
    fo.verify_dense = false;  // only the config is needed
    auto file = ColibriFile::open(r["model"].as<std::string>(), fo);
    layers = static_cast<int>(file->config().num_moe_layers());
    experts = static_cast<int>(file->config().num_experts);
  } else {
    if (!r.count("layers") || !r.count("experts"))
      throw Error(Status::InvalidArgument, "place needs --model FILE, or --layers L and --experts E");
    layers = option_in_range(r, "layers", Range<int>{1, 65536});
    experts = option_in_range(r, "experts", Range<int>{1, 65536});
  }
  if (!r.count("ranks")) throw Error(Status::InvalidArgument, "place needs --ranks N (the coordinator included)");
  if (!r.count("policy"))
    throw Error(Status::InvalidArgument, "place needs --policy contiguous|round_robin|balanced|replicated");
  const int world = option_in_range(r, "ranks", Range<int>{1, kMaxRanks});
  const std::string policy = r["policy"].as<std::string>();
  const auto& policies = placement_policies();
  if (std::find(policies.begin(), policies.end(), policy) == policies.end())
    throw Error(Status::InvalidArgument, "unknown --policy '" + policy + "' (contiguous, round_robin, balanced, replicated)");
  const bool coord = r.count("coordinator-experts") > 0 || world == 1;
  const int hosts = static_cast<int>(host_ranks(world, coord).size());
  if (r.count("redundant") && policy != "replicated")
    throw Error(Status::InvalidArgument, "--redundant applies only to --policy replicated");
  int redundant = option_or(r, "redundant", hosts, Range<int>{0, 65536});
  if (!r.count("redundant")) redundant = std::min(redundant, experts * (hosts - 1));  // what fits

  std::unique_ptr<ExpertStats> stats;
  if (r.count("stats")) stats = std::make_unique<ExpertStats>(load_expert_stats(r["stats"].as<std::string>()));
  if (stats && (stats->num_layers != layers || stats->num_experts != experts))
    throw Error(Status::InvalidArgument, "stats '" + r["stats"].as<std::string>() + "' are for " +
                                             std::to_string(stats->num_layers) + " layers x " +
                                             std::to_string(stats->num_experts) + " experts, the placement is for " +
                                             std::to_string(layers) + " x " + std::to_string(experts));

  const Placement chosen = make_placement(policy, layers, experts, world, coord, stats.get(),
                                          policy == "replicated" ? redundant : 0);
  std::printf("%d layers x %d experts over %d ranks (experts on ranks %d..%d), policy %s", layers, experts, world,
              host_ranks(world, coord).front(), world - 1, policy.c_str());
  if (policy == "replicated") std::printf(", %d redundant copies per layer", redundant);
  std::printf("\n");

  std::unique_ptr<ExpertStats> held_out;
  if (r.count("eval")) {
    held_out = std::make_unique<ExpertStats>(load_expert_stats(r["eval"].as<std::string>()));
    if (held_out->num_layers != layers || held_out->num_experts != experts)
      throw Error(Status::InvalidArgument, "--eval stats '" + r["eval"].as<std::string>() + "' are for " +
                                               std::to_string(held_out->num_layers) + " layers x " +
                                               std::to_string(held_out->num_experts) + " experts, the placement is for " +
                                               std::to_string(layers) + " x " + std::to_string(experts));
  }
  if (stats) {
    std::printf("predicted balancedness (mean/max tokens per host rank, 1 = perfect; mean over layers and the worst layer)\n");
    std::printf("  on %s (%llu tokens)\n", printable(stats->source).c_str(), static_cast<unsigned long long>(stats->tokens));
    if (held_out)
      std::printf("  held out: on %s (%llu tokens)\n", printable(held_out->source).c_str(),
                  static_cast<unsigned long long>(held_out->tokens));
    std::printf("  %-22s %8s %8s %6s", "policy", "mean", "worst", "layer");
    if (held_out) std::printf("  %13s %13s %6s", "held-out mean", "held-out worst", "layer");
    std::printf("\n");
    for (const auto& p : policies) {
      const int red = p == "replicated" ? redundant : 0;
      const Placement pl = p == policy ? chosen : make_placement(p, layers, experts, world, coord, stats.get(), red);
      const Balancedness b = predicted_balancedness(pl, *stats);
      std::string name = p + (p == "replicated" ? " (R=" + std::to_string(red) + ")" : "");
      std::printf("%c %-22s %8.3f %8.3f %6d", p == policy ? '*' : ' ', name.c_str(), b.mean, b.worst, b.worst_layer);
      if (held_out) {
        const Balancedness h = predicted_balancedness(pl, *held_out);
        std::printf("  %13.3f %13.3f %6d", h.mean, h.worst, h.worst_layer);
      }
      std::printf("\n");
    }
  } else if (held_out) {
    const Balancedness h = predicted_balancedness(chosen, *held_out);
    std::printf("predicted balancedness on %s: mean %.3f, worst %.3f (layer %d)\n", printable(held_out->source).c_str(), h.mean,
                h.worst, h.worst_layer);
  } else {
    std::printf("(no --stats: balancedness is not predicted; colibri stats TRACE --out STATS.json makes them)\n");
  }

  // Experts per host rank, over all layers (replicas included).
  std::vector<int> held(world, 0);
  for (int l = 0; l < layers; ++l)
    for (int e = 0; e < experts; ++e)
      for (int rk : chosen.owners(l, e)) ++held[rk];
  std::string per_rank;
  for (int rk : host_ranks(world, coord)) per_rank += (per_rank.empty() ? "" : ", ") + std::to_string(rk) + ": " + std::to_string(held[rk]);
  std::printf("experts held per rank (all layers): %s\n", per_rank.c_str());

  if (r.count("out")) {
    chosen.save(r["out"].as<std::string>());
    std::printf("wrote %s\n", r["out"].as<std::string>().c_str());
  } else {
    std::printf("(not written: no --out)\n");
  }
  return 0;
}

}  // namespace colibri::cli
