// tokenizer_bpe.cpp: kind "hf_json", a Hugging Face tokenizer.json with a BPE
// model, as the `tokenizers` library runs it (see model/tokenizer.h). Supported:
//   normalizer     null | NFC | NFKC | NFD | NFKD | Sequence of those
//   pre_tokenizer  null | ByteLevel(add_prefix_space, use_regex: GPT-2 regex) |
//                  Split(Regex|String, behavior Isolated|Removed, invert false) |
//                  Digits(individual_digits) | Sequence of those
//   model          BPE (vocab, merges "a b" or ["a","b"], ignore_merges,
//                  byte_fallback false, unk_token optional)
//   added_tokens   special and not, longest match in the raw text, single_word,
//                  lstrip, rstrip
//   post_processor null | ByteLevel | TemplateProcessing | Sequence of those
//   decoder        ByteLevel
// Anything else is refused with Error(Unsupported) naming it.
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <mutex>
#include <queue>
#include <unordered_map>
#include <unordered_set>

#include <nlohmann/json.hpp>

#include "model/error.h"
#include "model/json_util.h"
#include "model/tokenizer_impl.h"

namespace colibri {
namespace {

using nlohmann::json;

constexpr int64_t kMaxVocab = int64_t{1} << 24;  // ids beyond this are refused (no model is that big)
const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

[[noreturn]] void format_error(const std::string& m) { throw Error(Status::Format, "tokenizer.json: " + m); }
[[noreturn]] void unsupported(const std::string& m) { throw Error(Status::Unsupported, "tokenizer.json: " + m); }

// GPT-2's byte <-> printable-unicode table.
struct ByteTable {
  std::array<std::string, 256> to_str;            // byte -> UTF-8 of its stand-in character
  std::unordered_map<uint32_t, uint8_t> from_cp;  // stand-in code point -> byte
  ByteTable() {
    std::vector<int> bs;
    for (int b = '!'; b <= '~'; ++b) bs.push_back(b);
    for (int b = 0xA1; b <= 0xAC; ++b) bs.push_back(b);
    for (int b = 0xAE; b <= 0xFF; ++b) bs.push_back(b);
    std::array<int, 256> cp{};
    std::vector<bool> seen(256, false);
    for (int b : bs) cp[b] = b, seen[b] = true;
    int n = 0;
    for (int b = 0; b < 256; ++b)
      if (!seen[b]) cp[b] = 256 + n++;
    for (int b = 0; b < 256; ++b) {
      utf8proc_uint8_t buf[4];
      auto len = utf8proc_encode_char(cp[b], buf);
      to_str[b].assign(reinterpret_cast<char*>(buf), len);
      from_cp[cp[b]] = static_cast<uint8_t>(b);
    }
  }
};
const ByteTable& byte_table() {
  static const ByteTable t;
  return t;
}

// A compiled PCRE2 regex (UTF, UCP, JIT), invalid UTF-8 in the subject allowed.
class Regex {
 public:
  Regex(const std::string& pattern, bool literal) {
    int err = 0;
    PCRE2_SIZE off = 0;
    uint32_t flags = PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF | (literal ? PCRE2_LITERAL : 0);
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), flags, &err, &off, nullptr);
    if (!code_) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof msg);
      unsupported("pre_tokenizer regex " + json(pattern).dump() + " does not compile (PCRE2 at offset " +
                  std::to_string(off) + ": " + reinterpret_cast<char*>(msg) + ")");
    }
    jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Calls f(begin, end) for every match in s (non-overlapping, left to right).
  template <class F>
  void for_each_match(std::string_view s, F&& f) const {
    thread_local std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> md(
        pcre2_match_data_create(4, nullptr), &pcre2_match_data_free);
    size_t pos = 0;
    while (pos <= s.size()) {
      int rc = jit_ ? pcre2_jit_match(code_, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), pos, 0, md.get(), nullptr)
                    : pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), pos, 0, md.get(), nullptr);
      if (rc < 0) break;  // no match (or an error: the rest is left as a gap)
      PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
      size_t b = ov[0], e = ov[1];
      if (e == b) {  // empty match: step one character ahead
        size_t next = b + 1;
        while (next < s.size() && (static_cast<unsigned char>(s[next]) & 0xC0) == 0x80) ++next;
        pos = next;
        continue;
      }
      f(b, e);
      pos = e;
    }
  }

 private:
  pcre2_code* code_ = nullptr;
  bool jit_ = false;
};

enum class NormKind { NFC, NFKC, NFD, NFKD };

struct PreStep {
  enum Type { ByteLevel, Split, Digits } type = ByteLevel;
  bool add_prefix_space = false;  // ByteLevel
  std::shared_ptr<Regex> regex;   // ByteLevel with use_regex, Split, Digits
  bool remove = false;            // Split behavior Removed
};

struct AddedTok {
  int32_t id;
  std::string content;
  bool special, single_word, lstrip, rstrip;
};

struct TemplatePiece {
  bool is_sequence;
  std::vector<int32_t> ids;  // special token ids
};

const json& req(const json& o, const char* key, const std::string& where) {
  auto it = o.find(key);
  if (it == o.end()) format_error(where + " lacks \"" + key + "\"");
  return *it;
}
std::string get_str(const json& o, const char* key, const std::string& where) {
  const json& v = req(o, key, where);
  if (!v.is_string()) format_error(where + "." + key + " is not a string but " + json_show(v));
  return v.get<std::string>();
}
bool get_bool(const json& o, const char* key, bool def, const std::string& where) {
  auto it = o.find(key);
  if (it == o.end() || it->is_null()) return def;
  if (!it->is_boolean()) format_error(where + "." + key + " is not a boolean but " + json_show(*it));
  return it->get<bool>();
}
std::string type_of(const json& o, const std::string& where) {
  if (!o.is_object()) format_error(where + " is not an object but " + json_show(o));
  return get_str(o, "type", where);
}

bool is_ws_cp(int32_t c) {
  auto cat = utf8proc_category(c);
  return c == ' ' || (c >= 9 && c <= 13) || c == 0x85 || cat == UTF8PROC_CATEGORY_ZS || cat == UTF8PROC_CATEGORY_ZL ||
         cat == UTF8PROC_CATEGORY_ZP;
}
bool is_word_cp(int32_t c) {
  auto cat = utf8proc_category(c);
  return c == '_' || (cat >= UTF8PROC_CATEGORY_LU && cat <= UTF8PROC_CATEGORY_LO) ||
         (cat >= UTF8PROC_CATEGORY_ND && cat <= UTF8PROC_CATEGORY_NO) ||
         (cat >= UTF8PROC_CATEGORY_MN && cat <= UTF8PROC_CATEGORY_ME);
}
// The code point before/at a byte position (-1 at the ends or for invalid bytes).
int32_t cp_at(std::string_view s, size_t i) {
  if (i >= s.size()) return -1;
  utf8proc_int32_t c;
  auto n = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(s.data() + i), s.size() - i, &c);
  return n > 0 ? c : -1;
}
size_t cp_start_before(std::string_view s, size_t i) {
  if (i == 0) return std::string::npos;
  size_t j = i - 1;
  while (j > 0 && (static_cast<unsigned char>(s[j]) & 0xC0) == 0x80 && i - j < 4) --j;
  return j;
}

class HfBpeTokenizer final : public Tokenizer {
 public:
  HfBpeTokenizer(std::string_view bytes, const TokenizerOptions& opts) {
    json j;
    try {
      j = json::parse(bytes.begin(), bytes.end());
    } catch (const json::exception& e) {
      format_error(std::string("not valid JSON (") + e.what() + ")");
    }
    if (!j.is_object()) format_error("the top level is not an object but " + json_show(j));
    parse_model(req(j, "model", "tokenizer.json"));
    parse_added(j.contains("added_tokens") ? j["added_tokens"] : json::array());
    for (auto& [id, content] : opts.extra_special) add_added({id, content, true, false, false, false});
    parse_normalizer(j.contains("normalizer") ? j["normalizer"] : json());
    parse_pre(j.contains("pre_tokenizer") ? j["pre_tokenizer"] : json(), "pre_tokenizer");
    parse_post(j.contains("post_processor") ? j["post_processor"] : json(), "post_processor");
    parse_decoder(j.contains("decoder") ? j["decoder"] : json());
    finish_setup();
  }

  TokenizerKind kind() const override { return TokenizerKind::HfJson; }
  int64_t vocab_size() const override { return static_cast<int64_t>(id_bytes_.size()); }

  std::vector<int32_t> encode(std::string_view text, bool add_special) const override {
    std::vector<int32_t> body;
    body.reserve(text.size() / 3 + 4);
    split_added(text, [&](std::string_view seg, int32_t added_id) {
      if (added_id >= 0)
        body.push_back(added_id);
      else
        encode_segment(seg, body);
    });
    if (!add_special || post_.empty()) return body;
    std::vector<int32_t> out;
    out.reserve(body.size() + 8);
    for (const auto& p : post_) {
      if (p.is_sequence)
        out.insert(out.end(), body.begin(), body.end());
      else
        out.insert(out.end(), p.ids.begin(), p.ids.end());
    }
    return out;
  }

  std::string decode(const int32_t* ids, size_t n, bool skip_special) const override {
    std::string out;
    for (size_t i = 0; i < n; ++i) {
      int32_t id = ids[i];
      if (id < 0 || id >= vocab_size())
        throw Error(Status::InvalidArgument,
                    "decode: token id " + std::to_string(id) + " outside [0, " + std::to_string(vocab_size()) + ")");
      if (skip_special && special_[id]) continue;
      out += id_bytes_[id];
    }
    return out;
  }

  std::optional<int32_t> token_id(std::string_view piece) const override {
    auto a = added_by_content_.find(std::string(piece));
    if (a != added_by_content_.end()) return added_[a->second].id;
    auto v = vocab_.find(std::string(piece));
    if (v != vocab_.end()) return v->second;
    return std::nullopt;
  }
  bool is_special(int32_t id) const override { return id >= 0 && id < vocab_size() && special_[id]; }

 private:
  // ---- model ----
  std::unordered_map<std::string, int32_t> vocab_;
  std::vector<std::string> id_token_;  // vocab string per id ("" for holes)
  struct MergeVal {
    int32_t rank, id;
  };
  std::unordered_map<uint64_t, MergeVal> merges_;
  bool ignore_merges_ = false;
  std::optional<int32_t> unk_;
  bool byte_level_ = false;               // some pre-tokeniser step is ByteLevel
  std::array<int32_t, 256> byte_id_{};    // byte -> id of its stand-in (-1 if none)

  std::vector<NormKind> norm_;
  std::vector<PreStep> pre_;
  std::vector<TemplatePiece> post_;

  std::vector<AddedTok> added_;
  std::unordered_map<std::string, size_t> added_by_content_;
  std::array<std::vector<size_t>, 256> added_by_first_;  // longest first

  std::vector<std::string> id_bytes_;  // what decode() emits per id
  std::vector<char> special_;

  mutable std::mutex cache_mu_;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache_;

  static uint64_t pair_key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }

  void parse_model(const json& m) {
    if (!m.is_object()) format_error("model is not an object but " + json_show(m));
    std::string type = m.contains("type") ? type_of(m, "model") : std::string("BPE");
    if (type != "BPE") unsupported("model type \"" + type + "\" (only BPE is implemented)");
    if (get_bool(m, "byte_fallback", false, "model"))
      unsupported("model BPE with byte_fallback true (SentencePiece-style BPE; use the sentencepiece kind)");
    for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      auto it = m.find(k);
      if (it != m.end() && !it->is_null() && !(it->is_string() && it->get<std::string>().empty()))
        unsupported(std::string("model BPE with ") + k + " " + json_show(*it));
    }
    if (auto it = m.find("dropout"); it != m.end() && !it->is_null() && !(it->is_number() && it->get<double>() == 0.0))
      unsupported("model BPE with dropout " + json_show(*it));
    ignore_merges_ = get_bool(m, "ignore_merges", false, "model");
    const json& vocab = req(m, "vocab", "model");
    if (!vocab.is_object()) format_error("model.vocab is not an object but " + json_show(vocab));
    int64_t max_id = -1;
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      if (!it.value().is_number_integer())
        format_error("model.vocab[" + json(it.key()).dump() + "] is not an integer id but " + json_show(it.value()));
      int64_t id = it.value().get<int64_t>();
      if (id < 0 || id >= kMaxVocab)
        format_error("model.vocab[" + json(it.key()).dump() + "] = " + std::to_string(id) + " is out of range [0, " +
                     std::to_string(kMaxVocab) + ")");
      vocab_[it.key()] = static_cast<int32_t>(id);
      max_id = std::max(max_id, id);
    }
    id_token_.assign(static_cast<size_t>(max_id + 1), std::string());
    for (auto& [s, id] : vocab_) id_token_[id] = s;
    const json& merges = req(m, "merges", "model");
    if (!merges.is_array()) format_error("model.merges is not an array but " + json_show(merges));
    merges_.reserve(merges.size() * 2);
    for (size_t r = 0; r < merges.size(); ++r) {
      const json& e = merges[r];
      std::string a, b;
      if (e.is_string()) {
        const std::string s = e.get<std::string>();
        size_t sp = s.find(' ');
        if (sp == std::string::npos || sp == 0 || sp + 1 >= s.size() || s.find(' ', sp + 1) != std::string::npos)
          format_error("model.merges[" + std::to_string(r) + "] = " + e.dump() + " is not two tokens \"a b\"");
        a = s.substr(0, sp), b = s.substr(sp + 1);
      } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
        a = e[0].get<std::string>(), b = e[1].get<std::string>();
      } else {
        format_error("model.merges[" + std::to_string(r) + "] is neither \"a b\" nor [\"a\", \"b\"] but " + json_show(e));
      }
      auto ia = vocab_.find(a), ib = vocab_.find(b), iab = vocab_.find(a + b);
      if (ia == vocab_.end() || ib == vocab_.end() || iab == vocab_.end())
        format_error("model.merges[" + std::to_string(r) + "] (" + json(a).dump() + ", " + json(b).dump() + "): " +
                     (ia == vocab_.end() ? json(a).dump() : ib == vocab_.end() ? json(b).dump() : json(a + b).dump()) +
                     " is not in the vocab");
      merges_.try_emplace(pair_key(ia->second, ib->second), MergeVal{static_cast<int32_t>(r), iab->second});
    }
    if (auto it = m.find("unk_token"); it != m.end() && !it->is_null()) {
      if (!it->is_string()) format_error("model.unk_token is not a string but " + json_show(*it));
      auto u = vocab_.find(it->get<std::string>());
      if (u == vocab_.end()) format_error("model.unk_token " + it->dump() + " is not in the vocab");
      unk_ = u->second;
    }
  }

  void add_added(AddedTok t) {
    if (t.id < 0 || t.id >= kMaxVocab)
      format_error("added token " + json(t.content).dump() + " has id " + std::to_string(t.id) + " out of range");
    if (t.content.empty()) format_error("added token with id " + std::to_string(t.id) + " has empty content");
    auto it = added_by_content_.find(t.content);
    if (it != added_by_content_.end()) {
      added_[it->second] = t;
      return;
    }
    added_by_content_[t.content] = added_.size();
    added_.push_back(std::move(t));
  }

  void parse_added(const json& a) {
    if (!a.is_array()) format_error("added_tokens is not an array but " + json_show(a));
    for (size_t i = 0; i < a.size(); ++i) {
      const json& t = a[i];
      std::string w = "added_tokens[" + std::to_string(i) + "]";
      if (!t.is_object()) format_error(w + " is not an object but " + json_show(t));
      const json& id = req(t, "id", w);
      if (!id.is_number_integer()) format_error(w + ".id is not an integer but " + json_show(id));
      int64_t v = id.get<int64_t>();
      if (v < 0 || v >= kMaxVocab) format_error(w + ".id = " + std::to_string(v) + " is out of range");
      add_added({static_cast<int32_t>(v), get_str(t, "content", w), get_bool(t, "special", false, w),
                 get_bool(t, "single_word", false, w), get_bool(t, "lstrip", false, w), get_bool(t, "rstrip", false, w)});
    }
  }

  void parse_normalizer(const json& n) {
    if (n.is_null()) return;
    std::string t = type_of(n, "normalizer");
    if (t == "Sequence") {
      const json& seq = req(n, "normalizers", "normalizer");
      if (!seq.is_array()) format_error("normalizer.normalizers is not an array");
      for (const json& x : seq) parse_normalizer(x);
    } else if (t == "NFC") {
      norm_.push_back(NormKind::NFC);
    } else if (t == "NFKC") {
      norm_.push_back(NormKind::NFKC);
    } else if (t == "NFD") {
      norm_.push_back(NormKind::NFD);
    } else if (t == "NFKD") {
      norm_.push_back(NormKind::NFKD);
    } else {
      unsupported("normalizer type \"" + t + "\"");
    }
  }

  void parse_pre(const json& p, const std::string& where) {
    if (p.is_null()) return;
    std::string t = type_of(p, where);
    if (t == "Sequence") {
      const json& seq = req(p, "pretokenizers", where);
      if (!seq.is_array()) format_error(where + ".pretokenizers is not an array");
      for (size_t i = 0; i < seq.size(); ++i) parse_pre(seq[i], where + ".pretokenizers[" + std::to_string(i) + "]");
    } else if (t == "ByteLevel") {
      PreStep s;
      s.type = PreStep::ByteLevel;
      s.add_prefix_space = get_bool(p, "add_prefix_space", true, where);
      if (get_bool(p, "use_regex", true, where)) s.regex = std::make_shared<Regex>(kGpt2Pattern, false);
      byte_level_ = true;
      pre_.push_back(std::move(s));
    } else if (t == "Split") {
      PreStep s;
      s.type = PreStep::Split;
      const json& pat = req(p, "pattern", where);
      if (!pat.is_object()) format_error(where + ".pattern is not an object but " + json_show(pat));
      if (pat.contains("Regex") && pat["Regex"].is_string())
        s.regex = std::make_shared<Regex>(pat["Regex"].get<std::string>(), false);
      else if (pat.contains("String") && pat["String"].is_string())
        s.regex = std::make_shared<Regex>(pat["String"].get<std::string>(), true);
      else
        format_error(where + ".pattern is neither {\"Regex\": ...} nor {\"String\": ...}");
      std::string beh = get_str(p, "behavior", where);
      if (beh == "Removed")
        s.remove = true;
      else if (beh != "Isolated")
        unsupported(where + " Split with behavior \"" + beh + "\" (Isolated and Removed are implemented)");
      if (get_bool(p, "invert", false, where)) unsupported(where + " Split with invert true");
      pre_.push_back(std::move(s));
    } else if (t == "Digits") {
      PreStep s;
      s.type = PreStep::Digits;
      s.regex = std::make_shared<Regex>(get_bool(p, "individual_digits", false, where) ? "\\p{N}" : "\\p{N}+", false);
      pre_.push_back(std::move(s));
    } else {
      unsupported(where + " type \"" + t + "\"");
    }
  }

  int32_t special_id_of(const json& tokens, const std::string& name, const std::string& where, std::vector<int32_t>& out) {
    auto it = tokens.find(name);
    if (it == tokens.end() || !it->is_object())
      format_error(where + ": special token " + json(name).dump() + " is not in special_tokens");
    const json& ids = req(*it, "ids", where + ".special_tokens." + name);
    if (!ids.is_array()) format_error(where + ".special_tokens." + name + ".ids is not an array");
    for (const json& x : ids) {
      if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() >= kMaxVocab)
        format_error(where + ".special_tokens." + name + ".ids has a bad id " + json_show(x));
      out.push_back(x.get<int32_t>());
    }
    return 0;
  }

  void parse_post(const json& p, const std::string& where) {
    if (p.is_null()) return;
    std::string t = type_of(p, where);
    if (t == "Sequence") {
      const json& seq = req(p, "processors", where);
      if (!seq.is_array()) format_error(where + ".processors is not an array");
      for (size_t i = 0; i < seq.size(); ++i) parse_post(seq[i], where + ".processors[" + std::to_string(i) + "]");
    } else if (t == "ByteLevel") {
      // Offsets only: no effect on ids.
    } else if (t == "TemplateProcessing") {
      if (!post_.empty()) unsupported(where + ": more than one TemplateProcessing");
      const json& single = req(p, "single", where);
      if (!single.is_array()) format_error(where + ".single is not an array");
      const json& tokens = p.contains("special_tokens") ? p["special_tokens"] : json::object();
      bool seen_a = false;
      for (const json& piece : single) {
        if (piece.is_object() && piece.contains("Sequence")) {
          const json& s = piece["Sequence"];
          if (!s.is_object() || !s.contains("id") || s["id"] != "A")
            format_error(where + ".single has a Sequence other than $A");
          post_.push_back({true, {}});
          seen_a = true;
        } else if (piece.is_object() && piece.contains("SpecialToken")) {
          const json& s = piece["SpecialToken"];
          if (!s.is_object() || !s.contains("id") || !s["id"].is_string())
            format_error(where + ".single has a SpecialToken without an id");
          TemplatePiece tp{false, {}};
          special_id_of(tokens, s["id"].get<std::string>(), where, tp.ids);
          post_.push_back(std::move(tp));
        } else {
          format_error(where + ".single has an element that is neither Sequence nor SpecialToken");
        }
      }
      if (!seen_a) format_error(where + ".single lacks $A");
    } else {
      unsupported(where + " type \"" + t + "\"");
    }
  }

  void parse_decoder(const json& d) {
    if (d.is_null()) unsupported("decoder null (only ByteLevel is implemented)");
    std::string t = type_of(d, "decoder");
    if (t != "ByteLevel") unsupported("decoder type \"" + t + "\" (only ByteLevel is implemented)");
  }

  void finish_setup() {
    int64_t n = static_cast<int64_t>(id_token_.size());
    for (auto& a : added_) n = std::max<int64_t>(n, int64_t{a.id} + 1);
    for (auto& p : post_)
      for (int32_t id : p.ids) n = std::max<int64_t>(n, int64_t{id} + 1);
    if (n == 0) format_error("model.vocab is empty");
    id_token_.resize(n);
    special_.assign(n, 0);
    id_bytes_.assign(n, std::string());
    const ByteTable& bt = byte_table();
    // As the ByteLevel decoder: a token whose characters all stand for bytes
    // gives those bytes; any other token gives its own UTF-8.
    auto token_bytes = [&](const std::string& tok) {
      std::string out;
      size_t i = 0;
      while (i < tok.size()) {
        utf8proc_int32_t c;
        auto len = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(tok.data() + i), tok.size() - i, &c);
        if (len <= 0) return tok;
        auto f = bt.from_cp.find(static_cast<uint32_t>(c));
        if (f == bt.from_cp.end()) return tok;
        out.push_back(static_cast<char>(f->second));
        i += len;
      }
      return out;
    };
    for (int64_t i = 0; i < static_cast<int64_t>(id_token_.size()); ++i)
      if (!id_token_[i].empty()) id_bytes_[i] = token_bytes(id_token_[i]);
    for (auto& a : added_) {
      id_bytes_[a.id] = token_bytes(a.content);
      special_[a.id] = a.special;
    }
    for (size_t i = 0; i < added_.size(); ++i)
      added_by_first_[static_cast<unsigned char>(added_[i].content[0])].push_back(i);
    for (auto& v : added_by_first_)
      std::stable_sort(v.begin(), v.end(),
                       [&](size_t a, size_t b) { return added_[a].content.size() > added_[b].content.size(); });
    for (int b = 0; b < 256; ++b) {
      auto it = vocab_.find(byte_level_ ? bt.to_str[b] : std::string(1, static_cast<char>(b)));
      byte_id_[b] = it == vocab_.end() ? -1 : it->second;
    }
  }

  // ---- added tokens ----
  // Calls f(segment, -1) for text between added tokens and f({}, id) for each added token.
  template <class F>
  void split_added(std::string_view text, F&& f) const {
    size_t seg_start = 0, i = 0;
    while (i < text.size()) {
      const auto& cands = added_by_first_[static_cast<unsigned char>(text[i])];
      const AddedTok* hit = nullptr;
      for (size_t c : cands) {
        const AddedTok& a = added_[c];
        if (text.size() - i < a.content.size() || std::memcmp(text.data() + i, a.content.data(), a.content.size()) != 0)
          continue;
        if (a.single_word) {
          size_t pb = cp_start_before(text, i);
          int32_t before = pb == std::string::npos ? -1 : cp_at(text, pb);
          int32_t after = cp_at(text, i + a.content.size());
          if ((before >= 0 && is_word_cp(before)) || (after >= 0 && is_word_cp(after))) continue;
        }
        hit = &a;
        break;
      }
      if (!hit) {
        ++i;
        continue;
      }
      size_t b = i, e = i + hit->content.size();
      if (hit->lstrip)
        while (b > seg_start) {
          size_t pb = cp_start_before(text, b);
          int32_t c = cp_at(text, pb);
          if (c < 0 || !is_ws_cp(c)) break;
          b = pb;
        }
      if (hit->rstrip)
        while (e < text.size()) {
          int32_t c = cp_at(text, e);
          if (c < 0 || !is_ws_cp(c)) break;
          e += utf8proc_charwidth(c) >= 0 ? (c < 0x80 ? 1 : c < 0x800 ? 2 : c < 0x10000 ? 3 : 4) : 1;
        }
      if (b > seg_start) f(text.substr(seg_start, b - seg_start), -1);
      f(std::string_view(), hit->id);
      i = seg_start = e;
    }
    if (seg_start < text.size()) f(text.substr(seg_start), -1);
  }

  // ---- normalisation ----
  static std::string normalize_valid(std::string_view s, NormKind k) {
    int opts = UTF8PROC_STABLE;
    switch (k) {
      case NormKind::NFC: opts |= UTF8PROC_COMPOSE; break;
      case NormKind::NFKC: opts |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT; break;
      case NormKind::NFD: opts |= UTF8PROC_DECOMPOSE; break;
      case NormKind::NFKD: opts |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT; break;
    }
    utf8proc_uint8_t* out = nullptr;
    auto n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()), static_cast<utf8proc_ssize_t>(s.size()),
                          &out, static_cast<utf8proc_option_t>(opts));
    if (n < 0) {
      free(out);
      return std::string(s);
    }
    std::string r(reinterpret_cast<char*>(out), static_cast<size_t>(n));
    free(out);
    return r;
  }
  std::string normalize(std::string_view s) const {
    std::string cur(s);
    if (norm_.empty()) return cur;
    bool ascii = std::all_of(s.begin(), s.end(), [](char c) { return static_cast<unsigned char>(c) < 0x80; });
    if (ascii) return cur;  // every normal form leaves ASCII as it is
    for (NormKind k : norm_) {
      if (detail::utf8_valid(cur)) {
        cur = normalize_valid(cur, k);
        continue;
      }
      // Normalise the valid runs; invalid bytes stay as they are.
      std::string out;
      size_t i = 0, run = 0;
      while (i < cur.size()) {
        utf8proc_int32_t c;
        auto len = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(cur.data() + i), cur.size() - i, &c);
        if (len > 0) {
          i += len;
          continue;
        }
        out += normalize_valid(std::string_view(cur).substr(run, i - run), k);
        out.push_back(cur[i]);
        run = ++i;
      }
      out += normalize_valid(std::string_view(cur).substr(run), k);
      cur = std::move(out);
    }
    return cur;
  }

  // ---- pre-tokenisation + BPE ----
  void encode_segment(std::string_view seg, std::vector<int32_t>& out) const {
    std::string norm = normalize(seg);
    if (norm.empty()) return;
    // Pieces as (begin, end) into owned strings; add_prefix_space may add a space.
    std::vector<std::string> pieces{std::move(norm)};
    for (const PreStep& st : pre_) {
      std::vector<std::string> next;
      next.reserve(pieces.size() * 2);
      for (std::string& p : pieces) {
        if (st.type == PreStep::ByteLevel && st.add_prefix_space && (p.empty() || p[0] != ' ')) p.insert(p.begin(), ' ');
        if (!st.regex) {
          next.push_back(std::move(p));
          continue;
        }
        size_t last = 0;
        st.regex->for_each_match(p, [&](size_t b, size_t e) {
          if (b > last) next.emplace_back(p, last, b - last);
          if (!st.remove) next.emplace_back(p, b, e - b);
          last = e;
        });
        if (last < p.size()) next.emplace_back(p, last, p.size() - last);
      }
      pieces = std::move(next);
    }
    for (const std::string& w : pieces)
      if (!w.empty()) encode_word(w, out);
  }

  void encode_word(const std::string& w, std::vector<int32_t>& out) const {
    {
      std::lock_guard<std::mutex> lk(cache_mu_);
      auto it = cache_.find(w);
      if (it != cache_.end()) {
        out.insert(out.end(), it->second.begin(), it->second.end());
        return;
      }
    }
    std::vector<int32_t> ids = bpe(w);
    out.insert(out.end(), ids.begin(), ids.end());
    std::lock_guard<std::mutex> lk(cache_mu_);
    if (cache_.size() >= 200000) cache_.clear();
    cache_.emplace(w, std::move(ids));
  }

  std::vector<int32_t> bpe(const std::string& w) const {
    std::vector<int32_t> sym;
    sym.reserve(w.size());
    if (byte_level_) {
      if (ignore_merges_) {
        std::string mapped;
        for (unsigned char c : w) mapped += byte_table().to_str[c];
        auto it = vocab_.find(mapped);
        if (it != vocab_.end()) return {it->second};
      }
      for (unsigned char c : w) {
        int32_t id = byte_id_[c];
        if (id >= 0)
          sym.push_back(id);
        else if (unk_ && (sym.empty() || sym.back() != *unk_))
          sym.push_back(*unk_);
      }
    } else {
      if (ignore_merges_) {
        auto it = vocab_.find(w);
        if (it != vocab_.end()) return {it->second};
      }
      size_t i = 0;
      while (i < w.size()) {
        utf8proc_int32_t c;
        auto len = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(w.data() + i), w.size() - i, &c);
        size_t l = len > 0 ? static_cast<size_t>(len) : 1;
        auto it = vocab_.find(w.substr(i, l));
        if (it != vocab_.end())
          sym.push_back(it->second);
        else if (unk_)
          sym.push_back(*unk_);
        i += l;
      }
    }
    if (sym.size() < 2) return sym;
    if (sym.size() <= 64) {
      // Short words: repeatedly apply the lowest-ranked (then leftmost) merge.
      for (;;) {
        int32_t best_rank = INT32_MAX, best_id = -1;
        size_t best = 0;
        for (size_t i = 0; i + 1 < sym.size(); ++i) {
          auto it = merges_.find(pair_key(sym[i], sym[i + 1]));
          if (it != merges_.end() && it->second.rank < best_rank) {
            best_rank = it->second.rank, best_id = it->second.id, best = i;
          }
        }
        if (best_id < 0) break;
        sym[best] = best_id;
        sym.erase(sym.begin() + static_cast<std::ptrdiff_t>(best) + 1);
      }
      return sym;
    }
    // Long words: linked list + priority queue (rank, position), as tokenizers' BPE::merge_word.
    size_t n = sym.size();
    std::vector<int32_t> prev(n), next(n);
    std::vector<char> alive(n, 1);
    for (size_t i = 0; i < n; ++i) prev[i] = static_cast<int32_t>(i) - 1, next[i] = i + 1 < n ? static_cast<int32_t>(i + 1) : -1;
    struct Cand {
      int32_t rank, pos, left_id, right_id;
      bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
    };
    std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> pq;
    auto push = [&](int32_t i) {
      if (i < 0 || next[i] < 0) return;
      auto it = merges_.find(pair_key(sym[i], sym[next[i]]));
      if (it != merges_.end()) pq.push({it->second.rank, i, sym[i], sym[next[i]]});
    };
    for (size_t i = 0; i + 1 < n; ++i) push(static_cast<int32_t>(i));
    while (!pq.empty()) {
      Cand c = pq.top();
      pq.pop();
      int32_t i = c.pos;
      if (!alive[i] || next[i] < 0 || sym[i] != c.left_id || sym[next[i]] != c.right_id) continue;
      int32_t j = next[i];
      sym[i] = merges_.at(pair_key(c.left_id, c.right_id)).id;
      alive[j] = 0;
      next[i] = next[j];
      if (next[j] >= 0) prev[next[j]] = i;
      push(prev[i]);
      push(i);
    }
    std::vector<int32_t> res;
    for (int32_t i = 0; i >= 0; i = next[i]) res.push_back(sym[i]);
    return res;
  }
};

}  // namespace

namespace detail {
std::unique_ptr<Tokenizer> load_hf_json(std::string_view bytes, const TokenizerOptions& opts) {
  return std::make_unique<HfBpeTokenizer>(bytes, opts);
}
}  // namespace detail

}  // namespace colibri
