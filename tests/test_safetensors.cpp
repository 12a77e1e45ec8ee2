// test_safetensors.cpp: the safetensors writer and reader: round trips in every
// stored dtype, sharded checkpoints, and rejection of malformed or truncated files
// with a typed Error that names the problem.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "model/dtype.h"
#include "model/error.h"
#include "model/safetensors.h"
#include "tests/cli_runner.h"
#include "tests/test_util.h"

namespace colibri {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << "cannot write " << path;
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::string u64_le(uint64_t v) {
  std::string s(8, '\0');
  std::memcpy(s.data(), &v, 8);
  return s;
}

// A safetensors file: 8-byte little-endian header length, header, data bytes.
std::string st_bytes(const std::string& header, size_t data_size, char fill = '\0') {
  return u64_le(header.size()) + header + std::string(data_size, fill);
}

using test::expect_error;

// ---------------------------------------------------------------------------
// Round trip

struct RoundTripTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<float> values;  // the f32 source
  std::string bytes;          // as stored
};

size_t numel_of(const std::vector<int64_t>& shape) {
  size_t n = 1;
  for (auto d : shape) n *= static_cast<size_t>(d);
  return n;
}

std::string encode(const std::vector<float>& v, DType dt) {
  std::string out(v.size() * dtype_size(dt), '\0');
  convert_elements(v.data(), DType::F32, out.data(), dt, v.size());
  return out;
}

TEST(Safetensors, RoundTripEveryDtype) {
  const uint64_t seed = test::test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  TempDir dir;
  const std::string path = dir.file("rt.safetensors");

  std::vector<RoundTripTensor> ts = {
      {"a.f32", DType::F32, {3, 5, 7}, {}, {}},
      {"b.f16", DType::F16, {64}, {}, {}},
      {"c.bf16", DType::BF16, {2, 33}, {}, {}},
      {"d.f32.scalar", DType::F32, {}, {}, {}},
      {"e.f16.odd", DType::F16, {3}, {}, {}},  // 6 bytes: later tensors start unaligned
      {"f.bf16.4d", DType::BF16, {2, 3, 1, 4}, {}, {}},
      {"g.f32.big", DType::F32, {128, 96}, {}, {}},
  };
  std::vector<SafetensorsWriter::Spec> specs;
  for (auto& t : ts) {
    t.values = test::random_floats(rng, numel_of(t.shape), -4.f, 4.f);
    t.bytes = encode(t.values, t.dtype);
    specs.push_back({t.name, t.dtype, t.shape});
  }
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"note", "round trip"}};
  {
    SafetensorsWriter w(path, specs, meta);
    for (const auto& t : ts) w.write_next(t.bytes.data(), t.bytes.size());
    w.finish();
  }

  // The file itself: 8-byte length, a header padded so the data is 8-aligned.
  const std::string raw = read_bytes(path);
  ASSERT_GE(raw.size(), 8u);
  uint64_t hlen;
  std::memcpy(&hlen, raw.data(), 8);
  EXPECT_EQ((8 + hlen) % 8, 0u);
  size_t total = 0;
  for (const auto& t : ts) total += t.bytes.size();
  EXPECT_EQ(raw.size(), 8 + hlen + total);

  SafetensorsFile f(path);
  EXPECT_EQ(f.path(), path);
  EXPECT_EQ(f.metadata(), meta);
  ASSERT_EQ(f.tensors().size(), ts.size());
  const char* st_names[] = {"F32", "F16", "BF16"};
  for (const auto& t : ts) {
    SCOPED_TRACE(t.name);
    const SafeTensor* s = f.find(t.name);
    ASSERT_NE(s, nullptr);
    EXPECT_EQ(s->name, t.name);
    EXPECT_EQ(s->dtype_name, st_names[static_cast<int>(t.dtype)]);
    ASSERT_TRUE(s->dtype.has_value());
    EXPECT_EQ(*s->dtype, t.dtype);
    EXPECT_EQ(s->shape, t.shape);
    EXPECT_EQ(s->numel(), static_cast<int64_t>(t.values.size()));
    ASSERT_EQ(s->nbytes, t.bytes.size());
    for (size_t i = 0; i < t.values.size(); ++i) {
      switch (t.dtype) {
        case DType::F32: {
          float got;
          std::memcpy(&got, s->data + 4 * i, 4);
          ASSERT_EQ(std::memcmp(&got, &t.values[i], 4), 0) << "element " << i << ": " << got << " vs " << t.values[i];
          break;
        }
        case DType::F16: {
          uint16_t got;
          std::memcpy(&got, s->data + 2 * i, 2);
          ASSERT_EQ(got, f32_to_f16(t.values[i])) << "element " << i;
          ASSERT_NEAR(f16_to_f32(got), t.values[i], 4.f / 1024) << "element " << i;
          break;
        }
        case DType::BF16: {
          uint16_t got;
          std::memcpy(&got, s->data + 2 * i, 2);
          ASSERT_EQ(got, f32_to_bf16(t.values[i])) << "element " << i;
          ASSERT_NEAR(bf16_to_f32(got), t.values[i], 4.f / 128) << "element " << i;
          break;
        }
      }
    }
  }
  EXPECT_EQ(f.find("missing"), nullptr);
}

TEST(Safetensors, ReadsDtypesItDoesNotComputeWith) {
  // I64 and U8 are valid safetensors dtypes: sizes are checked, dtype is unset.
  TempDir dir;
  const std::string path = dir.file("other.safetensors");
  write_bytes(path, st_bytes(R"({"ids":{"dtype":"I64","shape":[3],"data_offsets":[0,24]},)"
                             R"("mask":{"dtype":"U8","shape":[5],"data_offsets":[24,29]}})",
                             29, '\x01'));
  SafetensorsFile f(path);
  ASSERT_EQ(f.tensors().size(), 2u);
  const SafeTensor* ids = f.find("ids");
  ASSERT_NE(ids, nullptr);
  EXPECT_FALSE(ids->dtype.has_value());
  EXPECT_EQ(ids->dtype_name, "I64");
  EXPECT_EQ(ids->nbytes, 24u);
  const SafeTensor* mask = f.find("mask");
  ASSERT_NE(mask, nullptr);
  EXPECT_EQ(mask->nbytes, 5u);
  EXPECT_EQ(mask->data[0], 1);
}

TEST(Safetensors, WriterRejectsMisuse) {
  TempDir dir;
  const std::vector<SafetensorsWriter::Spec> specs = {{"a", DType::F32, {4}}, {"b", DType::BF16, {2}}};
  std::vector<uint8_t> buf(64, 0);
  {
    SafetensorsWriter w(dir.file("x.safetensors"), specs);
    expect_error([&] { w.write_next(buf.data(), 12); }, Status::Internal, {"'a'", "size mismatch"});
    w.write_next(buf.data(), 16);
    expect_error([&] { w.finish(); }, Status::Internal, {"fewer tensors"});
    w.write_next(buf.data(), 4);
    expect_error([&] { w.write_next(buf.data(), 4); }, Status::Internal, {"more tensors than declared"});
    w.finish();
  }
  EXPECT_NO_THROW(SafetensorsFile(dir.file("x.safetensors")));
  expect_error([&] { SafetensorsWriter w(dir.file("no/such/dir/x.safetensors"), specs); }, Status::Io,
               {"cannot create", "no/such/dir/x.safetensors"});
}

TEST(Safetensors, OpenErrorsAreIo) {
  TempDir dir;
  expect_error([&] { SafetensorsFile f(dir.file("absent.safetensors")); }, Status::Io, {"cannot open", "absent.safetensors"});
  expect_error([&] { SafetensorsFile f(dir.path()); }, Status::Io, {"is a directory, not a regular file"});
}

// A zero-element tensor occupies [b, b); the reference implementation accepts
// it next to a tensor that starts at the same offset. The writer produces such
// files (it places an empty tensor where the next one starts).
// DISABLED: fails against model/safetensors.cpp, whose overlap check sorts the
// ranges by begin only, so [0,16) sorted before [0,0) is reported as overlapping
// (see the report on the bug); enable once the library is fixed.
TEST(Safetensors, ZeroSizedTensorNextToAnother) {
  TempDir dir;
  const std::string path = dir.file("zero.safetensors");
  // "b" (empty) is declared first so it sits at [0, 0) and "a" at [0, 16); the
  // header object iterates keys in sorted order: "a" before "b".
  const std::vector<SafetensorsWriter::Spec> specs = {{"b", DType::F32, {0}}, {"a", DType::F32, {4}}};
  std::vector<float> a = {1, 2, 3, 4};
  {
    SafetensorsWriter w(path, specs);
    w.write_next(a.data(), 0);
    w.write_next(a.data(), 16);
    w.finish();
  }
  SafetensorsFile f(path);
  ASSERT_NE(f.find("b"), nullptr);
  EXPECT_EQ(f.find("b")->nbytes, 0u);
  ASSERT_NE(f.find("a"), nullptr);
  EXPECT_EQ(std::memcmp(f.find("a")->data, a.data(), 16), 0);
}

// ---------------------------------------------------------------------------
// Malformed files (table-driven)

// A valid Mixtral config.json, so `colibri convert` gets as far as the weights.
constexpr const char* kTinyConfig = R"({"architectures": ["MixtralForCausalLM"], "vocab_size": 16, "hidden_size": 8,
 "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
 "num_local_experts": 2, "num_experts_per_tok": 1, "max_position_embeddings": 32})";

struct MalformedCase {
  const char* name;
  std::string bytes;
  Status status;
  std::vector<std::string> needles;
};

std::vector<MalformedCase> malformed_cases() {
  const std::string ok_tensor = R"("dtype":"F32","shape":[2,2],"data_offsets":[0,16])";
  return {
      {"empty file", "", Status::Format, {"0 bytes", "too short"}},
      {"shorter than 8 bytes", std::string("\x05\x00\x00", 3), Status::Format, {"3 bytes", "too short"}},
      {"7 bytes", std::string(7, '\0'), Status::Format, {"7 bytes", "too short"}},
      {"header length beyond the file", u64_le(100) + "{}", Status::Format,
       {"header length 100", "beyond the end of the file (10 bytes)"}},
      {"header length one past the file", u64_le(3) + "{}", Status::Format, {"header length 3", "beyond the end"}},
      {"header over 100 MiB", u64_le((100ull << 20) + 1) + "{}", Status::Format, {"exceeds the 100 MiB limit"}},
      {"header length 2^64-1", u64_le(~0ull) + "{}", Status::Format, {"exceeds the 100 MiB limit"}},
      {"invalid JSON", st_bytes("{\"a\": ", 0), Status::Format, {"header is not valid JSON"}},
      {"empty header", st_bytes("", 0), Status::Format, {"header is not valid JSON"}},
      {"header is an array", st_bytes("[1, 2]", 0), Status::Format, {"header is not a JSON object"}},
      {"header is a string", st_bytes("\"x\"", 0), Status::Format, {"header is not a JSON object"}},
      {"tensor entry not an object", st_bytes(R"({"w": 5})", 0), Status::Format, {"tensor 'w' is not an object"}},
      {"__metadata__ not an object", st_bytes(R"({"__metadata__": [1]})", 0), Status::Format,
       {"__metadata__ is not an object"}},
      {"missing dtype", st_bytes(R"({"w":{"shape":[2,2],"data_offsets":[0,16]}})", 16), Status::Format,
       {"tensor 'w' has no dtype"}},
      {"dtype not a string", st_bytes(R"({"w":{"dtype":4,"shape":[2,2],"data_offsets":[0,16]}})", 16), Status::Format,
       {"tensor 'w' has no dtype"}},
      {"missing shape", st_bytes(R"({"w":{"dtype":"F32","data_offsets":[0,16]}})", 16), Status::Format,
       {"tensor 'w' has no shape"}},
      {"shape not an array", st_bytes(R"({"w":{"dtype":"F32","shape":4,"data_offsets":[0,16]}})", 16), Status::Format,
       {"tensor 'w' has no shape"}},
      {"missing data_offsets", st_bytes(R"({"w":{"dtype":"F32","shape":[2,2]}})", 16), Status::Format,
       {"tensor 'w' has no data_offsets"}},
      {"data_offsets with three entries", st_bytes(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,8,16]}})", 16),
       Status::Format, {"tensor 'w' has no data_offsets"}},
      {"unknown dtype", st_bytes(R"({"w":{"dtype":"F7","shape":[2,2],"data_offsets":[0,16]}})", 16), Status::Format,
       {"tensor 'w' has unknown dtype 'F7'"}},
      {"lower-case dtype", st_bytes(R"({"w":{"dtype":"f32","shape":[2,2],"data_offsets":[0,16]}})", 16), Status::Format,
       {"unknown dtype 'f32'"}},
      {"negative dimension", st_bytes(R"({"w":{"dtype":"F32","shape":[-2,2],"data_offsets":[0,16]}})", 16),
       Status::Format, {"tensor 'w' has a negative or non-integer dimension"}},
      {"fractional dimension", st_bytes(R"({"w":{"dtype":"F32","shape":[2.5,2],"data_offsets":[0,16]}})", 16),
       Status::Format, {"negative or non-integer dimension"}},
      {"dimension 2^64-1", st_bytes(R"({"w":{"dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,16]}})", 16),
       Status::Format, {"tensor 'w' has"}},
      {"data_offsets past the end", st_bytes(R"({"w":{"dtype":"F32","shape":[2,4],"data_offsets":[0,32]}})", 16),
       Status::Format, {"tensor 'w' data_offsets end 32 is past the end of the data (16 bytes)"}},
      {"begin > end", st_bytes(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[16,0]}})", 16), Status::Format,
       {"tensor 'w' has data_offsets with begin > end"}},
      {"negative data_offsets", st_bytes(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[-16,0]}})", 16),
       Status::Format, {"tensor 'w' has negative or non-integer data_offsets"}},
      {"size not matching shape*dtype", st_bytes(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}})", 16),
       Status::Format, {"tensor 'w' occupies 12 bytes but its shape and dtype need 16"}},
      {"size not matching for a 2-byte dtype",
       st_bytes(R"({"w":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,16]}})", 16), Status::Format,
       {"occupies 16 bytes but its shape and dtype need 8"}},
      {"overlapping tensors",
       st_bytes(R"({"a":{)" + ok_tensor + R"(},"b":{"dtype":"F32","shape":[2,2],"data_offsets":[8,24]}})", 24),
       Status::Format, {"tensors 'a' and 'b' overlap"}},
      {"identical ranges", st_bytes(R"({"a":{)" + ok_tensor + R"(},"b":{)" + ok_tensor + "}}", 16), Status::Format,
       {"overlap"}},
      {"absurd shape (3 x 2^32)",
       st_bytes(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,16]}})", 16),
       Status::Format, {"tensor 'w' has an absurd shape"}},
      {"absurd shape (product * dtype overflows)",
       st_bytes(R"({"w":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,16]}})", 16), Status::Format,
       {"tensor 'w' has an absurd shape"}},
      {"absurd shape that wraps to zero",
       st_bytes(R"({"w":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", 16), Status::Format,
       {"tensor 'w' has an absurd shape"}},
  };
}

TEST(Safetensors, MalformedFilesAreRejected) {
  TempDir dir;
  int i = 0;
  for (const auto& c : malformed_cases()) {
    SCOPED_TRACE(c.name);
    const std::string path = dir.file("bad" + std::to_string(i++) + ".safetensors");
    write_bytes(path, c.bytes);
    std::vector<std::string> needles = c.needles;
    needles.push_back(path);  // every message names the file
    expect_error([&] { SafetensorsFile f(path); }, c.status, needles);
    // `colibri convert` on a checkpoint holding this file: a specific exit
    // code and message, never a signal, and no output file.
    TempDir ck;
    write_bytes(ck.file("config.json"), kTinyConfig);
    write_bytes(ck.file("model.safetensors"), c.bytes);
    auto r = test::run_cli(ck, {"convert", ck.path(), ck.file("out.colibri")});
    EXPECT_TRUE(r.exited) << "convert killed by signal " << r.code;
    EXPECT_EQ(r.code, exit_code(c.status)) << r.err;
    EXPECT_NE(r.err.find(c.needles.front()), std::string::npos) << r.err;
    EXPECT_FALSE(std::filesystem::exists(ck.file("out.colibri")));
    EXPECT_FALSE(test::temp_left(ck.file("out.colibri")));
  }
}

// config.json problems reach the user of `colibri convert` as clear errors.
TEST(Safetensors, ConvertRejectsBadConfigs) {
  struct Case {
    const char* name;
    std::string config;
    Status status;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {"not JSON", "{\"architectures\": [", Status::Format, "config.json: not valid JSON"},
      {"not an object", "[1, 2]", Status::Format, "not a JSON object"},
      {"unknown architecture", R"({"architectures":["LlamaForCausalLM"]})", Status::Unsupported,
       "unsupported architecture 'LlamaForCausalLM'; supported: MixtralForCausalLM"},
      {"missing hidden_size", R"({"architectures":["MixtralForCausalLM"],"vocab_size":8})", Status::Format,
       "missing required field 'hidden_size'"},
      {"wrong type", R"({"architectures":["MixtralForCausalLM"],"vocab_size":"many"})", Status::Format,
       "field 'vocab_size' is not an integer in range"},
      {"negative size", std::string(kTinyConfig).replace(std::string(kTinyConfig).find("\"hidden_size\": 8"), 16, "\"hidden_size\": -8"),
       Status::Format, "hidden_size = -8 is outside"},
      {"absurd experts", std::string(kTinyConfig).replace(std::string(kTinyConfig).find("\"num_local_experts\": 2"), 22,
                                                          "\"num_local_experts\": 9999999"),
       Status::Format, "num_experts = 9999999 is outside"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    TempDir ck;
    write_bytes(ck.file("config.json"), c.config);
    write_bytes(ck.file("model.safetensors"), st_bytes("{}", 0));
    auto r = test::run_cli(ck, {"convert", ck.path(), ck.file("out.colibri")});
    EXPECT_TRUE(r.exited);
    EXPECT_EQ(r.code, exit_code(c.status)) << r.err;
    EXPECT_NE(r.err.find(c.needle), std::string::npos) << r.err;
    EXPECT_FALSE(std::filesystem::exists(ck.file("out.colibri")));
  }
}

TEST(Safetensors, ParseHeaderNamesTheSource) {
  expect_error([] { SafetensorsFile::parse_header("{", 0, nullptr, "my-source"); }, Status::Format,
               {"my-source: header is not valid JSON"});
  std::map<std::string, std::string> meta;
  auto ts = SafetensorsFile::parse_header(
      R"({"__metadata__":{"format":"pt","n":3},"w":{"dtype":"F16","shape":[4],"data_offsets":[0,8]}})", 8, &meta, "x");
  ASSERT_EQ(ts.size(), 1u);
  EXPECT_EQ(ts[0].nbytes, 8u);
  EXPECT_EQ(meta.size(), 1u);  // non-string metadata values are skipped
  EXPECT_EQ(meta["format"], "pt");
}

// ---------------------------------------------------------------------------
// Truncation: every prefix of a valid file is rejected with an Error.

TEST(Safetensors, TruncatedFilesAreRejected) {
  const uint64_t seed = test::test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  TempDir dir;
  const std::string good = dir.file("good.safetensors");
  const std::vector<SafetensorsWriter::Spec> specs = {
      {"x", DType::F32, {16, 8}}, {"y", DType::BF16, {33}}, {"z", DType::F16, {5, 5}}};
  {
    SafetensorsWriter w(good, specs, {{"format", "pt"}});
    for (const auto& s : specs) {
      auto v = test::random_floats(rng, numel_of(s.shape));
      auto b = encode(v, s.dtype);
      w.write_next(b.data(), b.size());
    }
    w.finish();
  }
  const std::string full = read_bytes(good);
  ASSERT_NO_THROW(SafetensorsFile f(good));
  uint64_t hlen;
  std::memcpy(&hlen, full.data(), 8);
  const size_t data_start = 8 + hlen;
  ASSERT_LT(data_start, full.size());

  std::vector<size_t> cuts;
  for (size_t n = 0; n < 64 && n < full.size(); ++n) cuts.push_back(n);
  for (size_t k = 0; k < 40; ++k) cuts.push_back(64 + (full.size() - 64) * k / 40);
  std::uniform_int_distribution<size_t> pick(64, full.size() - 1);
  for (int k = 0; k < 10; ++k) cuts.push_back(pick(rng));
  cuts.push_back(data_start);
  cuts.push_back(data_start - 1);
  cuts.push_back(full.size() - 1);

  const std::string path = dir.file("cut.safetensors");
  for (size_t n : cuts) {
    ASSERT_LT(n, full.size());
    SCOPED_TRACE("truncated to " + std::to_string(n) + " of " + std::to_string(full.size()) + " bytes");
    write_bytes(path, full.substr(0, n));
    if (n < 8)
      expect_error([&] { SafetensorsFile f(path); }, Status::Format, {"too short"});
    else if (n < data_start)
      expect_error([&] { SafetensorsFile f(path); }, Status::Format, {"beyond the end of the file"});
    else  // the header parses; the last tensor now ends past the data
      expect_error([&] { SafetensorsFile f(path); }, Status::Format, {"past the end of the data"});
  }
}

// ---------------------------------------------------------------------------
// Checkpoints: single file and sharded through model.safetensors.index.json

struct Shard {
  std::string file;
  std::vector<std::pair<std::string, std::vector<float>>> tensors;  // f32, shape [n]
};

void write_shard(const std::string& dir, const Shard& s) {
  std::vector<SafetensorsWriter::Spec> specs;
  for (const auto& [name, v] : s.tensors) specs.push_back({name, DType::F32, {static_cast<int64_t>(v.size())}});
  SafetensorsWriter w((fs::path(dir) / s.file).string(), specs);
  for (const auto& [name, v] : s.tensors) w.write_next(v.data(), v.size() * 4);
  w.finish();
}

void write_text(const std::string& path, const std::string& text) { write_bytes(path, text); }

std::string index_json(const std::vector<std::pair<std::string, std::string>>& weight_map) {
  std::string s = R"({"metadata":{"total_size":0},"weight_map":{)";
  for (size_t i = 0; i < weight_map.size(); ++i)
    s += (i ? "," : "") + ("\"" + weight_map[i].first + "\":\"" + weight_map[i].second + "\"");
  return s + "}}";
}

TEST(Safetensors, CheckpointSingleFile) {
  TempDir dir;
  write_shard(dir.path(), {"model.safetensors", {{"w1", {1, 2, 3}}, {"w2", {4, 5}}}});
  Checkpoint ck(dir.path());
  EXPECT_EQ(ck.num_shards(), 1u);
  EXPECT_EQ(ck.names(), (std::vector<std::string>{"w1", "w2"}));
  const SafeTensor& t = ck.get("w2");
  ASSERT_EQ(t.nbytes, 8u);
  float v[2];
  std::memcpy(v, t.data, 8);
  EXPECT_EQ(v[0], 4.f);
  EXPECT_EQ(v[1], 5.f);
  EXPECT_EQ(ck.find("nope"), nullptr);
  expect_error([&] { ck.get("nope"); }, Status::Format, {"checkpoint has no tensor 'nope'"});
}

TEST(Safetensors, CheckpointSharded) {
  const uint64_t seed = test::test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  TempDir dir;
  Shard s1{"model-00001-of-00002.safetensors", {{"a", test::random_floats(rng, 17)}, {"b", test::random_floats(rng, 3)}}};
  Shard s2{"model-00002-of-00002.safetensors", {{"c", test::random_floats(rng, 40)}}};
  write_shard(dir.path(), s1);
  write_shard(dir.path(), s2);
  // A stray model.safetensors is ignored when an index exists.
  write_shard(dir.path(), {"model.safetensors", {{"stray", {1}}}});
  write_text(dir.file("model.safetensors.index.json"),
             index_json({{"a", s1.file}, {"b", s1.file}, {"c", s2.file}}));
  Checkpoint ck(dir.path());
  EXPECT_EQ(ck.num_shards(), 2u);
  EXPECT_EQ(ck.names(), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ(ck.find("stray"), nullptr);
  for (const Shard* s : {&s1, &s2})
    for (const auto& [name, v] : s->tensors) {
      SCOPED_TRACE(name);
      const SafeTensor& t = ck.get(name);
      ASSERT_EQ(t.nbytes, v.size() * 4);
      for (size_t i = 0; i < v.size(); ++i) {
        float got;
        std::memcpy(&got, t.data + 4 * i, 4);
        ASSERT_EQ(got, v[i]) << "element " << i;
      }
    }
}

TEST(Safetensors, CheckpointIndexErrors) {
  struct Case {
    const char* name;
    std::string index;  // empty: no index file
    Status status;
    std::vector<std::string> needles;
  };
  const std::string s1 = "model-00001-of-00002.safetensors";
  const std::vector<Case> cases = {
      {"index names a missing shard", index_json({{"a", s1}, {"z", "model-00003-of-00003.safetensors"}}), Status::Io,
       {"model.safetensors.index.json", "names shard 'model-00003-of-00003.safetensors', which does not exist"}},
      {"index maps a tensor to a shard that lacks it", index_json({{"a", s1}, {"c", s1}}), Status::Format,
       {"maps 'c' to '" + s1 + "', which does not contain it"}},
      {"index is not JSON", "{\"weight_map\": ", Status::Format, {"model.safetensors.index.json: not valid JSON"}},
      {"index has no weight_map", R"({"metadata":{}})", Status::Format, {"missing 'weight_map' object"}},
      {"weight_map is an array", R"({"weight_map":["a"]})", Status::Format, {"missing 'weight_map' object"}},
      {"weight_map entry is not a string", R"({"weight_map":{"a":3}})", Status::Format,
       {"weight_map entry 'a' is not a file name"}},
      {"shard name with a slash", index_json({{"a", "../x/" + s1}}), Status::Format, {"must be a plain file name"}},
      {"shard name '..'", index_json({{"a", ".."}}), Status::Format, {"must be a plain file name"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    TempDir dir;
    write_shard(dir.path(), {s1, {{"a", {1, 2}}, {"b", {3}}}});
    write_text(dir.file("model.safetensors.index.json"), c.index);
    expect_error([&] { Checkpoint ck(dir.path()); }, c.status, c.needles);
    write_text(dir.file("config.json"), kTinyConfig);
    auto r = test::run_cli(dir, {"convert", dir.path(), dir.file("out.colibri")});
    EXPECT_TRUE(r.exited);
    EXPECT_EQ(r.code, exit_code(c.status)) << r.err;
    EXPECT_NE(r.err.find(c.needles.front()), std::string::npos) << r.err;
  }
}

TEST(Safetensors, CheckpointDirectoryErrors) {
  TempDir dir;
  expect_error([&] { Checkpoint ck(dir.path()); }, Status::Io, {"has neither model.safetensors nor"});
  expect_error([&] { Checkpoint ck(dir.file("absent")); }, Status::Io, {"is not a directory"});
  write_text(dir.file("plain"), "x");
  expect_error([&] { Checkpoint ck(dir.file("plain")); }, Status::Io, {"is not a directory"});
  // A malformed shard surfaces its own Format error, naming the shard.
  write_bytes(dir.file("model.safetensors"), st_bytes("[]", 0));
  expect_error([&] { Checkpoint ck(dir.path()); }, Status::Format, {"model.safetensors", "not a JSON object"});
}

}  // namespace
}  // namespace colibri
