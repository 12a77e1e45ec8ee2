// make_seeds.cpp: writes the generated part of the fuzz seed corpus (valid
// inputs made by the library's own writers, and hand-written near-valid ones)
// into OUT/<target>/. Run once when a format changes:
//   build-fuzz/bin/fuzz_make_seeds tests/fuzz/corpus
// Deterministic: the same build writes the same bytes.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "model/colibri_file.h"
#include "model/config.h"
#include "model/error.h"
#include "model/placement.h"
#include "model/routing_trace.h"
#include "model/safetensors.h"

using namespace colibri;
namespace fs = std::filesystem;

namespace {

fs::path out_root;

void put(const std::string& target, const std::string& name, const std::string& bytes) {
  fs::create_directories(out_root / target);
  std::ofstream o(out_root / target / name, std::ios::binary | std::ios::trunc);
  o.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!o) throw Error(Status::Io, "cannot write " + (out_root / target / name).string());
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  std::memcpy(s.data(), &v, 8);
  return s;
}

// The smallest config the validator accepts: 1 layer, 2 experts, hidden 2.
ModelConfig config_a() {
  ModelConfig c;
  c.architecture = "mixtral";
  c.vocab_size = 4;
  c.hidden_size = 2;
  c.intermediate_size = 2;
  c.num_layers = 1;
  c.num_heads = 1;
  c.num_kv_heads = 1;
  c.head_dim = 2;
  c.num_experts = 2;
  c.experts_per_token = 1;
  c.max_position_embeddings = 16;
  c.tie_word_embeddings = true;
  return c;
}

// Two layers, GQA, untied output, a sliding window, bos/eos.
ModelConfig config_b() {
  ModelConfig c = config_a();
  c.vocab_size = 8;
  c.hidden_size = 4;
  c.intermediate_size = 3;
  c.num_layers = 2;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.num_experts = 3;
  c.experts_per_token = 2;
  c.sliding_window = 8;
  c.tie_word_embeddings = false;
  c.bos_token_id = 1;
  c.eos_token_id = 2;
  c.rope_theta = 1e6;
  return c;
}

// Writes a .colibri file with zero (or seeded random) weights; returns its bytes.
std::string make_colibri(const ModelConfig& c, DType dense_dt, DType expert_dt, bool random_data) {
  const std::string path = (fs::temp_directory_path() / ("colibri-seed-" + std::to_string(::getpid()) + ".colibri")).string();
  std::vector<ColibriWriter::DenseTensor> dense;
  for (const auto& s : dense_tensor_specs(c)) dense.push_back({s.name, s.is_norm ? DType::F32 : dense_dt, s.shape});
  std::mt19937_64 rng(42);
  auto fill = [&](std::vector<uint8_t>& b) {
    for (auto& x : b) x = random_data ? static_cast<uint8_t>(rng()) & 0x3f : 0;  // small finite values
  };
  {
    ColibriWriter w(path, c, dense, expert_dt);
    for (size_t i = 0; i < w.num_dense(); ++i) {
      uint64_t n = dtype_size(w.dense(i).dtype);
      for (auto d : w.dense(i).shape) n *= static_cast<uint64_t>(d);
      std::vector<uint8_t> b(n);
      fill(b);
      w.write_dense(i, b.data(), b.size());
    }
    std::vector<uint8_t> block(w.layout().size);
    for (int l = 0; l < c.num_layers; ++l)
      for (int e = 0; e < c.num_experts; ++e) {
        fill(block);
        w.write_expert(l, e, block.data(), block.size());
      }
    w.finish();
  }
  ColibriFile::open(path);  // the seed must be valid: throws otherwise
  std::string bytes = slurp(path);
  fs::remove(path);
  return bytes;
}

// Header and metadata only: the fuzzer's repaired mode pads the rest with zeros.
std::string compact(const std::string& file) {
  FileHeader h;
  std::memcpy(&h, file.data(), sizeof h);
  return file.substr(0, h.expert_index_offset + h.expert_count * kExpertRecordSize);
}

void colibri_seeds() {
  const std::string t = "fuzz_colibri_file";
  put(t, "tiny-f32-full.colibri.bin", make_colibri(config_a(), DType::F32, DType::F32, true));
  put(t, "tiny-f32-zero-compact.colibri.bin", compact(make_colibri(config_a(), DType::F32, DType::F32, false)));
  put(t, "tiny-bf16-zero-compact.colibri.bin", compact(make_colibri(config_a(), DType::BF16, DType::BF16, false)));
  put(t, "b-f16-zero-compact.colibri.bin", compact(make_colibri(config_b(), DType::F16, DType::F16, false)));
  // Near-valid: the 128-byte header alone, and a wrong version.
  std::string full = make_colibri(config_a(), DType::F32, DType::F32, false);
  put(t, "header-only.colibri.bin", full.substr(0, kHeaderSize));
  std::string v2 = compact(full);
  v2[8] = 2;
  put(t, "version2-compact.colibri.bin", v2);
}

void safetensors_seeds() {
  const std::string t = "fuzz_safetensors";
  const std::string path = (fs::temp_directory_path() / ("colibri-seed-" + std::to_string(::getpid()) + ".safetensors")).string();
  auto write = [&](const std::vector<SafetensorsWriter::Spec>& specs, const std::map<std::string, std::string>& meta) {
    SafetensorsWriter w(path, specs, meta);
    for (const auto& s : specs) {
      uint64_t n = dtype_size(s.dtype);
      for (auto d : s.shape) n *= static_cast<uint64_t>(d);
      std::vector<uint8_t> b(n);
      for (size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(i * 37 + 11);
      w.write_next(b.data(), b.size());
    }
    w.finish();
    std::string bytes = slurp(path);
    fs::remove(path);
    return bytes;
  };
  // Whole files (mode 1).
  put(t, "three-dtypes.safetensors",
      write({{"model.embed_tokens.weight", DType::F32, {2, 3}}, {"b", DType::BF16, {4}}, {"c", DType::F16, {1, 2}}},
            {{"format", "pt"}}));
  put(t, "empty-and-scalar.safetensors", write({{"empty", DType::F32, {0}}, {"scalar", DType::F32, {}}}, {}));
  put(t, "no-tensors.safetensors", write({}, {}));
  // [data size][header text] (mode 2): dtypes the engine does not compute with,
  // metadata, zero-size tensors, adjacent ranges.
  put(t, "header-mixed.bin",
      le64(64) + R"({"__metadata__":{"format":"pt","n":"1"},"i64":{"dtype":"I64","shape":[2,2],"data_offsets":[0,32]},)"
                 R"("b":{"dtype":"BOOL","shape":[4],"data_offsets":[32,36]},"f8":{"dtype":"F8_E4M3","shape":[2,2],"data_offsets":[36,40]},)"
                 R"("u8":{"dtype":"U8","shape":[0,5],"data_offsets":[40,40]},"x":{"dtype":"F64","shape":[3],"data_offsets":[40,64]}})");
  put(t, "header-one.bin", le64(8) + R"({"w":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]}})");
  put(t, "header-overlap.bin",
      le64(8) + R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"U16","shape":[2],"data_offsets":[2,6]}})");
}

void placement_seeds() {
  const std::string t = "fuzz_placement_json";
  ExpertStats s;
  s.source = "seed";
  s.num_layers = 2;
  s.num_experts = 4;
  s.tokens = 10;
  s.load = {{5, 1, 3, 1}, {2, 2, 8, 0}};
  put(t, "contiguous.json", make_placement("contiguous", 2, 4, 3, false, nullptr, 0).to_json());
  put(t, "round-robin-coord.json", make_placement("round_robin", 2, 4, 3, true, nullptr, 0).to_json());
  put(t, "replicated.json", make_placement("replicated", 2, 4, 3, false, &s, 2).to_json());
  put(t, "single.json", Placement::single(1, 2).to_json());
  put(t, "minimal.json",
      R"({"format":"colibri-placement","version":1,"world_size":2,"num_layers":1,"num_experts":1,"layers":[[[1]]]})");
}

void config_seeds() {
  const std::string t = "fuzz_config_json";
  put(t, "embedded-a.json", config_a().to_json().dump());
  put(t, "embedded-b.json", config_b().to_json().dump(2));
  put(t, "hf-minimal.json",
      R"({"architectures":["MixtralForCausalLM"],"vocab_size":32,"hidden_size":8,"intermediate_size":16,)"
      R"("num_hidden_layers":2,"num_attention_heads":2,"num_local_experts":4,"num_experts_per_tok":2})");
  put(t, "hf-variants.json",
      R"({"model_type":"mixtral","vocab_size":32,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":1,)"
      R"("num_attention_heads":4,"num_key_value_heads":2,"head_dim":2,"num_local_experts":2,"num_experts_per_tok":1,)"
      R"("max_position_embeddings":64,"sliding_window":null,"rope_theta":500000.0,"rope_scaling":{"type":"default"},)"
      R"("rms_norm_eps":1e-6,"tie_word_embeddings":true,"hidden_act":"silu","bos_token_id":1,"eos_token_id":[2,3]})");
}

void trace_seeds() {
  const std::string t = "fuzz_routing_trace";
  const std::string path = (fs::temp_directory_path() / ("colibri-seed-" + std::to_string(::getpid()) + ".jsonl")).string();
  {
    RoutingTraceWriter w(path, 2, 4, 2);
    const int32_t ex[][2] = {{0, 3}, {2, 1}, {3, 0}, {1, 2}};
    const float wt[2] = {0.75f, 0.25f};
    int i = 0;
    for (int64_t step = 0; step < 2; ++step)
      for (int layer = 0; layer < 2; ++layer)
        for (int pos = 0; pos < (step == 0 ? 2 : 1); ++pos) w.write(step, layer, 0, step == 0 ? pos : 2, ex[i++ % 4], wt, 2);
    w.close();
  }
  put(t, "colibri.jsonl", slurp(path));
  fs::remove(path);
  put(t, "mixtral-token-pos.jsonl",
      R"({"dataset": "humaneval", "problem_id": 0, "layer": 0, "token_pos": 0, "experts": [5, 2], "gating_probs": [0.77, 0.23]})" "\n"
      R"({"dataset": "humaneval", "problem_id": 0, "layer": 0, "token_pos": 1, "experts": [5, 7], "gating_probs": [0.58, 0.42]})" "\n"
      R"({"dataset": "humaneval", "problem_id": 0, "layer": 1, "token_pos": 0, "experts": [1, 2], "gating_probs": [0.6, 0.4]})" "\n"
      R"({"dataset": "humaneval", "problem_id": 0, "layer": 1, "token_pos": 1, "experts": [0, 3], "gating_probs": [0.9, 0.1]})" "\n"
      R"({"dataset": "humaneval", "problem_id": 0, "layer": 0, "token_pos": 0, "experts": [4, 0], "gating_probs": [0.88, 0.12]})" "\n"
      R"({"dataset": "humaneval", "problem_id": 0, "layer": 1, "token_pos": 0, "experts": [6, 3], "gating_probs": [0.5, 0.5]})" "\n");
  put(t, "mixtral-token-idx.jsonl",
      R"({"dataset": "gsm8k", "problem_id": 1, "layer": 0, "experts": [7, 0], "gating_probs": [0.8, 0.2], "token_idx": 0})" "\n"
      R"({"dataset": "gsm8k", "problem_id": 1, "layer": 0, "experts": [5, 6], "gating_probs": [0.76, 0.24], "token_idx": 1})" "\n"
      R"({"dataset": "gsm8k", "problem_id": 0, "layer": 1, "experts": [3, 6], "gating_probs": [0.52, 0.48], "token_idx": 0})" "\n"
      R"({"dataset": "gsm8k", "problem_id": 0, "layer": 0, "experts": [2, 1], "gating_probs": [0.9, 0.1], "token_idx": 0})" "\n");
  ExpertStats s;
  s.source = "seed";
  s.num_layers = 2;
  s.num_experts = 4;
  s.tokens = 10;
  s.load = {{5, 1, 3, 1}, {2, 2, 8, 0}};
  const std::string sp = path + ".stats.json";
  save_expert_stats(s, sp);
  put(t, "stats.json", slurp(sp));
  fs::remove(sp);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR   (writes OUT_DIR/<fuzz target>/<seed>)\n", argv[0]);
    return 2;
  }
  out_root = argv[1];
  try {
    colibri_seeds();
    safetensors_seeds();
    placement_seeds();
    config_seeds();
    trace_seeds();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "make_seeds: %s\n", e.what());
    return 1;
  }
  std::printf("seeds written under %s\n", argv[1]);
  return 0;
}
