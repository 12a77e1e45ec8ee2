// text.h: the glue between a .colibri file's embedded tokenizer and generation
// (docs/tokenizer.md): loading it, the model's EOS ids, and a text stream that
// ends at stop strings. Header-only, so that model/colibri_file.cpp (and the
// fuzz build, which compiles it alone) does not depend on the tokenizer code.
#pragma once
#include <algorithm>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "model/colibri_file.h"
#include "model/error.h"
#include "model/tokenizer.h"

namespace colibri {

inline TokenizerOptions tokenizer_options(const TokenizerSpec& s) {
  TokenizerOptions o;
  o.add_bos = s.add_bos;
  o.add_eos = s.add_eos;
  o.legacy = s.legacy;
  for (const auto& [id, content] : s.extra_special) o.extra_special.emplace_back(static_cast<int32_t>(id), content);
  return o;
}

// The file's tokenizer, checksum checked. Error(InvalidArgument) when the file
// has none; Error(Format|Unsupported|Checksum) when it cannot be loaded.
inline std::unique_ptr<Tokenizer> open_tokenizer(const ColibriFile& f) {
  const TokenizerSpec& s = f.config().tokenizer;
  if (!f.has_tokenizer())
    throw Error(Status::InvalidArgument,
                f.path() + " has no embedded tokenizer: give token ids (--prompt-ids), or convert the checkpoint "
                           "again with its tokenizer.json or tokenizer.model next to config.json");
  auto kind = tokenizer_kind_from_name(s.kind);
  if (!kind) throw Error(Status::Format, f.path() + ": tokenizer kind '" + s.kind + "' is not supported");
  std::string_view bytes = f.tokenizer_bytes();
  try {
    return Tokenizer::load(*kind, bytes, tokenizer_options(s));
  } catch (const Error& e) {
    throw Error(e.status(), f.path() + ": embedded tokenizer (" + s.kind + "): " + e.what());
  }
}

// Every id that ends a sequence: the config's eos_token_id and the tokenizer's
// eos_token_ids (generation_config.json's list), without repeats.
inline std::vector<int32_t> eos_token_ids(const ModelConfig& c) {
  std::vector<int32_t> v;
  auto add = [&](int64_t id) {
    if (id >= 0 && id < c.vocab_size && std::find(v.begin(), v.end(), static_cast<int32_t>(id)) == v.end())
      v.push_back(static_cast<int32_t>(id));
  };
  add(c.eos_token_id);
  for (int64_t id : c.tokenizer.eos_token_ids) add(id);
  return v;
}

// Detokenises one sequence as it is generated and ends it at the first stop
// string: push() returns the text to show now (valid UTF-8; held back: an
// unfinished character, text the next id could change, and a tail that could
// be the start of a stop string); once stopped() the text up to (not
// including) the stop string has been returned and push() returns "".
// finish() returns what is still held back. text() is all returned so far.
// Ids at or past the tokenizer's vocab_size() (padding rows of the model's
// embedding table) stand for no text.
class StopTextStream {
 public:
  StopTextStream(const Tokenizer& t, std::vector<std::string> stops, bool skip_special = true)
      : stream_(t, skip_special), stops_(std::move(stops)), tok_vocab_(t.vocab_size()) {
    stops_.erase(std::remove(stops_.begin(), stops_.end(), std::string()), stops_.end());
  }
  // NOTE: an id the tokenizer does not know (a model's embedding table is often
  // padded past the tokenizer's ids) stands for no text.
  std::string push(int32_t id) {
    if (stopped_ || id < 0 || id >= tok_vocab_) return {};
    return feed(stream_.push(id));
  }
  std::string finish() {
    if (stopped_ || finished_) return {};
    finished_ = true;
    std::string out = feed(stream_.finish());
    if (!stopped_) {
      out += pending_;
      text_ += pending_;
      pending_.clear();
    }
    return out;
  }
  bool stopped() const { return stopped_; }
  const std::string& text() const { return text_; }

 private:
  std::string feed(const std::string& piece) {
    const size_t old = pending_.size();
    pending_ += piece;
    size_t at = std::string::npos;
    for (const auto& s : stops_) {
      const size_t from = old >= s.size() - 1 ? old - (s.size() - 1) : 0;
      at = std::min(at, pending_.find(s, from));
    }
    std::string out;
    if (at != std::string::npos) {
      out = pending_.substr(0, at);
      pending_.clear();
      stopped_ = true;
    } else {
      // Hold back the longest tail that is a proper prefix of a stop string.
      size_t hold = 0;
      for (const auto& s : stops_)
        for (size_t k = std::min(s.size() - 1, pending_.size()); k > hold; --k)
          if (std::string_view(pending_).substr(pending_.size() - k) == std::string_view(s).substr(0, k)) {
            hold = k;
            break;
          }
      out = pending_.substr(0, pending_.size() - hold);
      pending_.erase(0, pending_.size() - hold);
    }
    text_ += out;
    return out;
  }

  TextStream stream_;
  std::vector<std::string> stops_;
  std::string pending_, text_;
  int64_t tok_vocab_;
  bool stopped_ = false, finished_ = false;
};

}  // namespace colibri
