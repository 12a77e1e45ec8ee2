// chat_template.cpp: the lexer and parser of chat templates (the Jinja2 subset of
// docs/chat_templates.md), with the whitespace rules transformers' environment
// uses (trim_blocks, lstrip_blocks), written after jinja2 3.1's lexer.py and
// parser.py so that the same source yields the same text and structure.
#include "model/chat_template.h"

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <set>
#include <utility>

#include "model/chat_template_impl.h"
#include "model/error.h"

namespace colibri::jinja {
namespace {

// NOTE: templates nest a few levels; a bound keeps a hostile one from
// overflowing the stack (of the parser and, later, of the renderer).
constexpr int kCtMaxNesting = 128;
constexpr size_t kCtMaxSourceBytes = size_t{4} << 20;

enum class Tk : uint8_t { Data, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, String, Integer, Float, Op, Eof };

struct CtToken {
  Tk kind = Tk::Eof;
  std::string text;  // Data, Name, String (decoded), Op
  int64_t ival = 0;
  double fval = 0;
  size_t offset = 0;  // in the normalised source
};

// The source as jinja's lexer sees it: newlines normalised to \n and one
// trailing newline dropped (keep_trailing_newline=False).
class CtSource {
 public:
  explicit CtSource(const std::string& raw) {
    text_.reserve(raw.size());
    for (size_t i = 0; i < raw.size(); ++i) {
      if (raw[i] == '\r') {
        text_ += '\n';
        if (i + 1 < raw.size() && raw[i + 1] == '\n') ++i;
      } else {
        text_ += raw[i];
      }
    }
    if (!text_.empty() && text_.back() == '\n') text_.pop_back();
    line_starts_.push_back(0);
    for (size_t i = 0; i < text_.size(); ++i)
      if (text_[i] == '\n') line_starts_.push_back(i + 1);
  }
  const std::string& text() const { return text_; }
  SrcPos pos(size_t offset) const {
    offset = std::min(offset, text_.size());
    auto it = std::upper_bound(line_starts_.begin(), line_starts_.end(), offset);
    const size_t line = static_cast<size_t>(it - line_starts_.begin());
    int col = 1;
    for (size_t i = line_starts_[line - 1]; i < offset; ++i)
      if ((static_cast<unsigned char>(text_[i]) & 0xC0) != 0x80) ++col;
    return {static_cast<int>(line), col};
  }

 private:
  std::string text_;
  std::vector<size_t> line_starts_;
};

[[noreturn]] void ct_fail(Status status, SrcPos p, const std::string& msg) {
  throw Error(status, "chat template line " + std::to_string(p.line) + ":" + std::to_string(p.col) + ": " + msg);
}

bool ct_digit(char c) { return c >= '0' && c <= '9'; }
bool ct_name_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool ct_name_char(char c) { return ct_name_start(c) || ct_digit(c); }

// Python's str.rstrip() on UTF-8.
std::string ct_rstrip(const std::string& s) {
  size_t end = 0;
  for (size_t i = 0; i < s.size();) {
    uint32_t cp = 0;
    const size_t n = utf8_decode(s, i, &cp);
    i += n;
    if (!py_isspace(cp)) end = i;
  }
  return s.substr(0, end);
}

bool ct_all_space(const std::string& s, size_t from) {
  if (from >= s.size()) return false;  // \s+ needs one character
  for (size_t i = from; i < s.size();) {
    const size_t n = py_space_len(s, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

class CtLexer {
 public:
  explicit CtLexer(const CtSource& src) : src_(src), s_(src.text()) {}

  std::vector<CtToken> run() {
    size_t pos = 0;
    bool line_starting = true;
    const size_t n = s_.size();
    while (pos < n) {
      size_t t = pos;
      for (;;) {
        t = s_.find('{', t);
        if (t == std::string::npos || t + 1 >= n) {
          t = std::string::npos;
          break;
        }
        const char c = s_[t + 1];
        if (c == '{' || c == '%' || c == '#') break;
        ++t;
      }
      if (t == std::string::npos) {
        data(s_.substr(pos), pos);
        break;
      }
      std::string text = s_.substr(pos, t - pos);
      const char kind = s_[t + 1];
      size_t p = t + 2;
      char sign = 0;
      if (p < n && (s_[p] == '-' || s_[p] == '+')) sign = s_[p++];
      // {% raw %}: `{%(-|+|)\s*raw\s*(-%}\s*|%})`, no trim_blocks newline.
      size_t raw_end = 0;
      if (kind == '%') {
        const size_t q = skip_space(p);
        if (s_.compare(q, 3, "raw") == 0) {
          const size_t r = skip_space(q + 3);
          if (s_.compare(r, 3, "-%}") == 0) raw_end = skip_space(r + 3);
          else if (s_.compare(r, 2, "%}") == 0) raw_end = r + 2;
        }
      }
      data(lstrip(std::move(text), sign, kind == '{', line_starting), pos);
      if (raw_end) {
        line_starting = s_[raw_end - 1] == '\n';
        pos = raw(t, raw_end, line_starting);
      } else if (kind == '#') {
        pos = comment(t, p);
      } else {
        pos = tag(kind, t, p);
      }
      line_starting = pos > 0 && s_[pos - 1] == '\n';
    }
    CtToken eof;
    eof.kind = Tk::Eof;
    eof.offset = n;
    toks_.push_back(std::move(eof));
    return std::move(toks_);
  }

 private:
  size_t skip_space(size_t p) const {
    while (size_t k = py_space_len(s_, p)) p += k;
    return p;
  }

  // The whitespace control in front of a tag (jinja's OptionalLStrip).
  std::string lstrip(std::string text, char sign, bool variable, bool line_starting) const {
    if (sign == '-') return ct_rstrip(text);
    if (sign != '+' && !variable) {  // lstrip_blocks
      const size_t nl = text.rfind('\n');
      const size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
      if ((l_pos > 0 || line_starting) && ct_all_space(text, l_pos)) text.resize(l_pos);
    }
    return text;
  }

  void data(std::string text, size_t offset) {
    if (text.empty()) return;
    CtToken tok;
    tok.kind = Tk::Data;
    tok.text = std::move(text);
    tok.offset = offset;
    toks_.push_back(std::move(tok));
  }

  void push(Tk kind, size_t offset, std::string text = {}) {
    CtToken tok;
    tok.kind = kind;
    tok.text = std::move(text);
    tok.offset = offset;
    toks_.push_back(std::move(tok));
  }

  size_t raw(size_t tag_start, size_t from, bool line_starting) {
    const size_t n = s_.size();
    for (size_t q = s_.find("{%", from); q != std::string::npos; q = s_.find("{%", q + 1)) {
      size_t p = q + 2;
      char sign = 0;
      if (p < n && (s_[p] == '-' || s_[p] == '+')) sign = s_[p++];
      p = skip_space(p);
      if (s_.compare(p, 6, "endraw") != 0) continue;
      p = skip_space(p + 6);
      size_t end = 0;
      if (s_.compare(p, 3, "+%}") == 0) {
        end = p + 3;
      } else if (s_.compare(p, 3, "-%}") == 0) {
        end = skip_space(p + 3);
      } else if (s_.compare(p, 2, "%}") == 0) {
        end = p + 2;
        if (end < n && s_[end] == '\n') ++end;
      } else {
        continue;
      }
      data(lstrip(s_.substr(from, q - from), sign, false, line_starting), from);
      return end;
    }
    ct_fail(Status::Format, src_.pos(tag_start), "missing end of raw directive ({% endraw %})");
  }

  size_t comment(size_t tag_start, size_t p) {
    const size_t n = s_.size();
    for (; p < n; ++p) {
      if (s_.compare(p, 3, "+#}") == 0) return p + 3;
      if (s_.compare(p, 3, "-#}") == 0) return skip_space(p + 3);
      if (s_.compare(p, 2, "#}") == 0) return p + 2 < n && s_[p + 2] == '\n' ? p + 3 : p + 2;
    }
    ct_fail(Status::Format, src_.pos(tag_start), "missing end of comment tag ('#}')");
  }

  // One {{ ... }} or {% ... %}: its tokens; returns the position after it (the
  // end of the source when it is not closed: the parser reports that).
  size_t tag(char kind, size_t tag_start, size_t p) {
    push(kind == '{' ? Tk::VarBegin : Tk::BlockBegin, tag_start);
    const size_t n = s_.size();
    std::vector<char> balance;
    while (p < n) {
      if (balance.empty()) {
        size_t end = 0;
        if (kind == '%') {
          if (s_.compare(p, 3, "+%}") == 0) {
            end = p + 3;
          } else if (s_.compare(p, 3, "-%}") == 0) {
            end = skip_space(p + 3);
          } else if (s_.compare(p, 2, "%}") == 0) {
            end = p + 2;
            if (end < n && s_[end] == '\n') ++end;  // trim_blocks
          }
        } else {
          if (s_.compare(p, 3, "-}}") == 0) end = skip_space(p + 3);
          else if (s_.compare(p, 2, "}}") == 0) end = p + 2;
        }
        if (end) {
          push(kind == '{' ? Tk::VarEnd : Tk::BlockEnd, p);
          return end;
        }
      }
      if (const size_t k = py_space_len(s_, p)) {
        p += k;
        continue;
      }
      p = token(p, balance);
    }
    return n;
  }

  // (\d+_)*\d+ at p: its end, or npos.
  size_t digits(size_t p) const {
    if (p >= s_.size() || !ct_digit(s_[p])) return std::string::npos;
    for (;;) {
      while (p < s_.size() && ct_digit(s_[p])) ++p;
      if (p + 1 < s_.size() && s_[p] == '_' && ct_digit(s_[p + 1])) {
        ++p;
        continue;
      }
      return p;
    }
  }

  size_t exponent(size_t p) const {
    if (p >= s_.size() || (s_[p] != 'e' && s_[p] != 'E')) return std::string::npos;
    ++p;
    if (p < s_.size() && (s_[p] == '+' || s_[p] == '-')) ++p;
    return digits(p);
  }

  size_t float_end(size_t p) const {
    if (p > 0 && s_[p - 1] == '.') return std::string::npos;
    const size_t d = digits(p);
    if (d == std::string::npos) return d;
    if (s_[d] == '.' || s_[d] == 'e' || s_[d] == 'E') {
      if (s_[d] == '.') {
        const size_t f = digits(d + 1);
        if (f != std::string::npos) {
          const size_t e = exponent(f);
          return e != std::string::npos ? e : f;
        }
      }
      return exponent(d);
    }
    return std::string::npos;
  }

  // 0b.. 0o.. 0x.. [1-9](_?\d)* 0(_?0)*: its end and base, or npos.
  size_t integer_end(size_t p, int* base) const {
    const size_t n = s_.size();
    auto run = [&](size_t q, auto ok) {
      size_t end = std::string::npos;
      while (q < n) {
        if (ok(s_[q])) {
          end = ++q;
        } else if (s_[q] == '_' && q + 1 < n && ok(s_[q + 1])) {
          q += 2;
          end = q;
        } else {
          break;
        }
      }
      return end;
    };
    if (s_[p] == '0' && p + 1 < n) {
      const char c = static_cast<char>(s_[p + 1] | 0x20);
      size_t e = std::string::npos;
      if (c == 'b') e = run(p + 2, [](char x) { return x == '0' || x == '1'; }), *base = 2;
      else if (c == 'o') e = run(p + 2, [](char x) { return x >= '0' && x <= '7'; }), *base = 8;
      else if (c == 'x') e = run(p + 2, [](char x) { return ct_digit(x) || ((x | 0x20) >= 'a' && (x | 0x20) <= 'f'); }), *base = 16;
      if (e != std::string::npos) return e;
    }
    *base = 10;
    if (s_[p] >= '1' && s_[p] <= '9') return run(p, ct_digit);
    if (s_[p] == '0') {
      const size_t e = run(p + 1, [](char x) { return x == '0'; });
      return e == std::string::npos ? p + 1 : e;
    }
    return std::string::npos;
  }

  size_t token(size_t p, std::vector<char>& balance) {
    const size_t n = s_.size();
    if (const size_t e = float_end(p); e != std::string::npos) {
      std::string lit;
      for (size_t i = p; i < e; ++i)
        if (s_[i] != '_') lit += s_[i];
      CtToken tok;
      tok.kind = Tk::Float;
      std::from_chars(lit.data(), lit.data() + lit.size(), tok.fval);
      tok.offset = p;
      toks_.push_back(std::move(tok));
      return e;
    }
    int base = 10;
    if (const size_t e = integer_end(p, &base); e != std::string::npos) {
      const size_t digits_from = base == 10 ? p : p + 2;
      uint64_t v = 0;
      for (size_t i = digits_from; i < e; ++i) {
        if (s_[i] == '_') continue;
        const char c = static_cast<char>(s_[i] | 0x20);
        const uint64_t d = ct_digit(s_[i]) ? static_cast<uint64_t>(s_[i] - '0') : static_cast<uint64_t>(c - 'a' + 10);
        if (v > (static_cast<uint64_t>(INT64_MAX) - d) / static_cast<uint64_t>(base))
          ct_fail(Status::Unsupported, src_.pos(p), "integer literal " + s_.substr(p, e - p) + " is larger than 64 bits");
        v = v * static_cast<uint64_t>(base) + d;
      }
      CtToken tok;
      tok.kind = Tk::Integer;
      tok.ival = static_cast<int64_t>(v);
      tok.offset = p;
      toks_.push_back(std::move(tok));
      return e;
    }
    const char c = s_[p];
    if (ct_name_start(c)) {
      size_t e = p;
      while (e < n && ct_name_char(s_[e])) ++e;
      if (e < n && static_cast<unsigned char>(s_[e]) >= 0x80 && py_space_len(s_, e) == 0)
        ct_fail(Status::Unsupported, src_.pos(p), "names with non-ASCII characters are not supported");
      push(Tk::Name, p, s_.substr(p, e - p));
      return e;
    }
    if (static_cast<unsigned char>(c) >= 0x80)
      ct_fail(Status::Unsupported, src_.pos(p), "names with non-ASCII characters are not supported");
    if (c == '\'' || c == '"') return string(p);
    static const char* const kTwo[] = {"//", "**", "==", "!=", ">=", "<="};
    for (const char* op : kTwo)
      if (s_.compare(p, 2, op) == 0) {
        push(Tk::Op, p, op);
        return p + 2;
      }
    if (std::strchr("+-/*%~[](){}><=.:|,;", c) == nullptr || c == '\0')
      ct_fail(Status::Format, src_.pos(p), std::string("unexpected character '") + c + "'");
    if (c == '{' || c == '(' || c == '[') {
      if (balance.size() >= static_cast<size_t>(kCtMaxNesting))
        ct_fail(Status::Format, src_.pos(p), "brackets nested too deeply");
      balance.push_back(c == '{' ? '}' : c == '(' ? ')' : ']');
    } else if (c == '}' || c == ')' || c == ']') {
      if (balance.empty()) ct_fail(Status::Format, src_.pos(p), std::string("unexpected '") + c + "'");
      if (balance.back() != c)
        ct_fail(Status::Format, src_.pos(p), std::string("unexpected '") + c + "', expected '" + balance.back() + "'");
      balance.pop_back();
    }
    push(Tk::Op, p, std::string(1, c));
    return p + 1;
  }

  static int hex_value(char c) {
    if (ct_digit(c)) return c - '0';
    c = static_cast<char>(c | 0x20);
    return c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
  }

  // A string literal, decoded as Python's "unicode-escape" codec does.
  size_t string(size_t p) {
    const size_t n = s_.size();
    const char quote = s_[p];
    size_t e = p + 1;
    while (e < n && s_[e] != quote) e += s_[e] == '\\' ? 2 : 1;
    if (e >= n) ct_fail(Status::Format, src_.pos(p), "unterminated string literal");
    std::string out;
    for (size_t i = p + 1; i < e;) {
      if (s_[i] != '\\') {
        out += s_[i++];
        continue;
      }
      const char c = s_[i + 1];
      i += 2;
      switch (c) {
        case '\n': break;  // line continuation
        case '\\': out += '\\'; break;
        case '\'': out += '\''; break;
        case '"': out += '"'; break;
        case 'a': out += '\a'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'v': out += '\v'; break;
        case 'x':
        case 'u':
        case 'U': {
          const int len = c == 'x' ? 2 : c == 'u' ? 4 : 8;
          uint32_t cp = 0;
          for (int k = 0; k < len; ++k) {
            const int h = i + static_cast<size_t>(k) < e ? hex_value(s_[i + static_cast<size_t>(k)]) : -1;
            if (h < 0) ct_fail(Status::Format, src_.pos(p), std::string("truncated \\") + c + " escape in a string literal");
            cp = cp * 16 + static_cast<uint32_t>(h);
          }
          i += static_cast<size_t>(len);
          if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
            ct_fail(Status::Format, src_.pos(p), "invalid code point in a \\" + std::string(1, c) + " escape");
          utf8_append(out, cp);
          break;
        }
        case 'N':
          ct_fail(Status::Unsupported, src_.pos(p), "\\N{...} escapes are not supported");
        default:
          if (c >= '0' && c <= '7') {
            uint32_t cp = static_cast<uint32_t>(c - '0');
            for (int k = 0; k < 2 && i < e && s_[i] >= '0' && s_[i] <= '7'; ++k) cp = cp * 8 + static_cast<uint32_t>(s_[i++] - '0');
            utf8_append(out, cp);
          } else {
            out += '\\';  // an unknown escape keeps its backslash
            out += c;
          }
      }
    }
    CtToken tok;
    tok.kind = Tk::String;
    tok.text = std::move(out);
    tok.offset = p;
    toks_.push_back(std::move(tok));
    return e + 1;
  }

  const CtSource& src_;
  const std::string& s_;
  std::vector<CtToken> toks_;
};

// Jinja's built-in filters and tests: one of them that the renderer does not
// implement is Unsupported; any other name is not Jinja (Format).
const std::set<std::string>& jinja_filters() {
  static const std::set<std::string> k = {
      "abs",     "attr",   "batch",   "capitalize", "center", "count",     "d",          "default", "dictsort",
      "e",       "escape", "filesizeformat", "first", "float", "forceescape", "format", "groupby", "indent",
      "int",     "items",  "join",    "last",       "length", "list",      "lower",      "map",     "max",
      "min",     "pprint", "random",  "reject",     "rejectattr", "replace", "reverse",  "round",   "safe",
      "select",  "selectattr", "slice", "sort",     "string", "striptags", "sum",        "title",   "tojson",
      "trim",    "truncate", "unique", "upper",     "urlencode", "urlize", "wordcount",  "wordwrap", "xmlattr"};
  return k;
}

const std::set<std::string>& jinja_tests() {
  static const std::set<std::string> k = {
      "boolean", "callable", "defined", "divisibleby", "eq",   "equalto",  "escaped",  "even",   "false",
      "filter",  "float",    "ge",      "greaterthan", "gt",   "in",       "integer",  "iterable", "le",
      "lessthan", "lower",   "lt",      "mapping",     "ne",   "none",     "number",   "odd",    "sameas",
      "sequence", "string",  "test",    "true",        "undefined", "upper", "==", "!=", ">", ">=", "<", "<="};
  return k;
}

const std::set<std::string>& ct_builtin_functions() {
  static const std::set<std::string> k = {"raise_exception", "namespace", "strftime_now", "range", "dict"};
  return k;
}

class CtParser {
 public:
  CtParser(const CtSource& src, std::vector<CtToken> toks) : src_(src), toks_(std::move(toks)) {}

  std::unique_ptr<Program> parse() {
    auto prog = std::make_unique<Program>();
    prog->body = subparse({});
    for (const auto& [name, pos] : called_)
      if (!macros_.count(name))
        ct_fail(Status::Unsupported, pos,
                "call of '" + name + "', which is neither a macro of this template nor a supported function "
                "(raise_exception, namespace, strftime_now, range, dict)");
    return prog;
  }

 private:
  const CtToken& cur() const { return toks_[i_]; }
  const CtToken& look() const { return toks_[std::min(i_ + 1, toks_.size() - 1)]; }
  const CtToken& next() {
    const CtToken& t = toks_[i_];
    if (i_ + 1 < toks_.size()) ++i_;
    return t;
  }
  SrcPos at(const CtToken& t) const { return src_.pos(t.offset); }
  SrcPos here() const { return at(cur()); }

  static std::string describe(const CtToken& t) {
    switch (t.kind) {
      case Tk::Data: return "template data";
      case Tk::VarBegin: return "'{{'";
      case Tk::VarEnd: return "'}}'";
      case Tk::BlockBegin: return "'{%'";
      case Tk::BlockEnd: return "'%}'";
      case Tk::Name: return "'" + t.text + "'";
      case Tk::String: return "string literal";
      case Tk::Integer:
      case Tk::Float: return "number";
      case Tk::Op: return "'" + t.text + "'";
      case Tk::Eof: return "end of template";
    }
    return "token";
  }

  [[noreturn]] void fail(const std::string& msg) const { ct_fail(Status::Format, here(), msg); }
  [[noreturn]] void fail_at(const CtToken& t, const std::string& msg) const { ct_fail(Status::Format, at(t), msg); }
  [[noreturn]] void unsupported(SrcPos p, const std::string& msg) const { ct_fail(Status::Unsupported, p, msg); }

  bool is_op(const char* op) const { return cur().kind == Tk::Op && cur().text == op; }
  bool is_name(const char* name) const { return cur().kind == Tk::Name && cur().text == name; }
  bool skip_op(const char* op) {
    if (!is_op(op)) return false;
    next();
    return true;
  }
  bool skip_name(const char* name) {
    if (!is_name(name)) return false;
    next();
    return true;
  }
  void expect_op(const char* op) {
    if (!is_op(op)) fail(std::string("expected '") + op + "', got " + describe(cur()));
    next();
  }
  const CtToken& expect_name() {
    if (cur().kind != Tk::Name) fail("expected a name, got " + describe(cur()));
    return next();
  }
  void expect_name(const char* name) {
    if (!is_name(name)) fail(std::string("expected '") + name + "', got " + describe(cur()));
    next();
  }
  void expect_block_end() {
    if (cur().kind != Tk::BlockEnd) fail("expected '%}', got " + describe(cur()));
    next();
  }

  struct Depth {
    explicit Depth(CtParser& p) : p_(p) {
      if (++p_.depth_ > kCtMaxNesting) p_.fail("the template nests too deeply");
    }
    ~Depth() { --p_.depth_; }
    CtParser& p_;
  };

  std::unique_ptr<Expr> make(ExprKind kind, SrcPos pos) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->pos = pos;
    return e;
  }
  // NOTE: a long chain (a + a + ..., x.a.a..., elif after elif) nests the tree
  // without nesting the parser; the renderer and the destructors recurse on it.
  std::unique_ptr<Expr> done(std::unique_ptr<Expr> e) {
    int h = 0;
    for (const auto& a : e->args)
      if (a) h = std::max(h, a->height);
    for (const auto& kv : e->kwargs) h = std::max(h, kv.second->height);
    e->height = h + 1;
    if (e->height > kCtMaxNesting) ct_fail(Status::Format, e->pos, "the expression nests too deeply");
    return e;
  }

  std::unique_ptr<Node> make_node(NodeKind kind, SrcPos pos) {
    auto n = std::make_unique<Node>();
    n->kind = kind;
    n->pos = pos;
    return n;
  }

  // ---- statements ----

  bool at_end_tag(std::initializer_list<const char*> ends) const {
    if (cur().kind != Tk::Name) return false;
    for (const char* e : ends)
      if (cur().text == e) return true;
    return false;
  }

  static std::string list_tags(std::initializer_list<const char*> ends) {
    std::string s;
    for (const char* e : ends) s += (s.empty() ? "'" : " or '") + std::string(e) + "'";
    return s;
  }

  // Until a `{%` whose tag is one of `ends` (the stream is left on that name);
  // everything when `ends` is empty.
  std::vector<std::unique_ptr<Node>> subparse(std::initializer_list<const char*> ends) {
    std::vector<std::unique_ptr<Node>> body;
    for (;;) {
      const CtToken& t = cur();
      if (t.kind == Tk::Eof) {
        if (ends.size() == 0) return body;
        fail("unexpected end of template; expected " + list_tags(ends));
      }
      if (t.kind == Tk::Data) {
        auto n = make_node(NodeKind::Text, at(t));
        n->text = t.text;
        body.push_back(std::move(n));
        next();
      } else if (t.kind == Tk::VarBegin) {
        next();
        auto n = make_node(NodeKind::Print, here());
        n->expr = parse_tuple(true);
        if (cur().kind != Tk::VarEnd) fail("expected '}}', got " + describe(cur()));
        next();
        body.push_back(std::move(n));
      } else if (t.kind == Tk::BlockBegin) {
        next();
        if (ends.size() != 0 && at_end_tag(ends)) return body;
        parse_statement(body);
        expect_block_end();
      } else {
        fail("unexpected " + describe(t));
      }
    }
  }

  // The body of a block statement: after its `%}`, up to one of `ends`; drops
  // the end tag's name when `drop` (the stream is then on its `%}`).
  std::vector<std::unique_ptr<Node>> statements(std::initializer_list<const char*> ends, bool drop) {
    Depth d(*this);
    skip_op(":");
    expect_block_end();
    auto body = subparse(ends);
    if (drop) next();
    return body;
  }

  void parse_statement(std::vector<std::unique_ptr<Node>>& out) {
    const CtToken& t = cur();
    if (t.kind != Tk::Name) fail("expected a tag name, got " + describe(t));
    const std::string tag = t.text;
    const SrcPos pos = at(t);
    if (tag == "if") return out.push_back(parse_if());
    if (tag == "for") return out.push_back(parse_for());
    if (tag == "set") return out.push_back(parse_set());
    if (tag == "macro") return out.push_back(parse_macro());
    if (tag == "filter") return out.push_back(parse_filter_block());
    if (tag == "print") {
      next();
      bool first = true;
      while (cur().kind != Tk::BlockEnd) {
        if (!first) expect_op(",");
        first = false;
        auto n = make_node(NodeKind::Print, here());
        n->expr = parse_expression(true);
        out.push_back(std::move(n));
      }
      return;
    }
    if (tag == "break" || tag == "continue") {
      if (loop_depth_ == 0) fail("'" + tag + "' outside a for loop");
      next();
      out.push_back(make_node(tag == "break" ? NodeKind::Break : NodeKind::Continue, pos));
      return;
    }
    if (tag == "generation") {  // transformers' AssistantTracker: renders its body
      next();
      auto n = make_node(NodeKind::Scope, pos);
      n->body = statements({"endgeneration"}, true);
      out.push_back(std::move(n));
      return;
    }
    static const std::set<std::string> kUnsupported = {"with",   "call", "block",  "extends",    "include",
                                                       "import", "from", "autoescape", "do",     "trans",
                                                       "pluralize"};
    if (kUnsupported.count(tag)) unsupported(pos, "the '{% " + tag + " %}' tag is not supported");
    fail("unknown tag '" + tag + "'");
  }

  std::unique_ptr<Node> parse_if() {
    auto root = make_node(NodeKind::If, here());
    next();
    Node* node = root.get();
    int elifs = 0;
    for (;;) {
      node->expr = parse_tuple(false);
      node->body = statements({"elif", "else", "endif"}, false);
      const CtToken& t = next();
      if (t.text == "elif") {
        if (++elifs > kCtMaxNesting) fail_at(t, "more than 128 elif branches");
        auto elif = make_node(NodeKind::If, at(t));
        Node* raw = elif.get();
        node->else_body.push_back(std::move(elif));
        node = raw;
        continue;
      }
      if (t.text == "else") node->else_body = statements({"endif"}, true);
      break;
    }
    return root;
  }

  // Names separated by commas up to `end_name` (or the block end).
  void parse_targets(Node& n, const char* end_name) {
    bool first = true;
    for (;;) {
      if (!first) {
        if (!skip_op(",")) break;
        n.unpack = true;
      }
      if (cur().kind == Tk::BlockEnd || (end_name && is_name(end_name))) break;
      first = false;
      if (is_op("(")) unsupported(here(), "nested tuple targets are not supported");
      const CtToken& t = expect_name();
      if (t.text == "true" || t.text == "false" || t.text == "none" || t.text == "True" || t.text == "False" ||
          t.text == "None")
        fail_at(t, "cannot assign to '" + t.text + "'");
      n.targets.push_back(t.text);
    }
    if (n.targets.empty()) fail("expected a name to assign to, got " + describe(cur()));
  }

  std::unique_ptr<Node> parse_for() {
    auto n = make_node(NodeKind::For, here());
    next();
    parse_targets(*n, "in");
    expect_name("in");
    n->expr = parse_tuple(false, "recursive");
    if (skip_name("if")) n->cond = parse_expression(true);
    if (is_name("recursive")) unsupported(here(), "recursive for loops are not supported");
    ++loop_depth_;
    n->body = statements({"endfor", "else"}, false);
    --loop_depth_;
    if (next().text == "else") {
      const int saved = loop_depth_;
      loop_depth_ = 0;  // NOTE: jinja compiles the else block outside the loop
      n->else_body = statements({"endfor"}, true);
      loop_depth_ = saved;
    }
    return n;
  }

  std::unique_ptr<Node> parse_set() {
    const SrcPos pos = here();
    next();
    auto n = make_node(NodeKind::Set, pos);
    if (cur().kind == Tk::Name && look().kind == Tk::Op && look().text == ".") {
      n->targets.push_back(next().text);  // ns.attr
      next();
      n->attr = expect_name().text;
      if (is_op(",")) unsupported(here(), "assigning a tuple with a namespace attribute is not supported");
    } else {
      parse_targets(*n, nullptr);
    }
    if (skip_op("=")) {
      n->expr = parse_tuple(true);
      return n;
    }
    if (n->unpack) fail("expected '=' after a tuple target");
    n->kind = NodeKind::SetBlock;
    parse_filters(n->filters, false);
    n->body = statements({"endset"}, true);
    return n;
  }

  std::unique_ptr<Node> parse_macro() {
    auto n = make_node(NodeKind::Macro, here());
    next();
    n->text = expect_name().text;
    if (ct_builtin_functions().count(n->text)) fail("a macro cannot be named '" + n->text + "'");
    expect_op("(");
    while (!is_op(")")) {
      if (!n->targets.empty()) expect_op(",");
      const CtToken& t = expect_name();
      n->targets.push_back(t.text);
      if (skip_op("=")) {
        n->defaults.push_back(parse_expression(true));
      } else if (!n->defaults.empty()) {
        fail_at(t, "a parameter without a default follows one with a default");
      }
    }
    expect_op(")");
    macros_.insert(n->text);
    const int saved_loop = loop_depth_;
    loop_depth_ = 0;
    ++macro_depth_;
    n->body = statements({"endmacro"}, true);
    --macro_depth_;
    loop_depth_ = saved_loop;
    return n;
  }

  std::unique_ptr<Node> parse_filter_block() {
    auto n = make_node(NodeKind::FilterBlock, here());
    next();
    parse_filters(n->filters, true);
    n->body = statements({"endfilter"}, true);
    return n;
  }

  // `| name(args)` chains (the first without `|` when `inline_first`).
  void parse_filters(std::vector<std::unique_ptr<Expr>>& out, bool inline_first) {
    while (is_op("|") || inline_first) {
      if (!inline_first) next();
      inline_first = false;
      out.push_back(parse_one_filter(nullptr));
    }
  }

  // ---- expressions (jinja's parser.py, one function per precedence level) ----

  std::unique_ptr<Expr> parse_tuple(bool with_condexpr, const char* extra_end = nullptr, bool explicit_parens = false) {
    const SrcPos pos = here();
    std::vector<std::unique_ptr<Expr>> items;
    bool is_tuple = false;
    for (;;) {
      if (!items.empty()) expect_op(",");
      const Tk k = cur().kind;
      if (k == Tk::VarEnd || k == Tk::BlockEnd || is_op(")") || (extra_end && is_name(extra_end))) break;
      items.push_back(parse_expression(with_condexpr));
      if (is_op(",")) is_tuple = true;
      else break;
    }
    if (!is_tuple) {
      if (!items.empty()) return std::move(items[0]);
      if (!explicit_parens) fail("expected an expression, got " + describe(cur()));
    }
    auto e = make(ExprKind::Tuple, pos);
    e->args = std::move(items);
    return done(std::move(e));
  }

  std::unique_ptr<Expr> parse_expression(bool with_condexpr) {
    Depth d(*this);
    return with_condexpr ? parse_condexpr() : parse_or();
  }

  std::unique_ptr<Expr> parse_condexpr() {
    const SrcPos pos = here();
    auto e1 = parse_or();
    while (skip_name("if")) {
      auto cond = parse_or();
      std::unique_ptr<Expr> e3;
      if (skip_name("else")) {
        Depth d(*this);
        e3 = parse_condexpr();
      }
      auto c = make(ExprKind::CondExpr, pos);
      c->args.push_back(std::move(e1));
      c->args.push_back(std::move(cond));
      c->args.push_back(std::move(e3));
      e1 = done(std::move(c));
    }
    return e1;
  }

  std::unique_ptr<Expr> binary(const std::string& op, std::unique_ptr<Expr> l, std::unique_ptr<Expr> r, SrcPos pos) {
    auto e = make(ExprKind::Binary, pos);
    e->str = op;
    e->args.push_back(std::move(l));
    e->args.push_back(std::move(r));
    return done(std::move(e));
  }

  std::unique_ptr<Expr> parse_or() {
    const SrcPos pos = here();
    auto l = parse_and();
    while (skip_name("or")) l = binary("or", std::move(l), parse_and(), pos);
    return l;
  }

  std::unique_ptr<Expr> parse_and() {
    const SrcPos pos = here();
    auto l = parse_not();
    while (skip_name("and")) l = binary("and", std::move(l), parse_not(), pos);
    return l;
  }

  std::unique_ptr<Expr> parse_not() {
    if (is_name("not")) {
      Depth d(*this);
      auto e = make(ExprKind::Not, here());
      next();
      e->args.push_back(parse_not());
      return done(std::move(e));
    }
    return parse_compare();
  }

  std::unique_ptr<Expr> parse_compare() {
    const SrcPos pos = here();
    auto first = parse_math1();
    std::unique_ptr<Expr> cmp;
    for (;;) {
      std::string op;
      if (cur().kind == Tk::Op && (cur().text == "==" || cur().text == "!=" || cur().text == "<" ||
                                   cur().text == "<=" || cur().text == ">" || cur().text == ">=")) {
        op = next().text;
      } else if (skip_name("in")) {
        op = "in";
      } else if (is_name("not") && look().kind == Tk::Name && look().text == "in") {
        next();
        next();
        op = "notin";
      } else {
        break;
      }
      if (!cmp) {
        cmp = make(ExprKind::Compare, pos);
        cmp->args.push_back(std::move(first));
      }
      cmp->ops.push_back(op);
      cmp->args.push_back(parse_math1());
    }
    return cmp ? done(std::move(cmp)) : std::move(first);
  }

  std::unique_ptr<Expr> parse_math1() {
    const SrcPos pos = here();
    auto l = parse_concat();
    while (is_op("+") || is_op("-")) {
      const std::string op = next().text;
      l = binary(op, std::move(l), parse_concat(), pos);
    }
    return l;
  }

  std::unique_ptr<Expr> parse_concat() {
    const SrcPos pos = here();
    auto l = parse_math2();
    while (skip_op("~")) l = binary("~", std::move(l), parse_math2(), pos);
    return l;
  }

  std::unique_ptr<Expr> parse_math2() {
    const SrcPos pos = here();
    auto l = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const std::string op = next().text;
      l = binary(op, std::move(l), parse_pow(), pos);
    }
    return l;
  }

  std::unique_ptr<Expr> parse_pow() {
    const SrcPos pos = here();
    auto l = parse_unary(true);
    while (skip_op("**")) l = binary("**", std::move(l), parse_unary(true), pos);
    return l;
  }

  std::unique_ptr<Expr> parse_unary(bool with_filter) {
    Depth d(*this);
    std::unique_ptr<Expr> node;
    if (is_op("-") || is_op("+")) {
      node = make(is_op("-") ? ExprKind::Neg : ExprKind::Pos, here());
      next();
      node->args.push_back(parse_unary(false));
      node = done(std::move(node));
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    if (with_filter) node = parse_filter_expr(std::move(node));
    return node;
  }

  std::unique_ptr<Expr> parse_primary() {
    const CtToken& t = cur();
    const SrcPos pos = at(t);
    if (t.kind == Tk::Name) {
      next();
      if (t.text == "true" || t.text == "True" || t.text == "false" || t.text == "False") {
        auto e = make(ExprKind::Const, pos);
        e->constant = t.text == "true" || t.text == "True";
        return e;
      }
      if (t.text == "none" || t.text == "None") return make(ExprKind::Const, pos);
      if (t.text == "varargs" || t.text == "kwargs" || t.text == "caller")
        unsupported(pos, "'" + t.text + "' (macro varargs, kwargs and caller) is not supported");
      auto e = make(ExprKind::Name, pos);
      e->str = t.text;
      return e;
    }
    if (t.kind == Tk::String) {
      std::string s;
      while (cur().kind == Tk::String) s += next().text;  // adjacent literals join
      auto e = make(ExprKind::Const, pos);
      e->constant = std::move(s);
      return e;
    }
    if (t.kind == Tk::Integer || t.kind == Tk::Float) {
      auto e = make(ExprKind::Const, pos);
      if (t.kind == Tk::Integer) e->constant = t.ival;
      else e->constant = t.fval;
      next();
      return e;
    }
    if (is_op("(")) {
      next();
      auto e = parse_tuple(true, nullptr, true);
      expect_op(")");
      return e;
    }
    if (is_op("[")) {
      next();
      auto e = make(ExprKind::List, pos);
      while (!is_op("]")) {
        if (!e->args.empty()) expect_op(",");
        if (is_op("]")) break;
        e->args.push_back(parse_expression(true));
      }
      expect_op("]");
      return done(std::move(e));
    }
    if (is_op("{")) {
      next();
      auto e = make(ExprKind::Dict, pos);
      while (!is_op("}")) {
        if (!e->args.empty()) expect_op(",");
        if (is_op("}")) break;
        e->args.push_back(parse_expression(true));
        expect_op(":");
        e->args.push_back(parse_expression(true));
      }
      expect_op("}");
      return done(std::move(e));
    }
    fail("unexpected " + describe(t));
  }

  std::unique_ptr<Expr> parse_postfix(std::unique_ptr<Expr> node) {
    for (;;) {
      if (is_op(".") || is_op("[")) node = parse_subscript(std::move(node));
      else if (is_op("(")) node = parse_call(std::move(node));
      else return node;
    }
  }

  std::unique_ptr<Expr> parse_filter_expr(std::unique_ptr<Expr> node) {
    for (;;) {
      if (is_op("|")) {
        next();
        node = parse_one_filter(std::move(node));
      } else if (is_name("is")) {
        node = parse_test(std::move(node));
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  std::unique_ptr<Expr> parse_subscript(std::unique_ptr<Expr> node) {
    const CtToken& t = next();
    const SrcPos pos = at(t);
    if (t.text == ".") {
      const CtToken& a = next();
      if (a.kind == Tk::Name) {
        auto e = make(ExprKind::GetAttr, pos);
        e->str = a.text;
        e->args.push_back(std::move(node));
        return done(std::move(e));
      }
      if (a.kind != Tk::Integer) fail_at(a, "expected a name or a number after '.'");
      auto e = make(ExprKind::GetItem, pos);
      e->args.push_back(std::move(node));
      auto idx = make(ExprKind::Const, at(a));
      idx->constant = a.ival;
      e->args.push_back(std::move(idx));
      return done(std::move(e));
    }
    // '['
    std::vector<std::unique_ptr<Expr>> subs;
    while (!is_op("]")) {
      if (!subs.empty()) expect_op(",");
      subs.push_back(parse_subscribed());
    }
    expect_op("]");
    if (subs.size() != 1) unsupported(pos, "subscripts with a tuple are not supported");
    std::unique_ptr<Expr> sub = std::move(subs[0]);
    if (sub->kind == ExprKind::Slice) {
      sub->args.insert(sub->args.begin(), std::move(node));
      return done(std::move(sub));
    }
    auto e = make(ExprKind::GetItem, pos);
    e->args.push_back(std::move(node));
    e->args.push_back(std::move(sub));
    return done(std::move(e));
  }

  // An index, or a slice [a]:[b][:[c]] (a Slice holding start, stop, step).
  std::unique_ptr<Expr> parse_subscribed() {
    const SrcPos pos = here();
    std::unique_ptr<Expr> start;
    if (!skip_op(":")) {
      start = parse_expression(true);
      if (!skip_op(":")) return start;
    }
    auto sl = make(ExprKind::Slice, pos);  // finished (done()) with its object by parse_subscript
    sl->args.push_back(std::move(start));
    if (is_op(":") || is_op("]") || is_op(",")) sl->args.push_back(nullptr);
    else sl->args.push_back(parse_expression(true));
    if (skip_op(":")) {
      if (is_op("]") || is_op(",")) sl->args.push_back(nullptr);
      else sl->args.push_back(parse_expression(true));
    } else {
      sl->args.push_back(nullptr);
    }
    return sl;
  }

  // `(args, name=value)` into e->args (after what is already there) and e->kwargs.
  void parse_call_args(Expr& e) {
    const SrcPos pos = here();
    expect_op("(");
    bool need_comma = false;
    while (!is_op(")")) {
      if (need_comma) {
        expect_op(",");
        if (is_op(")")) break;
      }
      if (is_op("*") || is_op("**")) unsupported(here(), "*args and **kwargs in calls are not supported");
      if (cur().kind == Tk::Name && look().kind == Tk::Op && look().text == "=") {
        std::string key = next().text;
        next();
        e.kwargs.emplace_back(std::move(key), parse_expression(true));
      } else {
        if (!e.kwargs.empty()) ct_fail(Status::Format, pos, "a positional argument follows a keyword argument");
        e.args.push_back(parse_expression(true));
      }
      need_comma = true;
    }
    expect_op(")");
  }

  std::unique_ptr<Expr> parse_call(std::unique_ptr<Expr> node) {
    const SrcPos pos = here();
    if (node->kind == ExprKind::GetAttr) {
      if (!method_supported(node->str)) unsupported(node->pos, "the method '" + node->str + "()' is not supported");
    } else if (node->kind == ExprKind::Name) {
      const std::string& f = node->str;
      static const std::set<std::string> kNo = {"lipsum", "cycler", "joiner", "super", "self", "loop"};
      if (kNo.count(f)) unsupported(node->pos, "'" + f + "()' is not supported");
      if (!ct_builtin_functions().count(f)) called_.emplace_back(f, node->pos);
    } else {
      unsupported(pos, "calling the result of an expression is not supported");
    }
    auto e = make(ExprKind::Call, pos);
    e->args.push_back(std::move(node));
    parse_call_args(*e);
    return done(std::move(e));
  }

  // `name(args)` after a `|`; `input` null inside {% filter %} and {% set x | f %}.
  std::unique_ptr<Expr> parse_one_filter(std::unique_ptr<Expr> input) {
    const CtToken& t = expect_name();
    const SrcPos pos = at(t);
    std::string name = t.text;
    if (is_op(".")) unsupported(pos, "dotted filter names are not supported");
    if (!filter_supported(name)) {
      if (jinja_filters().count(name)) unsupported(pos, "the filter '" + name + "' is not supported");
      ct_fail(Status::Format, pos, "no filter named '" + name + "'");
    }
    auto e = make(ExprKind::Filter, pos);
    e->str = std::move(name);
    e->args.push_back(std::move(input));
    if (is_op("(")) parse_call_args(*e);
    return done(std::move(e));
  }

  std::unique_ptr<Expr> parse_test(std::unique_ptr<Expr> node) {
    const SrcPos pos = here();
    next();  // is
    const bool negated = skip_name("not");
    const CtToken& t = expect_name();
    std::string name = t.text;
    if (is_op(".")) unsupported(at(t), "dotted test names are not supported");
    if (!test_supported(name)) {
      if (jinja_tests().count(name)) unsupported(at(t), "the test '" + name + "' is not supported");
      ct_fail(Status::Format, at(t), "no test named '" + name + "'");
    }
    auto e = make(ExprKind::Test, pos);
    e->str = std::move(name);
    e->negated = negated;
    e->args.push_back(std::move(node));
    if (is_op("(")) {
      parse_call_args(*e);
    } else if ((cur().kind == Tk::Name || cur().kind == Tk::String || cur().kind == Tk::Integer ||
                cur().kind == Tk::Float || is_op("(") || is_op("[") || is_op("{")) &&
               !is_name("else") && !is_name("or") && !is_name("and")) {
      if (is_name("is")) fail("tests cannot be chained with 'is'");
      Depth d(*this);
      e->args.push_back(parse_postfix(parse_primary()));
    }
    return done(std::move(e));
  }

  const CtSource& src_;
  std::vector<CtToken> toks_;
  size_t i_ = 0;
  int depth_ = 0;
  int loop_depth_ = 0;
  int macro_depth_ = 0;
  std::set<std::string> macros_;
  std::vector<std::pair<std::string, SrcPos>> called_;
};

}  // namespace

std::unique_ptr<Program> parse_template(const std::string& source) {
  if (source.size() > kCtMaxSourceBytes)
    throw Error(Status::Format, "chat template: " + std::to_string(source.size()) + " bytes, more than the 4 MiB accepted");
  const CtSource src(source);
  CtLexer lexer(src);
  CtParser parser(src, lexer.run());
  return parser.parse();
}

}  // namespace colibri::jinja
