// cmd_synth.cpp: colibri synth --arch mixtral --preset tiny|small|medium --seed N --out DIR
#include <spdlog/spdlog.h>

#include "launcher/commands.h"
#include "model/error.h"
#include "model/synth.h"

namespace colibri::cli {

int cmd_synth(int argc, char** argv) {
  cxxopts::Options o("colibri synth", "Write a Hugging Face-format model directory (config.json + safetensors)\n"
                                      "with seeded random weights, scaled so activations stay finite.\n"
                                      "Presets: tiny (~2 MB), small (~0.3 GB), medium (~1.6 GB bf16).");
  o.add_options()("arch", "Architecture", cxxopts::value<std::string>()->default_value("mixtral"))(
      "preset", "tiny, small or medium", cxxopts::value<std::string>()->default_value("tiny"))(
      "seed", "Random seed", cxxopts::value<uint64_t>()->default_value("0"))(
      "out", "Output directory", cxxopts::value<std::string>())(
      "dtype", "Weight dtype (default: f32 for tiny/small, bf16 for medium)", cxxopts::value<std::string>())(
      "shard-mb", "Split into shards of at most this many MiB", cxxopts::value<uint64_t>()->default_value("1024"));
  add_common_options(o);
  auto r = o.parse(argc, argv);
  if (handle_common(o, r)) return 0;
  if (!r.count("out")) throw Error(Status::InvalidArgument, "synth needs --out DIR");
  SynthOptions so;
  so.arch = r["arch"].as<std::string>();
  so.preset = r["preset"].as<std::string>();
  so.seed = r["seed"].as<uint64_t>();
  so.shard_bytes = r["shard-mb"].as<uint64_t>() << 20;
  if (so.shard_bytes == 0) throw Error(Status::InvalidArgument, "--shard-mb must be > 0");
  if (r.count("dtype")) {
    auto dt = dtype_from_name(r["dtype"].as<std::string>());
    if (!dt) throw Error(Status::InvalidArgument, "unknown --dtype '" + r["dtype"].as<std::string>() + "'");
    so.dtype = *dt;
  }
  Progress prog("synth");
  so.progress = [&](uint64_t d, uint64_t t, const std::string&) { prog.update(d, t); };
  uint64_t bytes = synthesize_model(r["out"].as<std::string>(), so);
  prog.finish();
  spdlog::info("wrote {} preset '{}' seed {} to {} ({:.1f} MiB)", so.arch, so.preset, so.seed, r["out"].as<std::string>(),
               bytes / 1048576.0);
  return 0;
}

}  // namespace colibri::cli
