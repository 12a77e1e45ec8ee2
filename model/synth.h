// synth.h: writes a Hugging Face-format model directory (config.json and
// safetensors, sharded past a size) with seeded random weights, for demos and
// benchmarks, for every family the converter supports. No Python involved.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "model/dtype.h"

namespace colibri {

struct SynthOptions {
  std::string arch = "mixtral";  // one of synth_architectures()
  std::string preset = "tiny";   // tiny | small | medium
  uint64_t seed = 0;
  std::optional<DType> dtype;    // default: f32 (tiny, small), bf16 (medium)
  int64_t vocab_size = 0;        // > 0: instead of the preset's (e.g. to fit a tokenizer)
  uint64_t shard_bytes = 1ull << 30;  // split into shards with an index past this
  std::function<void(uint64_t, uint64_t, const std::string&)> progress;
};

const std::vector<std::string>& synth_presets();
// The families synth writes (converter family names): mixtral, qwen2_moe,
// qwen3_moe, olmoe, deepseek_v2, deepseek_v3, glm4_moe, gpt_oss.
const std::vector<std::string>& synth_architectures();

// Returns the number of bytes of weights written. Throws Error
// (InvalidArgument for an unknown arch or preset).
uint64_t synthesize_model(const std::string& out_dir, const SynthOptions& opts);

}  // namespace colibri
