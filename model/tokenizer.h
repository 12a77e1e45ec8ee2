// tokenizer.h: text <-> token ids, as the checkpoint's own tokenizer does it
// (docs/tokenizer.md). Two kinds, both embedded in the .colibri file:
//   - "hf_json":        a Hugging Face tokenizer.json with a BPE model
//                       (byte-level BPE as Qwen, OLMoE, DeepSeek, GLM and
//                       gpt-oss use; normaliser, regex pre-tokeniser, added
//                       and special tokens, post-processor template);
//   - "sentencepiece":  a SentencePiece tokenizer.model (Mixtral), run by
//                       libsentencepiece.
// The result must equal transformers' tokenizer for the same files
// (tests/test_tokenizer.cpp against fixtures from scripts/make_fixtures.py).
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace colibri {

enum class TokenizerKind { HfJson, SentencePiece };
const char* tokenizer_kind_name(TokenizerKind k);  // "hf_json", "sentencepiece"
std::optional<TokenizerKind> tokenizer_kind_from_name(std::string_view s);

// What tokenizer_config.json / generation_config.json add to the tokenizer
// file itself (all optional).
struct TokenizerOptions {
  // SentencePiece: prepend BOS when encoding with special tokens
  // (tokenizer_config.json "add_bos_token"; Mixtral: true) and append EOS
  // ("add_eos_token"). hf_json files carry this in their post-processor.
  bool add_bos = true;
  bool add_eos = false;
  // Extra special tokens (tokenizer_config.json "added_tokens_decoder" entries
  // that the tokenizer file lacks), as (id, content).
  std::vector<std::pair<int32_t, std::string>> extra_special;
  // SentencePiece: tokenizer_config.json "legacy" (transformers >= 5 default
  // false). false: one "\u2581" is prepended only to the text before the first
  // special token written in the text (Metaspace prepend_scheme "first");
  // true: to every piece of text between special tokens ("always").
  bool legacy = false;
};

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // Parses the file's bytes. Throws Error(Format) for a malformed file and
  // Error(Unsupported) naming the component (model type, normaliser,
  // pre-tokeniser, decoder...) that is not implemented.
  static std::unique_ptr<Tokenizer> load(TokenizerKind kind, std::string_view bytes, const TokenizerOptions& opts);

  virtual TokenizerKind kind() const = 0;
  // Number of ids the tokenizer can produce (max id + 1, added tokens included).
  virtual int64_t vocab_size() const = 0;

  // Text (UTF-8; invalid sequences are encoded as their bytes would be by the
  // byte-level model, or as SentencePiece does) -> ids. Added/special tokens
  // written in the text are recognised, as transformers does by default.
  // add_special: transformers' add_special_tokens=True (BOS etc.).
  virtual std::vector<int32_t> encode(std::string_view text, bool add_special) const = 0;
  // ids -> text bytes, as transformers' decode(ids, skip_special_tokens=skip_special,
  // clean_up_tokenization_spaces=False). The bytes of an id range that cuts a
  // UTF-8 character are returned as they are (not valid UTF-8 at the cut).
  // Throws Error(InvalidArgument) for an id outside [0, vocab_size()).
  virtual std::string decode(const int32_t* ids, size_t n, bool skip_special) const = 0;
  std::string decode(const std::vector<int32_t>& ids, bool skip_special) const {
    return decode(ids.data(), ids.size(), skip_special);
  }

  // The id of a token written exactly (special tokens included), if any.
  virtual std::optional<int32_t> token_id(std::string_view piece) const = 0;
  virtual bool is_special(int32_t id) const = 0;
};

// Incremental detokenisation of generated ids (as vLLM's detokenize_incrementally):
// push() returns the text that became final with this id, always valid UTF-8
// (bytes of an unfinished character are held back until a later id completes
// them); finish() returns the rest (an unfinished character as U+FFFD).
// Invariant (tests/test_tokenizer.cpp checks it on every fixture string):
//   push(ids[0]) + ... + push(ids[n-1]) + finish() == decode(ids, skip_special)
// whenever decode(ids) is valid UTF-8 (otherwise each ill-formed sequence comes
// out as U+FFFD). Each push decodes only a short window: decode(ids[prefix_..])
// minus the prefix_len bytes of decode(ids[prefix_..read_]) that were already
// returned, so the cost per id does not grow with the sequence.
// push() throws Error(InvalidArgument) for an id outside [0, vocab_size()).
class TextStream {
 public:
  explicit TextStream(const Tokenizer& t, bool skip_special = true);
  std::string push(int32_t id);
  std::string finish();

 private:
  const Tokenizer& tok_;
  bool skip_special_;
  std::vector<int32_t> ids_;
  size_t prefix_ = 0;   // ids before the window decode() starts from
  size_t read_ = 0;     // ids whose text has been returned
  size_t emitted_ = 0;  // bytes of decode(ids_[prefix_..read_]) (already returned)
};

}  // namespace colibri
