// fuzz_config_json.cpp: libFuzzer target for the model-config loaders: the
// embedded form (ModelConfig::from_json, read from every .colibri file) and a
// Hugging Face config.json (ModelConfig::from_hf, read by the converter). The
// text goes through nlohmann::json::parse first, as the callers do (a parse
// error there is the caller's to report). An accepted config must validate,
// give sane buffer sizes, and survive to_json() -> from_json() unchanged.
#include <nlohmann/json.hpp>
#include <string>

#include "fuzz_support.h"
#include "model/colibri_file.h"
#include "model/config.h"

using namespace colibri;
using fuzz::expect_only_colibri_errors;

namespace {

void check_accepted(const ModelConfig& c, const char* how) {
  try {
    c.validate();
  } catch (const std::exception& e) {
    fuzz::finding(how, std::string("accepted a config that validate() rejects: ") + e.what());
  }
  // The sizes the loader and the engine compute from a config must not wrap.
  for (DType dt : {DType::F32, DType::F16, DType::BF16}) {
    const ExpertLayout l = expert_layout(c, dt);
    FUZZ_CHECK(l.size >= l.down_offset && l.down_offset >= l.up_offset && l.size < (uint64_t(1) << 46),
               "expert layout of an accepted config is absurd");
  }
  for (const auto& spec : dense_tensor_specs(c)) {
    unsigned __int128 n = 1;
    for (auto d : spec.shape) {
      FUZZ_CHECK(d >= 1, std::string(how) + ": tensor '" + spec.name + "' gets dimension " + std::to_string(d));
      n *= static_cast<uint64_t>(d);
    }
    FUZZ_CHECK(n < (static_cast<unsigned __int128>(1) << 62), std::string(how) + ": tensor '" + spec.name + "' is absurdly large");
  }
  ModelConfig again;
  const nlohmann::json j = c.to_json();
  try {
    again = ModelConfig::from_json(j);
  } catch (const std::exception& e) {
    fuzz::finding(how, std::string("to_json() does not parse back: ") + e.what() + "\n" + j.dump());
  }
  FUZZ_CHECK(again.to_json() == j, std::string(how) + ": to_json() -> from_json() changed the config: " + j.dump());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(data, data + size);
  } catch (const nlohmann::json::exception&) {
    return 0;
  }
  ModelConfig c;
  if (expect_only_colibri_errors("ModelConfig::from_json", [&] { c = ModelConfig::from_json(j); }))
    check_accepted(c, "ModelConfig::from_json");
  if (expect_only_colibri_errors("ModelConfig::from_hf", [&] { c = ModelConfig::from_hf(j); }))
    check_accepted(c, "ModelConfig::from_hf");
  return 0;
}
