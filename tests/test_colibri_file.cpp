// test_colibri_file.cpp: the .colibri format end to end: synthesize a tiny
// Mixtral checkpoint, convert it (f32, bf16, f16), load it back and check the
// header, config, views, checksums and every converted weight; conversion
// failures leave nothing behind; every kind of corruption and truncation is
// rejected with a typed Error naming the problem.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/colibri_file.h"
#include "model/config.h"
#include "model/converter.h"
#include "model/dtype.h"
#include "model/error.h"
#include "model/safetensors.h"
#include "model/synth.h"
#include "colibri.h"
#include "tests/file_edit.h"
#include "tests/cli_runner.h"
#include "tests/test_util.h"

namespace colibri {
namespace {

namespace fs = std::filesystem;
using test::edit_config;
using test::header_of;
using test::reseal;
using test::set_header;
using test::TempDir;

std::string read_whole(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_whole(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << "cannot write " << path;
}

using test::expect_error;

uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// The Hugging Face name of a canonical dense tensor in a classic Mixtral
// checkpoint (written here independently of the converter's own mapping).
std::string hf_name(const std::string& canon) {
  if (canon == "token_embd") return "model.embed_tokens.weight";
  if (canon == "output_norm") return "model.norm.weight";
  if (canon == "output") return "lm_head.weight";
  const size_t d1 = canon.find('.'), d2 = canon.find('.', d1 + 1);
  const std::string l = canon.substr(d1 + 1, d2 - d1 - 1), what = canon.substr(d2 + 1);
  static const std::map<std::string, std::string> m = {
      {"attn_norm", "input_layernorm.weight"},        {"ffn_norm", "post_attention_layernorm.weight"},
      {"attn_q", "self_attn.q_proj.weight"},          {"attn_k", "self_attn.k_proj.weight"},
      {"attn_v", "self_attn.v_proj.weight"},          {"attn_output", "self_attn.o_proj.weight"},
      {"ffn_gate_inp", "block_sparse_moe.gate.weight"}};
  return "model.layers." + l + "." + m.at(what);
}

std::string expert_name(int l, int e, const char* w) {
  return "model.layers." + std::to_string(l) + ".block_sparse_moe.experts." + std::to_string(e) + "." + w + ".weight";
}

// Compares n stored elements (dtype `dt`) with the f32 source: bit-exact for
// f32, equal to the round-to-nearest-even conversion for bf16/f16.
void expect_converted(const void* stored, DType dt, const uint8_t* src_f32, size_t n, const std::string& what) {
  for (size_t i = 0; i < n; ++i) {
    float s;
    std::memcpy(&s, src_f32 + 4 * i, 4);
    switch (dt) {
      case DType::F32: {
        uint32_t a, b;
        std::memcpy(&a, static_cast<const uint8_t*>(stored) + 4 * i, 4);
        std::memcpy(&b, &s, 4);
        ASSERT_EQ(a, b) << what << " element " << i;
        break;
      }
      case DType::BF16: {
        uint16_t h;
        std::memcpy(&h, static_cast<const uint8_t*>(stored) + 2 * i, 2);
        ASSERT_EQ(h, f32_to_bf16(s)) << what << " element " << i << " (source " << s << ")";
        break;
      }
      case DType::F16: {
        uint16_t h;
        std::memcpy(&h, static_cast<const uint8_t*>(stored) + 2 * i, 2);
        ASSERT_EQ(h, f32_to_f16(s)) << what << " element " << i << " (source " << s << ")";
        break;
      }
    }
  }
}

// Rewrites a checkpoint directory: every tensor of `src` goes through `map`,
// which may drop it (return false) or rename it.
void rewrite_checkpoint(const std::string& src, const std::string& dst,
                        const std::function<bool(std::string& name)>& map) {
  fs::create_directories(dst);
  fs::copy_file(fs::path(src) / "config.json", fs::path(dst) / "config.json", fs::copy_options::overwrite_existing);
  SafetensorsFile in((fs::path(src) / "model.safetensors").string());
  std::vector<SafetensorsWriter::Spec> specs;
  std::vector<const SafeTensor*> keep;
  for (const auto& t : in.tensors()) {
    std::string name = t.name;
    if (!map(name)) continue;
    specs.push_back({name, *t.dtype, t.shape});
    keep.push_back(&t);
  }
  SafetensorsWriter w((fs::path(dst) / "model.safetensors").string(), specs);
  for (const auto* t : keep) w.write_next(t->data, t->nbytes);
  w.finish();
}

// ---------------------------------------------------------------------------
// Shared fixture: one synthesized tiny checkpoint and its conversions.

class ColibriFileTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    seed_ = test::test_seed();
    dir_ = new TempDir();
    hf_ = dir_->file("hf");
    SynthOptions so;
    so.preset = "tiny";
    so.seed = seed_;
    synthesize_model(hf_, so);
    for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
      ConvertOptions co;
      co.dtype = dt;
      const std::string out = model_path(dt);
      results_[static_cast<int>(dt)] = convert_checkpoint(hf_, out, co);
    }
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  static std::string model_path(DType dt) { return dir_->file(std::string("tiny-") + dtype_name(dt) + ".colibri"); }

  static uint64_t seed_;
  static TempDir* dir_;
  static std::string hf_;
  static ConvertResult results_[3];
};

uint64_t ColibriFileTest::seed_ = 0;
TempDir* ColibriFileTest::dir_ = nullptr;
std::string ColibriFileTest::hf_;
ConvertResult ColibriFileTest::results_[3];

TEST_F(ColibriFileTest, HeaderAndLayout) {
  COLIBRI_SEED_TRACE(seed_);
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    SCOPED_TRACE(dtype_name(dt));
    const std::string path = model_path(dt);
    EXPECT_FALSE(test::temp_left(path));
    auto f = ColibriFile::open(path);
    const FileHeader& h = f->header();
    const ModelConfig& c = f->config();
    EXPECT_EQ(std::memcmp(h.magic, "COLIBRI\0", 8), 0);
    EXPECT_EQ(h.version, 1u);
    EXPECT_EQ(h.header_size, 128u);
    EXPECT_EQ(h.alignment, 4096u);
    EXPECT_EQ(h.file_size, fs::file_size(path));
    EXPECT_EQ(h.file_size, f->file_size());
    EXPECT_EQ(h.file_size % 4096, 0u);
    EXPECT_EQ(h.config_offset, 128u);
    EXPECT_EQ(h.tensor_dir_offset, align_up(128 + h.config_size, 8));
    EXPECT_EQ(h.tensor_count, dense_tensor_specs(c).size());
    EXPECT_EQ(h.expert_index_offset, h.tensor_dir_offset + h.tensor_count * 160);
    EXPECT_EQ(h.expert_count, static_cast<uint64_t>(c.num_layers * c.num_experts));
    EXPECT_EQ(h.data_offset, align_up(h.expert_index_offset + h.expert_count * 64, 4096));
    EXPECT_EQ(h.reserved0, 0u);
    for (uint8_t b : h.reserved) EXPECT_EQ(b, 0);

    const std::string raw = read_whole(path);
    ASSERT_EQ(raw.size(), h.file_size);
    EXPECT_EQ(checksum64(raw.data() + h.config_offset, h.data_offset - h.config_offset), h.meta_checksum);
    // The embedded config is exactly ModelConfig::to_json().
    auto embedded = nlohmann::json::parse(raw.substr(h.config_offset, h.config_size));
    EXPECT_EQ(embedded, c.to_json());

    const ConvertResult& res = results_[static_cast<int>(dt)];
    EXPECT_EQ(res.bytes, h.file_size);
    EXPECT_EQ(res.tensors, static_cast<int>(h.tensor_count));
    EXPECT_EQ(res.experts, static_cast<int>(h.expert_count));
    EXPECT_EQ(res.dtype, dt);
    EXPECT_EQ(f->expert_dtype(), dt);
  }
}

TEST_F(ColibriFileTest, ConfigRoundTrip) {
  COLIBRI_SEED_TRACE(seed_);
  std::ifstream in(fs::path(hf_) / "config.json");
  const ModelConfig want = ModelConfig::from_hf(nlohmann::json::parse(in));
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    SCOPED_TRACE(dtype_name(dt));
    auto f = ColibriFile::open(model_path(dt));
    const ModelConfig& c = f->config();
    EXPECT_EQ(c.to_json(), want.to_json());
    // The tiny preset, spelled out.
    EXPECT_EQ(c.architecture, "mixtral");
    EXPECT_EQ(c.vocab_size, 512);
    EXPECT_EQ(c.hidden_size, 128);
    EXPECT_EQ(c.intermediate_size, 256);
    EXPECT_EQ(c.num_layers, 2);
    EXPECT_EQ(c.num_heads, 4);
    EXPECT_EQ(c.num_kv_heads, 2);
    EXPECT_EQ(c.head_dim, 32);
    EXPECT_EQ(c.num_experts, 4);
    EXPECT_EQ(c.experts_per_token, 2);
    EXPECT_EQ(c.max_position_embeddings, 512);
    EXPECT_EQ(c.sliding_window, 0);
    EXPECT_EQ(c.rope_theta, 1e6);
    EXPECT_EQ(c.rms_norm_eps, 1e-5);
    EXPECT_FALSE(c.tie_word_embeddings);
    EXPECT_EQ(c.hidden_act, "silu");
    EXPECT_EQ(c.bos_token_id, 1);
    EXPECT_EQ(c.eos_token_id, 2);
    EXPECT_EQ(c.routing.scoring, "softmax");
    EXPECT_TRUE(c.routing.norm_topk_prob);
    EXPECT_EQ(c.routing.routed_scaling_factor, 1.0f);
    // to_json -> from_json is the identity.
    EXPECT_EQ(ModelConfig::from_json(c.to_json()).to_json(), c.to_json());
  }
}

TEST_F(ColibriFileTest, ViewsLieInsideTheFileAndVerify) {
  COLIBRI_SEED_TRACE(seed_);
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    SCOPED_TRACE(dtype_name(dt));
    auto f = ColibriFile::open(model_path(dt));
    const FileHeader& h = f->header();
    const ModelConfig& c = f->config();
    const auto specs = dense_tensor_specs(c);
    ASSERT_EQ(f->tensors().size(), specs.size());
    const uint8_t* base = f->tensors().front().data - f->tensors().front().offset;
    std::vector<std::pair<uint64_t, uint64_t>> ranges;
    for (size_t i = 0; i < specs.size(); ++i) {
      const TensorView& t = f->tensors()[i];
      SCOPED_TRACE(t.name);
      EXPECT_EQ(t.name, specs[i].name);  // file order is dense_tensor_specs order
      EXPECT_EQ(t.shape, specs[i].shape);
      EXPECT_EQ(t.dtype, specs[i].is_norm ? DType::F32 : dt);
      EXPECT_EQ(t.size, static_cast<uint64_t>(t.numel()) * dtype_size(t.dtype));
      EXPECT_EQ(t.offset % 4096, 0u);
      EXPECT_GE(t.offset, h.data_offset);
      EXPECT_LE(t.offset + t.size, h.file_size);
      EXPECT_EQ(t.data, base + t.offset);
      EXPECT_EQ(checksum64(t.data, t.size), t.checksum);
      EXPECT_NO_THROW(f->verify_tensor(t));
      EXPECT_EQ(&f->tensor(t.name), &t);
      ranges.push_back({t.offset, t.offset + t.size});
    }
    EXPECT_EQ(f->find("blk.99.attn_q"), nullptr);
    expect_error([&] { f->tensor("blk.99.attn_q"); }, Status::Format, {"missing tensor 'blk.99.attn_q'"});

    const ExpertLayout lay = expert_layout(c, dt);
    EXPECT_EQ(lay.gate_offset, 0u);
    EXPECT_EQ(lay.up_offset % 64, 0u);
    EXPECT_EQ(lay.down_offset % 64, 0u);
    const uint64_t mat = static_cast<uint64_t>(c.intermediate_size * c.hidden_size) * dtype_size(dt);
    EXPECT_EQ(lay.up_offset, align_up(mat, 64));
    EXPECT_EQ(lay.down_offset, lay.up_offset + align_up(mat, 64));
    EXPECT_EQ(lay.size, lay.down_offset + mat);
    ASSERT_EQ(f->experts().size(), static_cast<size_t>(c.num_layers * c.num_experts));
    for (int l = 0; l < c.num_layers; ++l)
      for (int e = 0; e < c.num_experts; ++e) {
        SCOPED_TRACE("layer " + std::to_string(l) + " expert " + std::to_string(e));
        const ExpertView& x = f->expert(l, e);
        EXPECT_EQ(&x, &f->experts()[static_cast<size_t>(l * c.num_experts + e)]);
        EXPECT_EQ(x.layer, l);
        EXPECT_EQ(x.expert, e);
        EXPECT_EQ(x.dtype, dt);
        EXPECT_EQ(x.size, lay.size);
        EXPECT_EQ(x.offset % 4096, 0u);
        EXPECT_GE(x.offset, h.data_offset);
        EXPECT_LE(x.offset + x.size, h.file_size);
        EXPECT_EQ(x.block, base + x.offset);
        EXPECT_EQ(x.gate, x.block + lay.gate_offset);
        EXPECT_EQ(x.up, x.block + lay.up_offset);
        EXPECT_EQ(x.down, x.block + lay.down_offset);
        EXPECT_EQ(checksum64(x.block, x.size), x.checksum);
        EXPECT_NO_THROW(f->verify_expert(x));
        ranges.push_back({x.offset, x.offset + x.size});
      }
    std::sort(ranges.begin(), ranges.end());
    for (size_t i = 1; i < ranges.size(); ++i) EXPECT_LE(ranges[i - 1].second, ranges[i].first) << "blocks overlap";
    expect_error([&] { f->expert(c.num_layers, 0); }, Status::InvalidArgument, {"out of range"});
    expect_error([&] { f->expert(0, -1); }, Status::InvalidArgument, {"out of range"});
  }
}

TEST_F(ColibriFileTest, ConvertedWeightsEqualTheSource) {
  COLIBRI_SEED_TRACE(seed_);
  SafetensorsFile src((fs::path(hf_) / "model.safetensors").string());
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    SCOPED_TRACE(dtype_name(dt));
    auto f = ColibriFile::open(model_path(dt));
    const ModelConfig& c = f->config();
    for (const TensorView& t : f->tensors()) {
      const SafeTensor* s = src.find(hf_name(t.name));
      ASSERT_NE(s, nullptr) << t.name;
      ASSERT_EQ(*s->dtype, DType::F32);
      ASSERT_EQ(s->shape, t.shape) << t.name;
      expect_converted(t.data, t.dtype, s->data, static_cast<size_t>(t.numel()), t.name);
    }
    const size_t mat = static_cast<size_t>(c.intermediate_size * c.hidden_size);
    for (int l = 0; l < c.num_layers; ++l)
      for (int e = 0; e < c.num_experts; ++e) {
        const ExpertView& x = f->expert(l, e);
        const std::string who = "layer " + std::to_string(l) + " expert " + std::to_string(e);
        const SafeTensor* w1 = src.find(expert_name(l, e, "w1"));
        const SafeTensor* w2 = src.find(expert_name(l, e, "w2"));
        const SafeTensor* w3 = src.find(expert_name(l, e, "w3"));
        ASSERT_TRUE(w1 && w2 && w3) << who;
        EXPECT_EQ(w1->shape, (std::vector<int64_t>{c.intermediate_size, c.hidden_size}));
        EXPECT_EQ(w2->shape, (std::vector<int64_t>{c.hidden_size, c.intermediate_size}));
        expect_converted(x.gate, dt, w1->data, mat, who + " gate (w1)");
        expect_converted(x.up, dt, w3->data, mat, who + " up (w3)");
        expect_converted(x.down, dt, w2->data, mat, who + " down (w2)");
      }
  }
}

TEST_F(ColibriFileTest, DefaultDtypeIsTheCheckpoints) {
  COLIBRI_SEED_TRACE(seed_);
  TempDir d;
  SynthOptions so;
  so.seed = seed_;
  so.dtype = DType::BF16;
  synthesize_model(d.file("hf"), so);
  const std::string out = d.file("m.colibri");
  ConvertResult r = convert_checkpoint(d.file("hf"), out, ConvertOptions{});
  EXPECT_EQ(r.dtype, DType::BF16);
  auto f = ColibriFile::open(out);
  EXPECT_EQ(f->expert_dtype(), DType::BF16);
  // bf16 -> bf16 is a copy; norms are widened to f32 exactly.
  SafetensorsFile src(d.file("hf/model.safetensors"));
  for (const TensorView& t : f->tensors()) {
    const SafeTensor* s = src.find(hf_name(t.name));
    ASSERT_NE(s, nullptr);
    std::vector<uint8_t> want(t.size);
    convert_elements(s->data, DType::BF16, want.data(), t.dtype, static_cast<size_t>(t.numel()));
    EXPECT_EQ(std::memcmp(want.data(), t.data, t.size), 0) << t.name;
  }
  const ExpertView& x = f->expert(1, 3);
  EXPECT_EQ(std::memcmp(x.down, src.find(expert_name(1, 3, "w2"))->data, src.find(expert_name(1, 3, "w2"))->nbytes), 0);
}

// Same weights in a sharded checkpoint, and in the transformers-5 fused expert
// layout, convert to the same bytes.
TEST_F(ColibriFileTest, ShardedAndFusedCheckpointsConvertIdentically) {
  COLIBRI_SEED_TRACE(seed_);
  TempDir d;
  auto ref = ColibriFile::open(model_path(DType::BF16));
  const ModelConfig& c = ref->config();

  SynthOptions so;
  so.seed = seed_;
  so.shard_bytes = 512 << 10;
  synthesize_model(d.file("sharded"), so);
  ASSERT_TRUE(fs::exists(d.file("sharded/model.safetensors.index.json")));
  ASSERT_FALSE(fs::exists(d.file("sharded/model.safetensors")));

  // Fused: mlp.gate.weight, mlp.experts.gate_up_proj [E, 2I, H] (gate rows
  // first), mlp.experts.down_proj [E, H, I].
  {
    const std::string dst = d.file("fused");
    fs::create_directories(dst);
    fs::copy_file(fs::path(hf_) / "config.json", fs::path(dst) / "config.json");
    SafetensorsFile in((fs::path(hf_) / "model.safetensors").string());
    const int64_t E = c.num_experts, I = c.intermediate_size, H = c.hidden_size;
    std::vector<SafetensorsWriter::Spec> specs;
    std::vector<std::string> bytes;
    for (const auto& t : in.tensors()) {
      if (t.name.find(".experts.") != std::string::npos) continue;
      std::string name = t.name;
      auto p = name.find("block_sparse_moe.gate.weight");
      if (p != std::string::npos) name.replace(p, std::string("block_sparse_moe").size(), "mlp");
      specs.push_back({name, DType::F32, t.shape});
      bytes.emplace_back(reinterpret_cast<const char*>(t.data), t.nbytes);
    }
    for (int l = 0; l < c.num_layers; ++l) {
      std::string gu, dn;
      for (int e = 0; e < E; ++e) {
        for (const char* w : {"w1", "w3"}) {
          const SafeTensor* t = in.find(expert_name(l, e, w));
          gu.append(reinterpret_cast<const char*>(t->data), t->nbytes);
        }
        const SafeTensor* t = in.find(expert_name(l, e, "w2"));
        dn.append(reinterpret_cast<const char*>(t->data), t->nbytes);
      }
      const std::string L = "model.layers." + std::to_string(l) + ".mlp.experts.";
      specs.push_back({L + "gate_up_proj", DType::F32, {E, 2 * I, H}});
      bytes.push_back(gu);
      specs.push_back({L + "down_proj", DType::F32, {E, H, I}});
      bytes.push_back(dn);
    }
    SafetensorsWriter w((fs::path(dst) / "model.safetensors").string(), specs);
    for (const auto& b : bytes) w.write_next(b.data(), b.size());
    w.finish();
  }

  for (const char* variant : {"sharded", "fused"}) {
    SCOPED_TRACE(variant);
    ConvertOptions co;
    co.dtype = DType::BF16;
    const std::string out = d.file(std::string(variant) + ".colibri");
    convert_checkpoint(d.file(variant), out, co);
    auto f = ColibriFile::open(out);
    EXPECT_TRUE(read_whole(out) == read_whole(model_path(DType::BF16))) << "not byte-identical";
    ASSERT_EQ(f->tensors().size(), ref->tensors().size());
    for (size_t i = 0; i < f->tensors().size(); ++i)
      EXPECT_EQ(f->tensors()[i].checksum, ref->tensors()[i].checksum) << f->tensors()[i].name;
    for (size_t i = 0; i < f->experts().size(); ++i) EXPECT_EQ(f->experts()[i].checksum, ref->experts()[i].checksum);
  }
}

TEST_F(ColibriFileTest, ProgressIsMonotonic) {
  TempDir d;
  std::vector<uint64_t> done;
  uint64_t total = 0;
  ConvertOptions co;
  co.progress = [&](uint64_t a, uint64_t t, const std::string&) {
    done.push_back(a);
    total = t;
  };
  ConvertResult r = convert_checkpoint(hf_, d.file("m.colibri"), co);
  ASSERT_EQ(done.size(), static_cast<size_t>(r.tensors + r.experts));
  // The total counts tensor and expert data (not metadata or padding), and
  // the last report reaches it: progress ends at 100%.
  EXPECT_LE(total, r.bytes);
  EXPECT_TRUE(std::is_sorted(done.begin(), done.end()));
  EXPECT_EQ(done.back(), total);
}

// ---------------------------------------------------------------------------
// Failing conversions leave neither OUT nor OUT.tmp.

TEST_F(ColibriFileTest, FailedConversionLeavesNothing) {
  TempDir d;
  struct Case {
    const char* name;
    std::function<void(const std::string& dir)> make;  // builds the input directory
    Status status;
    std::vector<std::string> needles;
  };
  auto set_config = [](const std::string& dir, const std::function<void(nlohmann::json&)>& edit) {
    std::ifstream in(fs::path(dir) / "config.json");
    nlohmann::json j = nlohmann::json::parse(in);
    in.close();
    edit(j);
    std::ofstream(fs::path(dir) / "config.json") << j.dump(2);
  };
  const std::string hf = hf_;
  const std::vector<Case> cases = {
      {"unknown architecture",
       [&](const std::string& dir) {
         rewrite_checkpoint(hf, dir, [](std::string&) { return true; });
         set_config(dir, [](nlohmann::json& j) { j["architectures"] = {"LlamaForCausalLM"}; });
       },
       Status::Unsupported,
       {"unsupported architecture 'LlamaForCausalLM'", "supported: MixtralForCausalLM"}},
      {"checkpoint missing one expert tensor",
       [&](const std::string& dir) {
         rewrite_checkpoint(hf, dir, [](std::string& n) { return n != expert_name(1, 2, "w3"); });
       },
       Status::Format,
       {"checkpoint has no tensor '" + expert_name(1, 2, "w3") + "'"}},
      {"dense tensor with the wrong shape",
       [&](const std::string& dir) {
         // Half the heads (head_dim stays 32): q_proj [128, 128] no longer fits.
         rewrite_checkpoint(hf, dir, [](std::string&) { return true; });
         set_config(dir, [](nlohmann::json& j) { j["num_attention_heads"] = 2; j["num_key_value_heads"] = 2; });
       },
       Status::Format,
       {"tensor 'model.layers.0.self_attn.q_proj.weight' has shape [128, 128], expected [64, 128]"}},
      {"no config.json",
       [&](const std::string& dir) {
         rewrite_checkpoint(hf, dir, [](std::string&) { return true; });
         fs::remove(fs::path(dir) / "config.json");
       },
       Status::Io,
       {"has no config.json"}},
      {"config.json not JSON",
       [&](const std::string& dir) {
         rewrite_checkpoint(hf, dir, [](std::string&) { return true; });
         std::ofstream(fs::path(dir) / "config.json") << "{\"architectures\": [";
       },
       Status::Format,
       {"config.json: not valid JSON"}},
      {"no weights",
       [&](const std::string& dir) {
         rewrite_checkpoint(hf, dir, [](std::string&) { return true; });
         fs::remove(fs::path(dir) / "model.safetensors");
       },
       Status::Io,
       {"has neither model.safetensors nor model.safetensors.index.json"}},
  };
  int i = 0;
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string in = d.file("in" + std::to_string(i)), out = d.file("out" + std::to_string(i) + ".colibri");
    ++i;
    c.make(in);
    expect_error([&] { convert_checkpoint(in, out, ConvertOptions{}); }, c.status, c.needles);
    EXPECT_FALSE(fs::exists(out));
    EXPECT_FALSE(test::temp_left(out));
    // An existing OUT is left untouched.
    write_whole(out, "previous contents");
    expect_error([&] { convert_checkpoint(in, out, ConvertOptions{}); }, c.status, c.needles);
    EXPECT_EQ(read_whole(out), "previous contents");
    EXPECT_FALSE(test::temp_left(out));
  }
  // Converting into an existing directory is refused before any work.
  fs::create_directories(d.file("outdir"));
  expect_error([&] { convert_checkpoint(hf_, d.file("outdir"), ConvertOptions{}); }, Status::InvalidArgument,
               {"outdir", "is a directory"});
  EXPECT_FALSE(test::temp_left(d.file("outdir")));
  EXPECT_TRUE(fs::is_directory(d.file("outdir")));
  // Into a directory that does not exist: nothing is created.
  expect_error([&] { convert_checkpoint(hf_, d.file("no/such/m.colibri"), ConvertOptions{}); }, Status::Io,
               {"cannot create", "no/such/m.colibri"});
}

// ---------------------------------------------------------------------------
// Corruption (table-driven)


size_t tensor_pos(const std::string& b, const std::string& name) {
  const FileHeader h = header_of(b);
  for (uint64_t i = 0; i < h.tensor_count; ++i) {
    const size_t pos = h.tensor_dir_offset + i * sizeof(TensorRecord);
    if (std::string(b.data() + pos) == name) return pos;
  }
  ADD_FAILURE() << "no tensor record " << name;
  return 0;
}
TensorRecord tensor_rec(const std::string& b, const std::string& name) {
  TensorRecord r;
  std::memcpy(&r, b.data() + tensor_pos(b, name), sizeof r);
  return r;
}
void set_tensor_rec(std::string& b, const std::string& name, const TensorRecord& r) {
  std::memcpy(b.data() + tensor_pos(b, name), &r, sizeof r);
}
size_t expert_pos(const std::string& b, size_t i) { return header_of(b).expert_index_offset + i * sizeof(ExpertRecord); }
ExpertRecord expert_rec(const std::string& b, size_t i) {
  ExpertRecord r;
  std::memcpy(&r, b.data() + expert_pos(b, i), sizeof r);
  return r;
}
void set_expert_rec(std::string& b, size_t i, const ExpertRecord& r) { std::memcpy(b.data() + expert_pos(b, i), &r, sizeof r); }



struct Corruption {
  const char* name;
  std::function<void(std::string&)> corrupt;
  Status status;
  std::vector<std::string> needles;
};

template <typename F>
std::function<void(std::string&)> header_edit(F f) {
  return [f](std::string& b) {
    FileHeader h = header_of(b);
    f(h, b);
    set_header(b, h);
  };
}
template <typename F>
std::function<void(std::string&)> tensor_edit(const std::string& name, F f) {
  return [name, f](std::string& b) {
    TensorRecord r = tensor_rec(b, name);
    f(r, b);
    set_tensor_rec(b, name, r);
    reseal(b);
  };
}
template <typename F>
std::function<void(std::string&)> expert_edit(size_t i, F f) {
  return [i, f](std::string& b) {
    ExpertRecord r = expert_rec(b, i);
    f(r, b);
    set_expert_rec(b, i, r);
    reseal(b);
  };
}

std::vector<Corruption> corruptions() {
  using H = FileHeader;
  using T = TensorRecord;
  using X = ExpertRecord;
  using S = std::string;
  return {
      // Header
      {"bad magic", [](S& b) { b[0] = 'X'; }, Status::Format, {"not a .colibri file (bad magic)"}},
      {"GGUF magic", [](S& b) { std::memcpy(b.data(), "GGUF\3\0\0\0", 8); }, Status::Format, {"bad magic"}},
      {"unknown version", header_edit([](H& h, S&) { h.version = 2; }), Status::Unsupported,
       {"format version 2 is not supported (this build reads version 1)"}},
      {"version 0", header_edit([](H& h, S&) { h.version = 0; }), Status::Unsupported, {"format version 0"}},
      {"header_size wrong", header_edit([](H& h, S&) { h.header_size = 64; }), Status::Format, {"header size 64 != 128"}},
      {"alignment wrong", header_edit([](H& h, S&) { h.alignment = 512; }), Status::Format, {"alignment 512 != 4096"}},
      {"file truncated (file_size mismatch)", [](S& b) { b.resize(b.size() - 4096); }, Status::Format,
       {"but its header says", "(truncated or appended to)"}},
      {"appended bytes", [](S& b) { b.append(100, '\0'); }, Status::Format, {"(truncated or appended to)"}},
      {"file_size field wrong", header_edit([](H& h, S&) { h.file_size += 4096; }), Status::Format,
       {"(truncated or appended to)"}},
      {"config offset wrong", header_edit([](H& h, S&) { h.config_offset = 256; }), Status::Format,
       {"config offset 256 != 128"}},
      {"config size 0", header_edit([](H& h, S&) { h.config_size = 0; }), Status::Format, {"config size 0 is out of range"}},
      {"config size over 16 MiB", header_edit([](H& h, S&) { h.config_size = (16u << 20) + 1; }), Status::Format,
       {"config size 16777217 is out of range"}},
      {"config size past the end", header_edit([](H& h, S&) { h.config_size = h.file_size; }), Status::Format,
       {"is out of range"}},
      {"config size cuts the JSON short", header_edit([](H& h, S&) { h.config_size -= 10; }), Status::Format,
       {"embedded config is not valid JSON"}},
      {"absurd tensor count", header_edit([](H& h, S&) { h.tensor_count = 2000000; }), Status::Format,
       {"absurd tensor or expert count"}},
      {"absurd expert count", header_edit([](H& h, S&) { h.expert_count = ~0ull; }), Status::Format,
       {"absurd tensor or expert count"}},
      {"tensor directory overlaps the config", header_edit([](H& h, S&) { h.tensor_dir_offset = 200; }), Status::Format,
       {"tensor directory [200, +", "outside the file or overlaps the config"}},
      {"tensor directory past the end", header_edit([](H& h, S&) { h.tensor_dir_offset = h.file_size; }),
       Status::Format, {"outside the file or overlaps the config"}},
      {"expert index overlaps the directory",
       header_edit([](H& h, S&) { h.expert_index_offset = h.tensor_dir_offset + 160; }), Status::Format,
       {"expert index is outside the file or overlaps the tensor directory"}},
      {"data offset misaligned", header_edit([](H& h, S&) { h.data_offset += 8; }), Status::Format,
       {"is misplaced or not 4096-aligned"}},
      {"data offset past the end", header_edit([](H& h, S&) { h.data_offset = h.file_size + 4096; }), Status::Format,
       {"is misplaced or not 4096-aligned"}},
      {"tensor count one short", header_edit([](H& h, S&) { h.tensor_count -= 1; }), Status::Format,
       {"missing tensor 'output' required by the config"}},
      {"expert count one short", header_edit([](H& h, S&) { h.expert_count -= 1; }), Status::Format,
       {"expert index has 7 entries; the config needs 8 (2 MoE layers x 4 experts)"}},
      // Checksum of the metadata region
      {"byte flipped in the config JSON", [](S& b) { b[header_of(b).config_offset + 20] ^= 0x01; }, Status::Checksum,
       {"checksum mismatch in the config, tensor directory or expert index"}},
      {"byte flipped in the tensor directory", [](S& b) { b[header_of(b).tensor_dir_offset + 100] ^= 0x10; },
       Status::Checksum, {"checksum mismatch in the config"}},
      {"byte flipped in the expert index", [](S& b) { b[header_of(b).expert_index_offset + 9] ^= 0x80; },
       Status::Checksum, {"checksum mismatch in the config"}},
      {"byte flipped in the padding before the data",
       [](S& b) { b[header_of(b).data_offset - 1] ^= 0x01; }, Status::Checksum, {"checksum mismatch in the config"}},
      // The embedded config (resealed)
      {"config JSON broken",
       [](S& b) { edit_config(b, "\"vocab_size\":", "\"vocab_size\"!"); reseal(b); }, Status::Format,
       {"embedded config is not valid JSON"}},
      {"config value invalid",
       [](S& b) { edit_config(b, "\"hidden_act\": \"silu\"", "\"hidden_act\": \"gelu\""); reseal(b); }, Status::Format,
       {"hidden_act 'gelu' is not supported"}},
      {"config field missing",
       [](S& b) { edit_config(b, "\"head_dim\"", "\"head_dxm\""); reseal(b); }, Status::Format,
       {"missing required field 'head_dim'"}},
      {"config disagrees with the tensors",
       [](S& b) { edit_config(b, "\"num_heads\": 4", "\"num_heads\": 2"); reseal(b); }, Status::Format,
       {"tensor 'blk.0.attn_q' has the wrong shape for the config (expected [64, 128])"}},
      // Tensor records (resealed)
      {"tensor offset past the end", tensor_edit("blk.0.attn_q", [](T& r, S& b) { r.offset = header_of(b).file_size; }),
       Status::Format, {"tensor 'blk.0.attn_q' [", "lies outside the data region"}},
      {"tensor offset before the data", tensor_edit("blk.0.attn_q", [](T& r, S&) { r.offset = 0; }), Status::Format,
       {"tensor 'blk.0.attn_q' [0, +", "lies outside the data region"}},
      {"tensor offset misaligned", tensor_edit("blk.0.attn_q", [](T& r, S&) { r.offset += 64; }), Status::Format,
       {"tensor 'blk.0.attn_q' offset", "is not 4096-aligned"}},
      {"tensors overlapping",
       tensor_edit("blk.0.attn_norm", [](T& r, S& b) { r.offset = tensor_rec(b, "token_embd").offset + 4096; }),
       Status::Format, {"tensor 'token_embd' and tensor 'blk.0.attn_norm' overlap"}},
      {"tensor overlapping an expert block",
       tensor_edit("output_norm", [](T& r, S& b) { r.offset = expert_rec(b, 3).offset; }), Status::Format,
       {"overlap", "tensor 'output_norm'", "expert 3 of layer 0"}},
      {"tensor dtype invalid", tensor_edit("blk.1.attn_v", [](T& r, S&) { r.dtype = 3; }), Status::Format,
       {"tensor 'blk.1.attn_v' has invalid dtype 3"}},
      {"tensor with 0 dimensions", tensor_edit("blk.1.attn_v", [](T& r, S&) { r.ndim = 0; }), Status::Format,
       {"tensor 'blk.1.attn_v' has 0 dimensions"}},
      {"tensor with 5 dimensions", tensor_edit("blk.1.attn_v", [](T& r, S&) { r.ndim = 5; }), Status::Format,
       {"has 5 dimensions"}},
      {"absurd dimension", tensor_edit("blk.1.attn_v", [](T& r, S&) { r.shape[0] = int64_t(1) << 40; }), Status::Format,
       {"tensor 'blk.1.attn_v' has dimension 1099511627776"}},
      {"negative dimension", tensor_edit("blk.1.attn_v", [](T& r, S&) { r.shape[1] = -128; }), Status::Format,
       {"has dimension -128"}},
      {"absurdly many elements",
       tensor_edit("blk.1.attn_v",
                   [](T& r, S&) {
                     r.ndim = 4;
                     r.shape[0] = r.shape[1] = r.shape[2] = int64_t(1) << 21;
                     r.shape[3] = 1;
                   }),
       Status::Format, {"tensor 'blk.1.attn_v' is absurdly large"}},
      {"dtype/size mismatch", tensor_edit("blk.1.attn_v", [](T& r, S&) { r.dtype = 2; }), Status::Format,
       {"tensor 'blk.1.attn_v' size 32768 does not match its shape and dtype (16384 bytes)"}},
      {"size field wrong", tensor_edit("blk.1.attn_v", [](T& r, S&) { r.size += 4; }), Status::Format,
       {"does not match its shape and dtype"}},
      {"tensor wrong shape for the config",
       tensor_edit("blk.0.attn_k", [](T& r, S&) { std::swap(r.shape[0], r.shape[1]); }), Status::Format,
       {"tensor 'blk.0.attn_k' has the wrong shape for the config (expected [64, 128])"}},
      {"missing required tensor", tensor_edit("output", [](T& r, S&) { r.name[5] = 'X'; }), Status::Format,
       {"missing tensor 'output' required by the config"}},
      {"duplicate tensor name", tensor_edit("blk.1.attn_v", [](T& r, S&) { std::strcpy(r.name, "blk.1.attn_k"); }),
       Status::Format, {"tensor 'blk.1.attn_k' appears twice"}},
      {"empty tensor name", tensor_edit("blk.1.attn_v", [](T& r, S&) { std::memset(r.name, 0, sizeof r.name); }),
       Status::Format, {"has an empty or unterminated name"}},
      {"unterminated tensor name", tensor_edit("blk.1.attn_v", [](T& r, S&) { std::memset(r.name, 'a', sizeof r.name); }),
       Status::Format, {"has an empty or unterminated name"}},
      // Expert records (resealed)
      {"expert record duplicated",
       expert_edit(1, [](X& r, S& b) {
         ExpertRecord first = expert_rec(b, 0);
         r.layer = first.layer;
         r.expert = first.expert;
       }),
       Status::Format, {"expert 0 of layer 0 appears twice in the expert index"}},
      {"expert out of range", expert_edit(1, [](X& r, S&) { r.expert = 4; }), Status::Format,
       {"expert record 1 names (layer 0, expert 4), outside the config"}},
      {"expert layer out of range", expert_edit(5, [](X& r, S&) { r.layer = 2; }), Status::Format,
       {"expert record 5 names (layer 2, expert 1), outside the config"}},
      {"expert dtype invalid", expert_edit(2, [](X& r, S&) { r.dtype = 9; }), Status::Format,
       {"expert 2 of layer 0 has invalid dtype 9"}},
      {"expert block size wrong", expert_edit(2, [](X& r, S&) { r.size -= 64; }), Status::Format,
       {"expert 2 of layer 0 block layout", "does not match the config"}},
      {"expert matrix offset wrong", expert_edit(2, [](X& r, S&) { r.down_offset += 64; }), Status::Format,
       {"block layout"}},
      {"expert offset misaligned", expert_edit(6, [](X& r, S&) { r.offset += 2048; }), Status::Format,
       {"expert 2 of layer 1 offset", "is not 4096-aligned"}},
      {"expert offset past the end", expert_edit(7, [](X& r, S& b) { r.offset = header_of(b).file_size; }),
       Status::Format, {"expert 3 of layer 1 [", "lies outside the data region"}},
      {"expert blocks overlapping", expert_edit(5, [](X& r, S& b) { r.offset = expert_rec(b, 4).offset; }),
       Status::Format, {"expert", "overlap"}},
  };
}

TEST_F(ColibriFileTest, CorruptedFilesAreRejected) {
  COLIBRI_SEED_TRACE(seed_);
  const std::string good = read_whole(model_path(DType::F32));
  ASSERT_NO_THROW(ColibriFile::open(model_path(DType::F32)));
  TempDir d;
  int i = 0;
  for (const auto& c : corruptions()) {
    SCOPED_TRACE(c.name);
    std::string b = good;
    c.corrupt(b);
    ASSERT_NE(b, good);
    const std::string path = d.file("bad" + std::to_string(i++) + ".colibri");
    write_whole(path, b);
    std::vector<std::string> needles = c.needles;
    needles.push_back(path);  // every message names the file
    expect_error([&] { ColibriFile::open(path); }, c.status, needles);
    ColibriFile::Options lazy;
    lazy.verify_dense = false;
    expect_error([&] { ColibriFile::open(path, lazy); }, c.status, c.needles);
    // The same file through the command line and the C API: a specific exit
    // code and message (never a signal), a specific status.
    for (const std::vector<std::string>& args :
         {std::vector<std::string>{"inspect", path}, {"generate", "--model", path, "--prompt-ids", "1,2", "-n", "2"}}) {
      auto r = test::run_cli(d, args);
      EXPECT_TRUE(r.exited) << args[0] << " was killed by signal " << r.code << "\n" << r.err;
      EXPECT_EQ(r.code, exit_code(c.status)) << args[0] << ": " << r.err;
      EXPECT_NE(r.err.find(c.needles.front()), std::string::npos) << args[0] << " said: " << r.err;
    }
    colibri_model* m = nullptr;
    EXPECT_EQ(colibri_init(path.c_str(), nullptr, &m), static_cast<colibri_status>(c.status)) << colibri_last_error();
    EXPECT_EQ(m, nullptr);
  }
}

// Experts in two dtypes of the same size (bf16 and f16) pass the layout check
// but not the single-dtype rule.
TEST_F(ColibriFileTest, ExpertsInTwoDtypesAreRejected) {
  std::string b = read_whole(model_path(DType::BF16));
  ExpertRecord r = expert_rec(b, 3);
  ASSERT_EQ(r.dtype, static_cast<uint32_t>(DType::BF16));
  r.dtype = static_cast<uint32_t>(DType::F16);
  set_expert_rec(b, 3, r);
  reseal(b);
  TempDir d;
  write_whole(d.file("x.colibri"), b);
  expect_error([&] { ColibriFile::open(d.file("x.colibri")); }, Status::Format, {"experts are stored in more than one dtype"});
}

// A shape whose element count wraps around 2^64 must not pass as a 0-byte
// tensor. The config is edited so "output" is no longer required (tied
// embeddings), making it an extra tensor whose shape is not checked against
// the config.
// DISABLED: fails against model/colibri_file.cpp, whose element-count guard
// (numel > 2^40 before multiplying by a dimension of up to 2^32) lets the
// product wrap (see the bug report); enable once the library is fixed.
TEST_F(ColibriFileTest, ShapeWhoseElementCountWrapsIsRejected) {
  std::string b = read_whole(model_path(DType::F32));
  edit_config(b, "\"tie_word_embeddings\": false", "\"tie_word_embeddings\": true ");
  TensorRecord r = tensor_rec(b, "output");
  r.ndim = 2;
  r.shape[0] = int64_t(1) << 32;
  r.shape[1] = int64_t(1) << 32;
  r.size = 0;  // 2^64 elements * 4 bytes wraps to 0
  r.checksum = checksum64("", 0);  // so only the shape check can catch it
  set_tensor_rec(b, "output", r);
  reseal(b);
  TempDir d;
  write_whole(d.file("x.colibri"), b);
  expect_error([&] { ColibriFile::open(d.file("x.colibri")); }, Status::Format, {"tensor 'output' is absurdly large"});
}

// A 1-dimension tensor of 2^32 elements is at the limit and still checked
// against the bytes it claims (no wrap with one dimension).
TEST_F(ColibriFileTest, LargestDimensionIsCheckedAgainstItsSize) {
  std::string b = read_whole(model_path(DType::F32));
  edit_config(b, "\"tie_word_embeddings\": false", "\"tie_word_embeddings\": true ");
  TensorRecord r = tensor_rec(b, "output");
  r.ndim = 1;
  r.shape[0] = int64_t(1) << 32;
  set_tensor_rec(b, "output", r);
  reseal(b);
  TempDir d;
  write_whole(d.file("x.colibri"), b);
  expect_error([&] { ColibriFile::open(d.file("x.colibri")); }, Status::Format,
               {"tensor 'output' size 262144 does not match its shape and dtype (17179869184 bytes)"});
}

// Tensor names from the file holding a terminal escape, bytes that are not
// UTF-8, or a backslash: `inspect` prints them escaped (\xNN, a backslash as
// \\: distinct names stay distinct), never raw; `inspect --json` parses and
// holds the same escaped name (it died with an internal error on the 0xff);
// and the error messages naming them (a checksum mismatch) are escaped too.
TEST_F(ColibriFileTest, InspectEscapesNamesFromTheFile) {
  struct Case {
    std::string raw, shown;
  };
  const std::vector<Case> cases = {{"out\x1b[31mput", "out\\x1b[31mput"},
                                   {std::string("out\xff\xfeput"), "out\\xff\\xfeput"},
                                   {"out\\x1b[31mput", "out\\\\x1b[31mput"},
                                   {"a\x7f\xc2\x9b\xc3\xa9\x01", "a\\x7f\\xc2\\x9b\xc3\xa9\\x01"}};
  const std::string good = read_whole(model_path(DType::F32));
  TempDir d;
  int k = 0;
  for (const auto& c : cases) {
    SCOPED_TRACE("shown as " + c.shown);
    // "output" becomes an extra tensor (tied embeddings), free to have any name.
    std::string b = good;
    edit_config(b, "\"tie_word_embeddings\": false", "\"tie_word_embeddings\": true ");
    TensorRecord r = tensor_rec(b, "output");
    std::memset(r.name, 0, sizeof r.name);
    std::memcpy(r.name, c.raw.data(), c.raw.size());
    set_tensor_rec(b, "output", r);
    reseal(b);
    const std::string path = d.file("names" + std::to_string(k++) + ".colibri");
    write_whole(path, b);
    auto f = ColibriFile::open(path);
    ASSERT_NE(f->find(c.raw), nullptr);

    auto text = test::run_cli(d, {"inspect", path});
    ASSERT_TRUE(text.exited) << "killed by signal " << text.code;
    EXPECT_EQ(text.code, 0) << text.err;
    EXPECT_EQ(text.out.find('\x1b'), std::string::npos) << "a raw ESC byte in: " << text.out;
    EXPECT_EQ(text.out.find(c.raw), std::string::npos) << "the raw name is printed";
    EXPECT_NE(text.out.find(c.shown + " "), std::string::npos) << text.out;

    auto js = test::run_cli(d, {"inspect", "--json", path});
    ASSERT_TRUE(js.exited) << "killed by signal " << js.code;
    EXPECT_EQ(js.code, 0) << js.err;
    EXPECT_EQ(js.out.find('\x1b'), std::string::npos);
    nlohmann::json j;
    ASSERT_NO_THROW(j = nlohmann::json::parse(js.out)) << js.out.substr(0, 400);
    std::vector<std::string> names;
    for (const auto& t : j["tensors"]) names.push_back(t["name"].get<std::string>());
    EXPECT_NE(std::find(names.begin(), names.end(), c.shown), names.end()) << "the JSON lacks the escaped name";
    EXPECT_NE(std::find(names.begin(), names.end(), "token_embd"), names.end());

    // A checksum mismatch in that tensor: --verify's report and the error of a
    // command that loads the model name it escaped.
    b[tensor_rec(b, c.raw).offset] ^= 0x10;
    write_whole(path, b);
    for (const std::vector<std::string>& args : {std::vector<std::string>{"inspect", "--verify", path},
                                                 {"inspect", "--verify", "--json", path},
                                                 {"generate", "--model", path, "--prompt-ids", "1,2", "-n", "1"}}) {
      SCOPED_TRACE(args[0] + " " + args[1]);
      auto v = test::run_cli(d, args);
      ASSERT_TRUE(v.exited) << "killed by signal " << v.code;
      EXPECT_EQ(v.code, exit_code(Status::Checksum)) << v.err;
      const std::string all = v.out + v.err;
      EXPECT_EQ(all.find('\x1b'), std::string::npos) << "a raw ESC byte in: " << all;
      EXPECT_EQ(all.find(c.raw), std::string::npos) << "the raw name is printed";
      if (args[2] == "--json") {
        ASSERT_NO_THROW(j = nlohmann::json::parse(v.out));
        ASSERT_EQ(j["verified"]["failures"].size(), 1u);
        EXPECT_NE(j["verified"]["failures"][0].get<std::string>().find("tensor '" + c.shown + "'"), std::string::npos);
      } else {
        EXPECT_NE(all.find("checksum mismatch in tensor '" + c.shown + "'"), std::string::npos) << all;
      }
    }
  }
}

TEST_F(ColibriFileTest, DenseDataCorruption) {
  COLIBRI_SEED_TRACE(seed_);
  std::mt19937_64 rng(seed_);
  for (DType dt : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_name(dt));
    std::string b = read_whole(model_path(dt));
    auto ref = ColibriFile::open(model_path(dt));
    const TensorView& t = ref->tensor("blk.1.attn_q");
    const uint64_t at = t.offset + std::uniform_int_distribution<uint64_t>(0, t.size - 1)(rng);
    b[at] ^= 0x20;
    TempDir d;
    const std::string path = d.file("x.colibri");
    write_whole(path, b);
    expect_error([&] { ColibriFile::open(path); }, Status::Checksum,
                 {path, "checksum mismatch in tensor 'blk.1.attn_q' (offset " + std::to_string(t.offset) + ")"});
    ColibriFile::Options lazy;
    lazy.verify_dense = false;
    std::shared_ptr<ColibriFile> f;
    ASSERT_NO_THROW(f = ColibriFile::open(path, lazy));
    expect_error([&] { f->verify_tensor(f->tensor("blk.1.attn_q")); }, Status::Checksum, {"'blk.1.attn_q'"});
    for (const auto& o : f->tensors()) {
      if (o.name != "blk.1.attn_q") {
        EXPECT_NO_THROW(f->verify_tensor(o)) << o.name;
      }
    }
    for (const auto& e : f->experts()) EXPECT_NO_THROW(f->verify_expert(e));
  }
}

TEST_F(ColibriFileTest, ExpertBlockCorruption) {
  COLIBRI_SEED_TRACE(seed_);
  std::mt19937_64 rng(seed_);
  for (DType dt : {DType::F32, DType::F16}) {
    SCOPED_TRACE(dtype_name(dt));
    std::string b = read_whole(model_path(dt));
    auto ref = ColibriFile::open(model_path(dt));
    const ExpertView& x = ref->expert(1, 2);
    const uint64_t at = x.offset + std::uniform_int_distribution<uint64_t>(0, x.size - 1)(rng);
    b[at] ^= 0x01;
    TempDir d;
    const std::string path = d.file("x.colibri");
    write_whole(path, b);
    std::shared_ptr<ColibriFile> f;
    ASSERT_NO_THROW(f = ColibriFile::open(path)) << "expert blocks are verified lazily, not at open";
    for (const auto& e : f->experts()) {
      if (e.layer == 1 && e.expert == 2) {
        expect_error([&] { f->verify_expert(e); }, Status::Checksum,
                     {path, "checksum mismatch in expert 2 of layer 1 (offset " + std::to_string(x.offset) + ")"});
      } else {
        EXPECT_NO_THROW(f->verify_expert(e)) << "layer " << e.layer << " expert " << e.expert;
      }
    }
  }
}

TEST_F(ColibriFileTest, TruncatedFilesAreRejected) {
  COLIBRI_SEED_TRACE(seed_);
  std::mt19937_64 rng(seed_);
  const std::string good = read_whole(model_path(DType::BF16));
  const FileHeader h = header_of(good);
  std::vector<size_t> cuts;
  for (size_t n = 0; n < 64; ++n) cuts.push_back(n);
  for (size_t n : {size_t(127), size_t(128), size_t(129), size_t(h.tensor_dir_offset), size_t(h.expert_index_offset),
                   size_t(h.data_offset - 1), size_t(h.data_offset), size_t(h.data_offset + 1), good.size() - 4096,
                   good.size() - 1})
    cuts.push_back(n);
  for (size_t k = 0; k < 30; ++k) cuts.push_back(64 + (good.size() - 64) * k / 30);
  std::uniform_int_distribution<size_t> pick(64, good.size() - 1);
  for (int k = 0; k < 10; ++k) cuts.push_back(pick(rng));

  TempDir d;
  const std::string path = d.file("cut.colibri");
  for (size_t n : cuts) {
    ASSERT_LT(n, good.size());
    SCOPED_TRACE("truncated to " + std::to_string(n) + " of " + std::to_string(good.size()) + " bytes");
    write_whole(path, good.substr(0, n));
    if (n < 128)
      expect_error([&] { ColibriFile::open(path); }, Status::Format,
                   {path, std::to_string(n) + " bytes, shorter than the 128-byte header"});
    else
      expect_error([&] { ColibriFile::open(path); }, Status::Format, {path, "(truncated or appended to)"});
  }
}

TEST_F(ColibriFileTest, OpenErrorsAreIo) {
  TempDir d;
  expect_error([&] { ColibriFile::open(d.file("absent.colibri")); }, Status::Io, {"cannot open", "absent.colibri"});
  expect_error([&] { ColibriFile::open(d.path()); }, Status::Io, {"is a directory, not a regular file"});
}

}  // namespace
}  // namespace colibri
