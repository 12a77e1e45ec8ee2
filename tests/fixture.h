// fixture.h: loads a transformers fixture (tests/fixtures/<name>: hf/ model,
// expected.json, expected.safetensors) and runs the engine on it.
#pragma once
#include <algorithm>
#include <cmath>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/communicator.h"
#include "coordinator/engine.h"
#include "model/colibri_file.h"
#include "model/converter.h"
#include "model/safetensors.h"
#include "tests/test_util.h"

namespace colibri::test {

inline const std::vector<std::string>& fixture_names() {
  static const std::vector<std::string> n = {
      "mixtral_a",     "mixtral_b",     "mixtral_c",     "qwen2_moe_a",   "qwen2_moe_b",   "qwen3_moe_a",
      "qwen3_moe_b",   "olmoe_a",       "olmoe_b",       "deepseek_v2_a", "deepseek_v2_b", "deepseek_v3_a",
      "deepseek_v3_b", "glm4_moe_a",    "glm4_moe_b",    "gpt_oss_a",     "gpt_oss_b",     "gpt_oss_mxfp4"};
  return n;
}

struct Fixture {
  std::string name, dir;
  std::vector<std::vector<int32_t>> prompts, greedy;
  std::vector<std::vector<float>> prompt_logits, greedy_logits;  // [L][V], [16][V]
  int64_t vocab = 0;
  int new_tokens = 0;

  explicit Fixture(const std::string& n) : name(n), dir(fixtures_dir() + "/" + n) {
    std::ifstream in(dir + "/expected.json");
    auto j = nlohmann::json::parse(in);
    prompts = j["prompts"].get<std::vector<std::vector<int32_t>>>();
    greedy = j["greedy_tokens"].get<std::vector<std::vector<int32_t>>>();
    new_tokens = j["num_new_tokens"].get<int>();
    SafetensorsFile st(dir + "/expected.safetensors");
    for (size_t i = 0; i < prompts.size(); ++i) {
      for (auto [prefix, dst] : {std::pair{"prompt_logits.", &prompt_logits}, std::pair{"greedy_logits.", &greedy_logits}}) {
        const SafeTensor* t = st.find(prefix + std::to_string(i));
        if (!t || t->dtype != DType::F32 || t->shape.size() != 2) throw std::runtime_error("bad fixture tensor " + std::string(prefix));
        vocab = t->shape[1];
        const float* p = reinterpret_cast<const float*>(t->data);
        dst->emplace_back(p, p + t->numel());
      }
    }
  }

  // Converts hf/ into `dir/NAME.DTYPE.colibri`; returns the path.
  std::string convert(const TempDir& tmp, DType dtype) const {
    std::string out = tmp.file(name + "." + dtype_name(dtype) + ".colibri");
    ConvertOptions o;
    o.dtype = dtype;
    convert_checkpoint(dir + "/hf", out, o);
    return out;
  }

  std::vector<Request> requests(bool greedy_run = true) const {
    std::vector<Request> r;
    for (const auto& p : prompts) {
      Request q;
      q.prompt = p;
      q.max_new_tokens = new_tokens;
      q.ignore_eos = true;  // the reference continues through end-of-sequence tokens
      (void)greedy_run;
      r.push_back(q);
    }
    return r;
  }
};

// The fixtures whose experts are stored unquantised (not the mxfp4 ones).
inline std::vector<std::string> unquantised_fixtures() {
  std::vector<std::string> v;
  for (const auto& n : fixture_names())
    if (n.find("mxfp4") == std::string::npos) v.push_back(n);
  return v;
}

inline double rel_l2(const float* a, const float* b, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// The relative L2 error of every prompt position's logits against the
// reference's, sorted ascending (the bf16 tolerances are on its percentiles).
inline std::vector<double> sorted_prompt_errors(const Fixture& fx, const std::vector<SequenceOutput>& out) {
  std::vector<double> rel;
  for (size_t i = 0; i < fx.prompts.size(); ++i)
    for (size_t p = 0; p < fx.prompts[i].size(); ++p)
      rel.push_back(rel_l2(out[i].logits.data() + p * fx.vocab, fx.prompt_logits[i].data() + p * fx.vocab, fx.vocab));
  std::sort(rel.begin(), rel.end());
  return rel;
}

// Runs `reqs` on a one-process engine over `path` and returns the outputs with logits.
inline std::vector<SequenceOutput> run_engine(const std::string& path, const std::vector<Request>& reqs,
                                              EngineOptions eo = {}, GenerateStats* st = nullptr) {
  auto file = ColibriFile::open(path);
  auto comm = make_local_communicator();
  eo.max_batch = std::max<int64_t>(eo.max_batch, static_cast<int64_t>(reqs.size()));
  Engine engine(file, eo, *comm);
  GenerateOptions go;
  go.record_logits = true;
  return engine.generate(reqs, go, st);
}

}  // namespace colibri::test
