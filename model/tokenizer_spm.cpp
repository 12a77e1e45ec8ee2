// tokenizer_spm.cpp: kind "sentencepiece", a SentencePiece tokenizer.model run
// by libsentencepiece, with what transformers (>= 5, LlamaTokenizer on the same
// file) does around it (see model/tokenizer.h):
//   - the special tokens <unk>, <s>, </s> (and TokenizerOptions::extra_special)
//     written in the text are recognised first (longest match) and become their
//     ids; the text between them goes to SentencePiece;
//   - SentencePiece's own normaliser is switched off (transformers ignores it):
//     no dummy prefix, no whitespace collapsing, no precompiled char map; instead
//     one U+2581 is prepended (Metaspace) to the text before the first special
//     token when it starts the text (legacy false, prepend_scheme "first") or to
//     every piece of text (legacy true, "always"), unless it already starts with
//     a space;
//   - add_special: BOS first (add_bos), EOS last (add_eos);
//   - decode: the pieces joined, U+2581 -> space, <0xNN> pieces -> the byte,
//     special tokens as their text (or dropped with skip_special), then one
//     leading space removed (decoders Replace, ByteFallback, Fuse, Strip).
#include <sentencepiece_processor.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <unordered_map>
#include <unordered_set>

#include "model/error.h"
#include "model/tokenizer_impl.h"

namespace colibri {
namespace {

[[noreturn]] void format_error(const std::string& m) { throw Error(Status::Format, "tokenizer.model: " + m); }

// Protobuf wire helpers (just enough to patch ModelProto.normalizer_spec).
bool read_varint(std::string_view s, size_t& i, uint64_t& v) {
  v = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    if (i >= s.size()) return false;
    uint8_t b = static_cast<uint8_t>(s[i++]);
    v |= static_cast<uint64_t>(b & 0x7F) << shift;
    if (!(b & 0x80)) return true;
  }
  return false;
}
void write_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

// The model with NormalizerSpec {precompiled_charsmap: "", add_dummy_prefix:
// false, remove_extra_whitespaces: false} (later fields win in protobuf).
std::string patch_normalizer(std::string_view model) {
  const std::string patch = std::string("\x12\x00\x18\x00\x20\x00", 6);
  std::string out;
  out.reserve(model.size() + 16);
  size_t i = 0;
  bool patched = false;
  while (i < model.size()) {
    size_t field_start = i;
    uint64_t tag;
    if (!read_varint(model, i, tag)) format_error("not a SentencePiece model (bad protobuf tag)");
    uint32_t field = static_cast<uint32_t>(tag >> 3), wire = static_cast<uint32_t>(tag & 7);
    if (field == 0) format_error("not a SentencePiece model (protobuf field 0)");
    if (wire == 0) {
      uint64_t v;
      if (!read_varint(model, i, v)) format_error("not a SentencePiece model (truncated varint)");
    } else if (wire == 1 || wire == 5) {
      size_t n = wire == 1 ? 8 : 4;
      if (model.size() - i < n) format_error("not a SentencePiece model (truncated)");
      i += n;
    } else if (wire == 2) {
      uint64_t len;
      if (!read_varint(model, i, len) || len > model.size() - i) format_error("not a SentencePiece model (bad length)");
      if (field == 3) {  // normalizer_spec
        std::string body(model.substr(i, len));
        body += patch;
        write_varint(out, tag);
        write_varint(out, body.size());
        out += body;
        i += len;
        patched = true;
        continue;
      }
      i += len;
    } else {
      format_error("not a SentencePiece model (protobuf wire type " + std::to_string(wire) + ")");
    }
    out.append(model.data() + field_start, i - field_start);
  }
  if (!patched) {
    write_varint(out, (3 << 3) | 2);
    write_varint(out, patch.size());
    out += patch;
  }
  return out;
}

class SpmTokenizer final : public Tokenizer {
 public:
  SpmTokenizer(std::string_view bytes, const TokenizerOptions& opts) : opts_(opts) {
    if (bytes.empty()) format_error("empty file");
    std::string patched = patch_normalizer(bytes);
    auto st = sp_.LoadFromSerializedProto(patched);
    if (!st.ok()) format_error("libsentencepiece cannot load it: " + st.ToString());
    n_pieces_ = sp_.GetPieceSize();
    if (n_pieces_ <= 0) format_error("no pieces");
    vocab_ = n_pieces_;
    for (int id : {sp_.unk_id(), sp_.bos_id(), sp_.eos_id()})
      if (id >= 0 && id < n_pieces_) add_special(id, sp_.IdToPiece(id));
    for (auto& [id, content] : opts.extra_special) {
      if (id < 0 || id >= (1 << 24)) throw Error(Status::Format, "extra special token id " + std::to_string(id) + " out of range");
      if (content.empty()) throw Error(Status::Format, "extra special token " + std::to_string(id) + " has empty content");
      add_special(id, content);
    }
    special_flag_.assign(static_cast<size_t>(vocab_), 0);
    for (auto& [content, id] : specials_) special_flag_[id] = 1;
    for (auto& [content, id] : specials_) by_first_[static_cast<unsigned char>(content[0])].push_back(content);
    for (auto& v : by_first_) std::sort(v.begin(), v.end(), [](auto& a, auto& b) { return a.size() > b.size(); });
    piece_text_.resize(static_cast<size_t>(vocab_));
    for (int id = 0; id < vocab_; ++id) {
      auto ov = special_text_.find(id);
      if (ov != special_text_.end()) {
        piece_text_[id] = ov->second;
        continue;
      }
      if (id >= n_pieces_) continue;
      std::string p = sp_.IdToPiece(id);
      if (p.size() == 6 && p.compare(0, 3, "<0x") == 0 && p[5] == '>' && isxdigit(p[3]) && isxdigit(p[4])) {
        piece_text_[id] = std::string(1, static_cast<char>(std::stoi(p.substr(3, 2), nullptr, 16)));
        continue;
      }
      std::string t;
      for (size_t i = 0; i < p.size();) {
        if (p.compare(i, 3, "\xE2\x96\x81") == 0) {
          t.push_back(' ');
          i += 3;
        } else {
          t.push_back(p[i++]);
        }
      }
      piece_text_[id] = std::move(t);
    }
  }

  TokenizerKind kind() const override { return TokenizerKind::SentencePiece; }
  int64_t vocab_size() const override { return vocab_; }

  std::vector<int32_t> encode(std::string_view text, bool add_special) const override {
    std::vector<int32_t> out;
    if (add_special && opts_.add_bos && sp_.bos_id() >= 0) out.push_back(sp_.bos_id());
    size_t seg = 0, i = 0;
    auto flush = [&](size_t end) {
      if (end > seg) encode_piece(text.substr(seg, end - seg), seg == 0, out);
    };
    while (i < text.size()) {
      const std::string* hit = nullptr;
      for (const std::string& c : by_first_[static_cast<unsigned char>(text[i])])
        if (text.size() - i >= c.size() && std::memcmp(text.data() + i, c.data(), c.size()) == 0) {
          hit = &c;
          break;
        }
      if (!hit) {
        ++i;
        continue;
      }
      flush(i);
      out.push_back(specials_.at(*hit));
      i += hit->size();
      seg = i;
    }
    flush(text.size());
    if (add_special && opts_.add_eos && sp_.eos_id() >= 0) out.push_back(sp_.eos_id());
    return out;
  }

  std::string decode(const int32_t* ids, size_t n, bool skip_special) const override {
    std::string out;
    for (size_t i = 0; i < n; ++i) {
      int32_t id = ids[i];
      if (id < 0 || id >= vocab_)
        throw Error(Status::InvalidArgument,
                    "decode: token id " + std::to_string(id) + " outside [0, " + std::to_string(vocab_) + ")");
      if (skip_special && special_flag_[id]) continue;
      out += piece_text_[id];
    }
    if (!out.empty() && out[0] == ' ') out.erase(0, 1);
    return out;
  }

  std::optional<int32_t> token_id(std::string_view piece) const override {
    auto it = specials_.find(std::string(piece));
    if (it != specials_.end()) return it->second;
    int id = sp_.PieceToId(piece);
    if (id >= 0 && id < n_pieces_ && sp_.IdToPiece(id) == piece) return id;
    return std::nullopt;
  }
  bool is_special(int32_t id) const override { return id >= 0 && id < vocab_ && special_flag_[id]; }

 private:
  sentencepiece::SentencePieceProcessor sp_;
  TokenizerOptions opts_;
  int n_pieces_ = 0;
  int64_t vocab_ = 0;
  std::unordered_map<std::string, int32_t> specials_;
  std::unordered_map<int32_t, std::string> special_text_;
  std::vector<char> special_flag_;
  std::array<std::vector<std::string>, 256> by_first_;
  std::vector<std::string> piece_text_;

  void add_special(int32_t id, const std::string& content) {
    specials_[content] = id;
    special_text_[id] = content;
    vocab_ = std::max<int64_t>(vocab_, int64_t{id} + 1);
  }

  void encode_piece(std::string_view s, bool at_start, std::vector<int32_t>& out) const {
    std::string text;
    bool starts_ws = s[0] == ' ' || (s.size() >= 3 && s.compare(0, 3, "\xE2\x96\x81") == 0);
    if ((opts_.legacy || at_start) && !starts_ws) text.push_back(' ');
    text.append(s);
    std::vector<int> ids;
    auto st = sp_.Encode(text, &ids);
    if (!st.ok()) throw Error(Status::Internal, "sentencepiece encode failed: " + st.ToString());
    out.insert(out.end(), ids.begin(), ids.end());
  }
};

}  // namespace

namespace detail {
std::unique_ptr<Tokenizer> load_sentencepiece(std::string_view bytes, const TokenizerOptions& opts) {
  return std::make_unique<SpmTokenizer>(bytes, opts);
}
}  // namespace detail

}  // namespace colibri
