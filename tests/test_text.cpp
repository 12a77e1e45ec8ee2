// test_text.cpp: the tokenizer embedded in .colibri files and text generation:
// the config's "tokenizer" object, StopTextStream (stop strings, held-back
// tails, ids past the tokenizer), and `colibri generate --prompt` whose streamed
// text equals decode() of the ids it reports (tests/text_test.sh does the rest).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "model/colibri_file.h"
#include "model/config.h"
#include "model/text.h"
#include "model/tokenizer.h"
#include "model/tokenizer_impl.h"
#include "tests/cli_runner.h"
#include "tests/test_util.h"

namespace colibri {
namespace {

namespace fs = std::filesystem;
using test::expect_error;

std::string tok_dir(const std::string& name) { return test::fixtures_dir() + "/tokenizers/" + name; }

std::string read_whole_file(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::unique_ptr<Tokenizer> qwen2_tokenizer() {
  const std::string f = tok_dir("qwen2_bpe") + "/tokenizer.json";
  if (!fs::exists(f)) return nullptr;
  return Tokenizer::load(TokenizerKind::HfJson, read_whole_file(f), TokenizerOptions{});
}

bool valid_utf8(const std::string& s) { return detail::utf8_valid(s); }

ModelConfig small_config() {
  nlohmann::json hf = {{"architectures", {"Qwen3MoeForCausalLM"}},
                       {"vocab_size", 512},
                       {"hidden_size", 64},
                       {"intermediate_size", 64},
                       {"moe_intermediate_size", 32},
                       {"num_hidden_layers", 1},
                       {"num_attention_heads", 2},
                       {"num_key_value_heads", 1},
                       {"num_experts", 4},
                       {"num_experts_per_tok", 2},
                       {"max_position_embeddings", 128}};
  return ModelConfig::from_hf(hf);
}

TEST(TextConfig, TokenizerObjectRoundTrips) {
  ModelConfig c = small_config();
  EXPECT_FALSE(c.to_json().contains("tokenizer")) << "files without a tokenizer must not change";
  c.tokenizer.kind = "hf_json";
  c.tokenizer.vocab_size = 480;
  c.tokenizer.add_bos = false;
  c.tokenizer.eos_token_ids = {2, 7};
  c.tokenizer.extra_special = {{500, "<|x|>"}};
  c.validate();
  ModelConfig d = ModelConfig::from_json(c.to_json());
  EXPECT_EQ(d.tokenizer.kind, "hf_json");
  EXPECT_EQ(d.tokenizer.vocab_size, 480);
  EXPECT_FALSE(d.tokenizer.add_bos);
  EXPECT_EQ(d.tokenizer.eos_token_ids, (std::vector<int64_t>{2, 7}));
  ASSERT_EQ(d.tokenizer.extra_special.size(), 1u);
  EXPECT_EQ(d.tokenizer.extra_special[0].second, "<|x|>");
  EXPECT_EQ(eos_token_ids(d), (std::vector<int32_t>{2, 7}));
}

TEST(TextConfig, InvalidTokenizerObjectsAreFormatErrors) {
  ModelConfig c = small_config();
  c.tokenizer.kind = "hf_json";
  c.tokenizer.vocab_size = 480;
  auto j = c.to_json();
  auto bad = [&](const char* key, nlohmann::json v, const std::string& needle) {
    auto k = j;
    k["tokenizer"][key] = v;
    expect_error([&] { ModelConfig::from_json(k); }, Status::Format, {needle});
  };
  bad("kind", "tiktoken", "tokenizer.kind 'tiktoken' is not supported");
  bad("vocab_size", 513, "tokenizer.vocab_size = 513");
  bad("eos_token_ids", nlohmann::json::array({512}), "tokenizer.eos_token_ids[i] = 512");
  bad("eos_token_ids", "2", "eos_token_ids");
  auto k = j;
  k["tokenizer"] = 3;
  expect_error([&] { ModelConfig::from_json(k); }, Status::Format, {"'tokenizer' is not an object"});
}

TEST(StopTextStream, StopsBeforeTheStopStringAndHoldsBackPrefixes) {
  auto tok = qwen2_tokenizer();
  if (!tok) GTEST_SKIP() << "no qwen2_bpe fixture";
  const std::string text = "Hello, world! Hello again, world.";
  const auto ids = tok->encode(text, false);
  ASSERT_EQ(tok->decode(ids, true), text);
  for (const std::string stop : {"world", "again", "o", ", w", "Hello, world! Hello again, world."}) {
    StopTextStream ts(*tok, {"never there", stop});
    std::string got;
    for (int32_t id : ids) {
      std::string piece = ts.push(id);
      EXPECT_TRUE(valid_utf8(piece));
      got += piece;
      if (ts.stopped()) break;
    }
    got += ts.finish();
    EXPECT_TRUE(ts.stopped()) << stop;
    EXPECT_EQ(got, text.substr(0, text.find(stop))) << "stop '" << stop << "'";
    EXPECT_EQ(ts.text(), got);
  }
  StopTextStream none(*tok, {"zzz", ""});
  std::string got;
  for (int32_t id : ids) got += none.push(id);
  got += none.finish();
  EXPECT_FALSE(none.stopped());
  EXPECT_EQ(got, text);
}

TEST(StopTextStream, MultiByteTextAndIdsPastTheTokenizer) {
  auto tok = qwen2_tokenizer();
  if (!tok) GTEST_SKIP() << "no qwen2_bpe fixture";
  const std::string text = "Привет, мир! 日本語 🙂 done";
  const auto ids = tok->encode(text, false);
  StopTextStream ts(*tok, {"🙂"});
  std::string got;
  for (int32_t id : ids) {
    std::string piece = ts.push(id);
    EXPECT_TRUE(valid_utf8(piece)) << "piece cut a character";
    got += piece;
    got += ts.push(static_cast<int32_t>(tok->vocab_size()));  // padding id of the model: no text
  }
  got += ts.finish();
  EXPECT_EQ(got, text.substr(0, text.find("🙂")));
}

TEST(TextFile, GenerateStreamsDecodeOfItsIds) {
  const std::string fx = tok_dir("qwen2_bpe");
  if (!fs::exists(fx + "/tokenizer.json")) GTEST_SKIP() << "no qwen2_bpe fixture";
  test::TempDir tmp;
  auto r = test::run_cli(tmp, {"synth", "--arch", "qwen3_moe", "--preset", "tiny", "--out", tmp.file("hf"), "--log-level", "warn"});
  ASSERT_EQ(r.code, 0) << r.err;
  fs::copy_file(fx + "/tokenizer.json", tmp.file("hf/tokenizer.json"));
  fs::copy_file(fx + "/tokenizer_config.json", tmp.file("hf/tokenizer_config.json"));
  const std::string m = tmp.file("m.colibri");
  r = test::run_cli(tmp, {"convert", tmp.file("hf"), m, "--log-level", "warn"});
  ASSERT_EQ(r.code, 0) << r.err;

  auto file = ColibriFile::open(m);
  ASSERT_TRUE(file->has_tokenizer());
  EXPECT_EQ(file->config().tokenizer.kind, "hf_json");
  EXPECT_EQ(file->tokenizer_bytes(), read_whole_file(fx + "/tokenizer.json")) << "the file's bytes, unchanged";
  auto tok = open_tokenizer(*file);
  EXPECT_EQ(tok->vocab_size(), file->config().tokenizer.vocab_size);

  r = test::run_cli(tmp, {"generate", "-m", m, "--prompt", "Hello, world! 日本", "-n", "32", "--ignore-eos",
                          "--print-ids", "--log-level", "warn"});
  ASSERT_EQ(r.code, 0) << r.err;
  const size_t at = r.out.rfind("\nsequence 0: ");
  ASSERT_NE(at, std::string::npos) << r.out;
  const std::string text = r.out.substr(0, at);
  std::vector<int32_t> ids;
  std::stringstream ss(r.out.substr(at + 13));
  for (std::string x; std::getline(ss, x, ',');) ids.push_back(std::stoi(x));
  ASSERT_EQ(ids.size(), 32u);
  std::vector<int32_t> known;
  for (int32_t id : ids)
    if (id < tok->vocab_size()) known.push_back(id);
  const std::string want = tok->decode(known, true);
  EXPECT_TRUE(valid_utf8(text));
  if (valid_utf8(want)) {
    EXPECT_EQ(text, want);
  }
}

TEST(TextFile, SentencePieceLegacyComesFromTokenizerConfig) {
  // tokenizer_config.json's "legacy" decides where SentencePiece prepends "\u2581"
  // around special tokens written in the text; the embedded tokenizer must
  // encode as the one loaded with the same setting.
  const std::string fx = tok_dir("llama_spm");
  if (!fs::exists(fx + "/tokenizer.model")) GTEST_SKIP() << "no llama_spm fixture";
  const std::string model = read_whole_file(fx + "/tokenizer.model");
  const std::string text = "Hello</s>world <s>again";
  TokenizerOptions o;
  o.legacy = false;
  const auto ids_new = Tokenizer::load(TokenizerKind::SentencePiece, model, o)->encode(text, true);
  o.legacy = true;
  const auto ids_legacy = Tokenizer::load(TokenizerKind::SentencePiece, model, o)->encode(text, true);
  ASSERT_NE(ids_new, ids_legacy) << "the string must tell the two settings apart";
  for (bool legacy : {false, true}) {
    SCOPED_TRACE(legacy ? "legacy" : "not legacy");
    test::TempDir tmp;
    auto r = test::run_cli(tmp, {"synth", "--arch", "mixtral", "--preset", "tiny", "--vocab", "640", "--out",
                                 tmp.file("hf"), "--log-level", "warn"});
    ASSERT_EQ(r.code, 0) << r.err;
    fs::copy_file(fx + "/tokenizer.model", tmp.file("hf/tokenizer.model"));
    nlohmann::json tc = nlohmann::json::parse(read_whole_file(fx + "/tokenizer_config.json"));
    tc["legacy"] = legacy;
    std::ofstream(tmp.file("hf/tokenizer_config.json")) << tc.dump();
    r = test::run_cli(tmp, {"convert", tmp.file("hf"), tmp.file("m.colibri"), "--log-level", "warn"});
    ASSERT_EQ(r.code, 0) << r.err;
    auto file = ColibriFile::open(tmp.file("m.colibri"));
    EXPECT_EQ(file->config().tokenizer.legacy, legacy);
    EXPECT_EQ(open_tokenizer(*file)->encode(text, true), legacy ? ids_legacy : ids_new);
  }
}

TEST(TextFile, NoTokenizerIsInvalidArgument) {
  test::TempDir tmp;
  auto r = test::run_cli(tmp, {"synth", "--arch", "mixtral", "--preset", "tiny", "--out", tmp.file("hf"), "--log-level", "warn"});
  ASSERT_EQ(r.code, 0) << r.err;
  r = test::run_cli(tmp, {"convert", tmp.file("hf"), tmp.file("m.colibri"), "--log-level", "warn"});
  ASSERT_EQ(r.code, 0) << r.err;
  auto file = ColibriFile::open(tmp.file("m.colibri"));
  EXPECT_FALSE(file->has_tokenizer());
  EXPECT_EQ(file->tokenizer_block(), nullptr);
  expect_error([&] { open_tokenizer(*file); }, Status::InvalidArgument, {"has no embedded tokenizer"});
}

}  // namespace
}  // namespace colibri
