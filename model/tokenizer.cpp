// tokenizer.cpp: the load() factory, kind names and TextStream (see model/tokenizer.h).
#include "model/tokenizer.h"

#include "model/error.h"
#include "model/tokenizer_impl.h"

namespace colibri {

const char* tokenizer_kind_name(TokenizerKind k) {
  switch (k) {
    case TokenizerKind::HfJson:
      return "hf_json";
    case TokenizerKind::SentencePiece:
      return "sentencepiece";
  }
  return "unknown";
}

std::optional<TokenizerKind> tokenizer_kind_from_name(std::string_view s) {
  if (s == "hf_json") return TokenizerKind::HfJson;
  if (s == "sentencepiece") return TokenizerKind::SentencePiece;
  return std::nullopt;
}

std::unique_ptr<Tokenizer> Tokenizer::load(TokenizerKind kind, std::string_view bytes, const TokenizerOptions& opts) {
  switch (kind) {
    case TokenizerKind::HfJson:
      return detail::load_hf_json(bytes, opts);
    case TokenizerKind::SentencePiece:
      return detail::load_sentencepiece(bytes, opts);
  }
  throw Error(Status::InvalidArgument, "tokenizer: unknown kind " + std::to_string(static_cast<int>(kind)));
}

namespace detail {

size_t utf8_incomplete_tail(std::string_view s) {
  // Length of a trailing prefix of a multi-byte character that more bytes could complete.
  size_t n = s.size();
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    unsigned char c = static_cast<unsigned char>(s[n - back]);
    if ((c & 0xC0) == 0x80) continue;  // continuation byte: look further back
    size_t need = c >= 0xF0 && c <= 0xF4 ? 4 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xC2 && c <= 0xDF ? 2 : 1;
    if (need <= back) return 0;
    // The bytes after the lead must be plausible continuations (checked by the validator later).
    return back;
  }
  return 0;
}

std::string utf8_sanitize(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0, n = s.size();
  while (i < n) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      out.push_back(static_cast<char>(c));
      ++i;
      continue;
    }
    size_t need = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) {
      need = 1;
    } else if (c >= 0xE0 && c <= 0xEF) {
      need = 2;
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      need = 3;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    } else {
      out += "\xEF\xBF\xBD";
      ++i;
      continue;
    }
    // Maximal subpart: consume the valid prefix of the sequence, one U+FFFD if incomplete.
    size_t j = i + 1, k = 0;
    for (; k < need && j < n; ++k, ++j) {
      unsigned char d = static_cast<unsigned char>(s[j]);
      unsigned char l = k == 0 ? lo : 0x80, h = k == 0 ? hi : 0xBF;
      if (d < l || d > h) break;
    }
    if (k == need) {
      out.append(s.data() + i, need + 1);
    } else {
      out += "\xEF\xBF\xBD";
    }
    i = j;
  }
  return out;
}

bool utf8_valid(std::string_view s) { return utf8_sanitize(s) == s; }

}  // namespace detail

// ---- TextStream -------------------------------------------------------------
// Like vLLM's detokenize_incrementally: the text of the new ids is
// decode(ids[prefix_..]) minus decode(ids[prefix_..read_]) (prefix_len_ bytes),
// both decoded from the same window start, so decoders that look at the first
// token (SentencePiece's leading-space strip) treat both alike. The window
// start never sits on an id that decode() drops (a skipped special token), so
// that the strip of one leading space only ever applies where decode(all ids)
// applies it too.

TextStream::TextStream(const Tokenizer& t, bool skip_special) : tok_(t), skip_special_(skip_special) {}

std::string TextStream::push(int32_t id) {
  if (id < 0 || id >= tok_.vocab_size())
    throw Error(Status::InvalidArgument, "TextStream: token id " + std::to_string(id) + " outside [0, " +
                                             std::to_string(tok_.vocab_size()) + ")");
  ids_.push_back(id);
  std::string full = tok_.decode(ids_.data() + prefix_, ids_.size() - prefix_, skip_special_);
  if (full.size() < emitted_) return {};  // cannot happen with the supported decoders; hold back
  std::string_view fresh = std::string_view(full).substr(emitted_);
  if (fresh.empty() || detail::utf8_incomplete_tail(fresh) > 0) return {};
  std::string out = detail::utf8_sanitize(fresh);
  // Slide the window: it now starts where the text just returned began.
  size_t start = read_;
  while (start > 0 && skip_special_ && tok_.is_special(ids_[start])) --start;
  read_ = ids_.size();
  prefix_ = start;
  emitted_ = tok_.decode(ids_.data() + prefix_, read_ - prefix_, skip_special_).size();
  return out;
}

std::string TextStream::finish() {
  std::string full = tok_.decode(ids_.data() + prefix_, ids_.size() - prefix_, skip_special_);
  std::string out = full.size() > emitted_ ? detail::utf8_sanitize(std::string_view(full).substr(emitted_)) : "";
  read_ = ids_.size();
  prefix_ = read_;
  emitted_ = 0;
  return out;
}

}  // namespace colibri
