// cmd_simulate.cpp: colibri simulate: projects per-layer and end-to-end decode
// step time of an expert-parallel cluster (8 to 1024+ devices) from a cluster
// file, a model config, a placement and a routing (trace, stats or uniform).
// The model: coordinator/simulate.h, docs/scaling.md.
#include <spdlog/spdlog.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "coordinator/simulate.h"
#include "launcher/commands.h"
#include "launcher/options.h"
#include "model/colibri_file.h"
#include "model/config.h"
#include "model/error.h"
#include "model/file_io.h"
#include "model/placement.h"
#include "model/printable.h"
#include "model/routing_trace.h"

namespace colibri::cli {

namespace {

// --model: a .colibri file, a Hugging Face model directory or its config.json.
ModelConfig load_model_config(const std::string& path) {
  namespace fs = std::filesystem;
  if (path.size() > 8 && path.substr(path.size() - 8) == ".colibri") {
    ColibriFile::Options fo;
    fo.verify_dense = false;
    return ColibriFile::open(path, fo)->config();
  }
  const std::string file = fs::is_directory(path) ? (fs::path(path) / "config.json").string() : path;
  const std::string text = read_input(file, "model config");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw Error(Status::Format, "model config '" + file + "': not valid JSON: " + e.what());
  }
  return ModelConfig::from_hf(j);
}

double dtype_bytes(const std::string& name, const std::string& option) {
  if (name == "f32") return 4;
  if (name == "bf16" || name == "f16") return 2;
  if (name == "fp8" || name == "int8") return 1 + 4.0 / 128;  // one byte + an f32 scale per 128 (DeepEP's FP8)
  if (name == "int4") return 0.5 + 2.0 / 32;                  // 4 bits + an f16 scale per 32
  throw Error(Status::InvalidArgument, "--" + option + " must be f32, bf16, f16, fp8, int8 or int4, got '" + name + "'");
}

std::string ms(double s) {
  char b[32];
  std::snprintf(b, sizeof b, "%.4f", s * 1e3);
  return b;
}

}  // namespace

int cmd_simulate(int argc, char** argv) {
  cxxopts::Options o(
      "colibri simulate",
      "Project the decode step time of an expert-parallel cluster: expert compute from a roofline of each\n"
      "device, dispatch and combine from an alpha-beta model of NVLink and InfiniBand, waiting on the most\n"
      "loaded rank. Nothing is run or measured. Equations and assumptions: docs/scaling.md.\n"
      "usage: colibri simulate --cluster configs/cluster/C.json (--model M | --hidden H --intermediate I\n"
      "         --experts E --top-k K --layers L) --batch B [--placement P.json | --policy contiguous]\n"
      "         [--trace T | --stats S] [--json]");
  o.add_options()("cluster", "Cluster file (configs/cluster/*.json)", cxxopts::value<std::string>())(
      "nodes", "Override the cluster file's node count, 1..65536 (world = nodes x gpus_per_node)", cxxopts::value<int>())(
      "m,model", "Model: .colibri file, Hugging Face model directory or config.json", cxxopts::value<std::string>())(
      "hidden", "Without --model: hidden size, 1..2^20 (no dense part is modelled)", cxxopts::value<int64_t>())(
      "intermediate", "Without --model: expert intermediate size, 1..2^20", cxxopts::value<int64_t>())(
      "experts", "Without --model: routed experts per layer, 1..65536", cxxopts::value<int64_t>())(
      "top-k", "Without --model: experts per token, 1..experts", cxxopts::value<int64_t>())(
      "layers", "Without --model: MoE layers, 1..65536", cxxopts::value<int64_t>()->default_value("1"))(
      "placement", "Placement JSON (colibri place) for this world size", cxxopts::value<std::string>())(
      "policy", "Without --placement: contiguous or round_robin over the host ranks",
      cxxopts::value<std::string>()->default_value("contiguous"))(
      "trace", "Routing trace: B rows per step and layer, taken in order (wrapping)", cxxopts::value<std::string>())(
      "stats", "Expert-load statistics: tokens drawn with these loads (seeded)", cxxopts::value<std::string>())(
      "b,batch", "Tokens per step (decode: sequences), 1..2^24", cxxopts::value<int64_t>())(
      "context", "KV positions per sequence read by attention, 0..2^24", cxxopts::value<int64_t>()->default_value("1024"))(
      "steps", "Steps drawn per layer (results are their mean), 1..10000", cxxopts::value<int64_t>()->default_value("4"))(
      "seed", "Seed of the drawn routing", cxxopts::value<uint64_t>()->default_value("1"))(
      "source", "data_parallel (tokens spread over all ranks, each does the dense part of its own; all ranks\n"
                "host experts) or coordinator (Colibri's engine: rank 0 holds all tokens and the dense part)",
      cxxopts::value<std::string>()->default_value("data_parallel"))(
      "send", "per_rank: a token goes to a rank once (DeepEP); per_expert: once per expert (Colibri today)",
      cxxopts::value<std::string>()->default_value("per_rank"))(
      "weight-dtype", "Expert and dense weights: f32, bf16, fp8, int8, int4", cxxopts::value<std::string>()->default_value("bf16"))(
      "dispatch-dtype", "Dispatched activations: bf16, fp8 (1 byte + f32 scale per 128), f32",
      cxxopts::value<std::string>()->default_value("bf16"))(
      "combine-dtype", "Combined activations", cxxopts::value<std::string>()->default_value("bf16"))(
      "kv-dtype", "KV cache elements", cxxopts::value<std::string>()->default_value("bf16"))(
      "json", "Print JSON (the full configuration echoed) instead of text");
  add_common_options(o);
  auto r = o.parse(argc, argv);
  if (handle_common(o, r)) return 0;
  if (!r.count("cluster"))
    throw Error(Status::InvalidArgument, "simulate needs --cluster FILE (configs/cluster/*.json)");
  if (!r.count("batch")) throw Error(Status::InvalidArgument, "simulate needs --batch B (tokens per step)");
  if (r.count("trace") && r.count("stats"))
    throw Error(Status::InvalidArgument, "simulate: give --trace or --stats, not both");

  SimOptions opt;
  opt.batch = option_in_range(r, "batch", Range<int64_t>{1, kMaxPositions});
  opt.context = option_in_range(r, "context", Range<int64_t>{0, kMaxPositions});
  opt.steps = option_in_range(r, "steps", Range<int64_t>{1, 10000});
  const int nodes = option_or(r, "nodes", 0, Range<int>{1, kMaxRanks});
  if (!r.count("model")) {
    // Checked here, before any file is read; the model's own come from its config.
    option_in_range(r, "layers", Range<int64_t>{1, 65536});
    for (const char* k : {"hidden", "intermediate"}) option_or(r, k, 1, Range<int64_t>{1, int64_t{1} << 20});
    const int64_t e = option_or(r, "experts", 1, Range<int64_t>{1, 65536});
    option_or(r, "top-k", 1, Range<int64_t>{1, e, false, "(at most --experts)"});
  }
  opt.seed = r["seed"].as<uint64_t>();
  const std::string source = r["source"].as<std::string>(), send = r["send"].as<std::string>();
  if (source != "data_parallel" && source != "coordinator")
    throw Error(Status::InvalidArgument, "--source must be data_parallel or coordinator, got '" + source + "'");
  if (send != "per_rank" && send != "per_expert")
    throw Error(Status::InvalidArgument, "--send must be per_rank or per_expert, got '" + send + "'");
  opt.source = source == "coordinator" ? TokenSource::Coordinator : TokenSource::DataParallel;
  opt.unit = send == "per_expert" ? SendUnit::PerExpert : SendUnit::PerRank;
  opt.weight_bytes = dtype_bytes(r["weight-dtype"].as<std::string>(), "weight-dtype");
  opt.dispatch_bytes_per_elem = dtype_bytes(r["dispatch-dtype"].as<std::string>(), "dispatch-dtype");
  opt.combine_bytes_per_elem = dtype_bytes(r["combine-dtype"].as<std::string>(), "combine-dtype");
  opt.kv_bytes_per_elem = dtype_bytes(r["kv-dtype"].as<std::string>(), "kv-dtype");

  ClusterSpec cluster = ClusterSpec::load(r["cluster"].as<std::string>());
  if (r.count("nodes")) {
    const int n = nodes;
    if (n > 1 && cluster.nics_per_node == 0)
      throw Error(Status::InvalidArgument, "--nodes " + std::to_string(n) + ": cluster '" + cluster.name +
                                               "' has no inter_node link");
    cluster.nodes = n;
  }
  const int world = cluster.world();

  ModelCost shape;
  if (r.count("model")) {
    for (const char* k : {"hidden", "intermediate", "experts", "top-k"})
      if (r.count(k)) throw Error(Status::InvalidArgument, std::string("simulate: give --model or --") + k + ", not both");
    shape = ModelCost::from_config(load_model_config(r["model"].as<std::string>()));
  } else {
    for (const char* k : {"hidden", "intermediate", "experts", "top-k"})
      if (!r.count(k))
        throw Error(Status::InvalidArgument,
                    std::string("simulate needs --model, or --hidden, --intermediate, --experts and --top-k (missing --") +
                        k + ")");
    shape.architecture = "shape-only";
    shape.hidden = r["hidden"].as<int64_t>();
    shape.intermediate = r["intermediate"].as<int64_t>();
    shape.num_experts = r["experts"].as<int64_t>();
    shape.top_k = r["top-k"].as<int64_t>();
    shape.num_layers = r["layers"].as<int64_t>();
    if (shape.hidden < 1 || shape.intermediate < 1 || shape.num_experts < 1 || shape.top_k < 1 ||
        shape.top_k > shape.num_experts || shape.num_layers < 1 || shape.num_layers > 65536 || shape.num_experts > 65536)
      throw Error(Status::InvalidArgument, "simulate: --hidden, --intermediate, --experts, --layers must be >= 1 and "
                                           "--top-k in [1, experts]");
    shape.moe_index.resize(static_cast<size_t>(shape.num_layers));
    for (int i = 0; i < shape.num_layers; ++i) shape.moe_index[i] = i;
  }
  const int L = shape.num_moe_layers(), E = static_cast<int>(shape.num_experts);

  const bool coord_hosts = opt.source == TokenSource::DataParallel || world == 1;
  std::unique_ptr<Placement> placement;
  std::string placement_from;
  if (r.count("placement")) {
    placement_from = r["placement"].as<std::string>();
    placement = std::make_unique<Placement>(Placement::load(placement_from));
    placement->check_fits(world, L, E);
  } else {
    const std::string pol = r["policy"].as<std::string>();
    if (pol != "contiguous" && pol != "round_robin")
      throw Error(Status::InvalidArgument,
                  "--policy must be contiguous or round_robin without --placement (others need colibri place), got '" +
                      pol + "'");
    placement = std::make_unique<Placement>(make_placement(pol, L, E, world, coord_hosts, nullptr, 0));
    placement_from = "generated: " + pol;
  }

  std::unique_ptr<RoutingTrace> trace;
  std::unique_ptr<ExpertStats> stats;
  std::string routing_from = "uniform";
  if (r.count("trace")) {
    trace = std::make_unique<RoutingTrace>(read_routing_trace(r["trace"].as<std::string>()));
    if (trace->records.empty()) throw Error(Status::Format, "routing trace '" + trace->source + "' holds no routing rows");
    routing_from = "trace " + trace->source;
  } else if (r.count("stats")) {
    stats = std::make_unique<ExpertStats>(load_expert_stats(r["stats"].as<std::string>()));
    routing_from = "stats " + stats->source;
  }
  const SimResult res = simulate(cluster, shape, *placement, RoutingSource{trace.get(), stats.get()}, opt);

  if (r.count("json")) {
    nlohmann::json layers = nlohmann::json::array();
    for (const auto& l : res.layers)
      layers.push_back({{"layer", l.layer},
                        {"moe_index", l.moe_index},
                        {"max_rows", l.max_rows},
                        {"mean_rows", l.mean_rows},
                        {"balancedness", l.balancedness},
                        {"dispatch_ms", l.dispatch_s * 1e3},
                        {"compute_ms", l.compute_s * 1e3},
                        {"combine_ms", l.combine_s * 1e3},
                        {"compute_memory_bound", l.compute_memory_bound},
                        {"moe_ms", l.moe_s * 1e3},
                        {"moe_phased_ms", l.moe_phased_s * 1e3},
                        {"dense_ms", l.dense_s * 1e3},
                        {"total_ms", l.total_s * 1e3}});
    nlohmann::json cl = cluster.raw;
    cl["nodes"] = cluster.nodes;  // after --nodes
    nlohmann::json out = {
        {"cluster", cl},
        {"cluster_file", cluster.source},
        {"world", world},
        {"model", shape.to_json()},
        {"model_from", r.count("model") ? r["model"].as<std::string>() : "shape options"},
        {"placement", {{"from", placement_from}, {"policy", placement->policy()},
                       {"coordinator_hosts_experts", placement->coordinator_hosts_experts()}}},
        {"routing", routing_from},
        {"options",
         {{"batch", opt.batch}, {"context", opt.context}, {"steps", opt.steps}, {"seed", opt.seed},
          {"source", source}, {"send", send}, {"weight_dtype", r["weight-dtype"].as<std::string>()},
          {"dispatch_dtype", r["dispatch-dtype"].as<std::string>()},
          {"combine_dtype", r["combine-dtype"].as<std::string>()}, {"kv_dtype", r["kv-dtype"].as<std::string>()}}},
        {"layers", layers},
        {"totals",
         {{"step_ms", res.step_s * 1e3}, {"step_phased_ms", res.step_phased_s * 1e3},
          {"tokens_per_s", res.tokens_per_s}, {"dense_ms", res.dense_s * 1e3}, {"head_ms", res.head_s * 1e3},
          {"dispatch_ms", res.dispatch_s * 1e3}, {"compute_ms", res.compute_s * 1e3},
          {"combine_ms", res.combine_s * 1e3}, {"mean_balancedness", res.mean_balancedness},
          {"worst_balancedness", res.worst_balancedness}}}};
    std::printf("%s\n", out.dump(2).c_str());
    return 0;
  }

  // NOTE: names from the cluster and statistics files go through printable().
  std::printf("cluster %s (%s): %d node(s) x %d %s = %d ranks; NVLink-class %s %.0f GB/s %.1f us",
              printable(cluster.name).c_str(), printable(cluster.source).c_str(), cluster.nodes, cluster.gpus_per_node,
              printable(cluster.device.name).c_str(), world, printable(cluster.intra.name).c_str(), cluster.intra.bytes_per_s() / 1e9, cluster.intra.latency_us);
  if (cluster.nics_per_node)
    std::printf("; %s %.1f GB/s per device %.1f us", printable(cluster.inter.name).c_str(),
                cluster.inter_bytes_per_s_per_device() / 1e9, cluster.inter.latency_us);
  std::printf("\nmodel %s: %lld layers (%d MoE), %d experts, top-%lld, hidden %lld, expert intermediate %lld\n",
              shape.architecture.c_str(), static_cast<long long>(shape.num_layers), L, E,
              static_cast<long long>(shape.top_k), static_cast<long long>(shape.hidden),
              static_cast<long long>(shape.intermediate));
  std::printf("placement %s; routing %s; batch %lld, context %lld, %lld step(s); tokens %s, sent %s\n",
              printable(placement_from).c_str(), printable(routing_from).c_str(), static_cast<long long>(opt.batch),
              static_cast<long long>(opt.context), static_cast<long long>(opt.steps), source.c_str(), send.c_str());
  std::printf("%5s %5s %9s %9s %6s %11s %11s %11s %3s %11s %11s\n", "layer", "moe", "max rows", "mean rows", "bal",
              "dispatch ms", "compute ms", "combine ms", "mb", "dense ms", "total ms");
  for (const auto& l : res.layers) {
    if (l.moe_index < 0) {
      std::printf("%5d %5s %9s %9s %6s %11s %11s %11s %3s %11s %11s\n", l.layer, "-", "", "", "", "", "", "", "",
                  ms(l.dense_s).c_str(), ms(l.total_s).c_str());
      continue;
    }
    std::printf("%5d %5d %9.1f %9.1f %6.3f %11s %11s %11s %3s %11s %11s\n", l.layer, l.moe_index, l.max_rows,
                l.mean_rows, l.balancedness, ms(l.dispatch_s).c_str(), ms(l.compute_s).c_str(),
                ms(l.combine_s).c_str(), l.compute_memory_bound ? "M" : "C", ms(l.dense_s).c_str(),
                ms(l.total_s).c_str());
  }
  std::printf("(slowest rank's dispatch/compute/combine; mb: its expert compute is M memory- or C compute-bound)\n");
  std::printf("total: step %s ms (%s ms with barriers between phases), LM head %s ms, %.1f tokens/s\n",
              ms(res.step_s).c_str(), ms(res.step_phased_s).c_str(), ms(res.head_s).c_str(), res.tokens_per_s);
  std::printf("  sums over layers: dense %s ms, dispatch %s ms, expert compute %s ms, combine %s ms\n",
              ms(res.dense_s).c_str(), ms(res.dispatch_s).c_str(), ms(res.compute_s).c_str(), ms(res.combine_s).c_str());
  std::printf("  balancedness (mean/max rows per host rank): mean %.3f, worst %.3f\n", res.mean_balancedness,
              res.worst_balancedness);
  return 0;
}

}  // namespace colibri::cli
