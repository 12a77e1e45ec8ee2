// cmd_synth.cpp: colibri synth --arch FAMILY --preset tiny|small|medium --seed N --out DIR
#include <spdlog/spdlog.h>

#include "launcher/commands.h"
#include "launcher/options.h"
#include "model/error.h"
#include "model/synth.h"

namespace colibri::cli {

int cmd_synth(int argc, char** argv) {
  cxxopts::Options o(
      "colibri synth",
      "Write a Hugging Face-format model directory (config.json + safetensors)\n"
      "with seeded random weights, scaled so activations stay finite, ready for\n"
      "`colibri convert DIR OUT.colibri` (the same seed gives the same files).\n"
      "\n"
      "Families (--arch) and what their presets exercise:\n"
      "  mixtral      every layer MoE, GQA, softmax top-k routing\n"
      "  qwen2_moe    a dense layer (mlp_only_layers), gated shared expert, qkv biases\n"
      "  qwen3_moe    per-head q/k RMSNorm, heads x head_dim != hidden\n"
      "  olmoe        q/k RMSNorm over all heads, clip_qkv\n"
      "  deepseek_v2  MLA (no q low-rank), first layer dense, 2 shared experts,\n"
      "               group-limited greedy routing (4 groups), YaRN\n"
      "  deepseek_v3  MLA with q_lora, first layer dense, shared expert, sigmoid\n"
      "               routing with score bias over groups (top2_sum), YaRN\n"
      "  glm4_moe     first layer dense, shared expert, sigmoid routing, partial\n"
      "               rotary (0.5), q/k norms, qkv biases\n"
      "  gpt_oss      alternating sliding/full attention, sinks, fused experts with\n"
      "               biases, clamped SwiGLU, router bias, YaRN\n"
      "\n"
      "Presets (--preset; default dtype f32 for tiny and small, bf16 for medium):\n"
      "  tiny    2-3 layers, hidden 128, vocab 512, 4-16 experts: 3-6 MB\n"
      "  small   4-5 layers, hidden 512, vocab 4096, 8-32 experts: 0.23-0.27 GB\n"
      "  medium  8-9 layers, hidden 1024, vocab 32000, 8-64 experts: 1.6-1.9 GB,\n"
      "          >= 85% of it routed experts (decode benchmarks)");
  o.add_options()("arch",
                  "Family: mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v2, deepseek_v3, glm4_moe, "
                  "gpt_oss",
                  cxxopts::value<std::string>()->default_value("mixtral"))(
      "preset", "tiny, small or medium", cxxopts::value<std::string>()->default_value("tiny"))(
      "seed", "Random seed", cxxopts::value<uint64_t>()->default_value("0"))(
      "out", "Output directory", cxxopts::value<std::string>())(
      "dtype", "Weight dtype (default: f32 for tiny/small, bf16 for medium)", cxxopts::value<std::string>())(
      "shard-mb", "Split into shards of at most this many MiB, 1..2^20", cxxopts::value<uint64_t>()->default_value("1024"))(
      "vocab", "Vocabulary size instead of the preset's (e.g. to fit a tokenizer), 1..2^20", cxxopts::value<int64_t>());
  add_common_options(o);
  auto r = o.parse(argc, argv);
  if (handle_common(o, r)) return 0;
  if (!r.count("out")) throw Error(Status::InvalidArgument, "synth needs --out DIR");
  SynthOptions so;
  so.arch = r["arch"].as<std::string>();
  so.preset = r["preset"].as<std::string>();
  so.seed = r["seed"].as<uint64_t>();
  so.shard_bytes = option_in_range(r, "shard-mb", Range<uint64_t>{1, uint64_t{1} << 20}) << 20;
  if (r.count("vocab")) so.vocab_size = option_in_range(r, "vocab", Range<int64_t>{1, int64_t{1} << 20});
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
