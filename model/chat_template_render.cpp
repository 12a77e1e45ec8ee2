// chat_template_render.cpp: renders a parsed chat template (model/chat_template.h)
// with Python's semantics where chat templates can see them: jinja2's default
// Undefined, Python's str()/repr() of values, truthiness, comparisons and
// arithmetic, the sandbox's attribute lookup (dict methods before keys), and the
// filters, tests and str/dict methods of docs/chat_templates.md.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <ctime>
#include <limits>
#include <utility>

#include "model/chat_template.h"
#include "model/chat_template_impl.h"
#include "model/error.h"

namespace colibri {
namespace jinja {

namespace {

constexpr int kRtMaxJsonDepth = 256;     // nesting of a value printed, compared or serialised
// NOTE: statements and expressions nest at most 128 deep in the source, but a
// recursive macro multiplies that; this bounds the renderer's own recursion.
constexpr int kRtMaxRecursion = 1000;
constexpr int64_t kRtMaxRange = 1000000;  // elements of range()

[[noreturn]] void rt_fail(SrcPos p, const std::string& msg) {
  throw Error(Status::InvalidArgument,
              "chat template line " + std::to_string(p.line) + ":" + std::to_string(p.col) + ": " + msg);
}

// Something Python would do that this subset does not (docs/chat_templates.md).
[[noreturn]] void rt_unsupported(SrcPos p, const std::string& msg) {
  throw Error(Status::Unsupported,
              "chat template line " + std::to_string(p.line) + ":" + std::to_string(p.col) + ": " + msg);
}

struct RtObject {
  virtual ~RtObject() = default;
};

enum class RtBuiltin : uint8_t { RaiseException, Namespace, StrftimeNow, Range, Dict };

// A template value: JSON (held by `owner`, pointing at `j` inside it), or one of
// the objects a template can make but JSON cannot hold.
struct RtValue {
  enum class K : uint8_t { Undefined, Json, Namespace, Macro, Builtin, Loop, Method };
  K k = K::Undefined;
  std::shared_ptr<const ojson> owner;
  const ojson* j = nullptr;
  std::shared_ptr<RtObject> obj;  // Namespace, Loop, Method
  const Node* macro = nullptr;
  RtBuiltin fn = RtBuiltin::RaiseException;
  std::string undef;  // Undefined: the message a use of it fails with

  bool is_json() const { return k == K::Json; }
  bool is_undefined() const { return k == K::Undefined; }
  bool is_str() const { return k == K::Json && j->is_string(); }
  const std::string& str() const { return j->get_ref<const std::string&>(); }
};

struct RtNamespace : RtObject {
  std::vector<std::pair<std::string, RtValue>> attrs;
  RtValue* find(const std::string& name) {
    for (auto& kv : attrs)
      if (kv.first == name) return &kv.second;
    return nullptr;
  }
};

struct RtLoop : RtObject {
  std::vector<RtValue> items;
  size_t index0 = 0;
};

struct RtMethod : RtObject {
  RtValue self;
  std::string name;
};

RtValue rt_json(ojson v) {
  RtValue r;
  r.k = RtValue::K::Json;
  r.owner = std::make_shared<const ojson>(std::move(v));
  r.j = r.owner.get();
  return r;
}

RtValue rt_sub(const RtValue& parent, const ojson* sub) {
  RtValue r;
  r.k = RtValue::K::Json;
  r.owner = parent.owner;
  r.j = sub;
  return r;
}

RtValue rt_undef(std::string msg) {
  RtValue r;
  r.undef = std::move(msg);
  return r;
}

RtValue rt_method(const RtValue& self, const std::string& name) {
  auto m = std::make_shared<RtMethod>();
  m->self = self;
  m->name = name;
  RtValue r;
  r.k = RtValue::K::Method;
  r.obj = std::move(m);
  return r;
}

// ---- Python's view of JSON values ----

const char* rt_type_name(const RtValue& v) {
  switch (v.k) {
    case RtValue::K::Undefined: return "Undefined";
    case RtValue::K::Namespace: return "Namespace";
    case RtValue::K::Macro: return "Macro";
    case RtValue::K::Builtin: return "function";
    case RtValue::K::Loop: return "LoopContext";
    case RtValue::K::Method: return "method";
    case RtValue::K::Json: break;
  }
  switch (v.j->type()) {
    case ojson::value_t::null: return "NoneType";
    case ojson::value_t::boolean: return "bool";
    case ojson::value_t::number_integer:
    case ojson::value_t::number_unsigned: return "int";
    case ojson::value_t::number_float: return "float";
    case ojson::value_t::string: return "str";
    case ojson::value_t::array: return "list";
    case ojson::value_t::object: return "dict";
    default: return "object";
  }
}

bool rt_truthy(const RtValue& v) {
  if (v.k == RtValue::K::Undefined) return false;
  if (v.k != RtValue::K::Json) return true;
  const ojson& j = *v.j;
  switch (j.type()) {
    case ojson::value_t::null: return false;
    case ojson::value_t::boolean: return j.get<bool>();
    case ojson::value_t::number_integer: return j.get<int64_t>() != 0;
    case ojson::value_t::number_unsigned: return j.get<uint64_t>() != 0;
    case ojson::value_t::number_float: return j.get<double>() != 0.0;  // NaN is true, as in Python
    case ojson::value_t::string: return !j.get_ref<const std::string&>().empty();
    case ojson::value_t::array:
    case ojson::value_t::object: return !j.empty();
    default: return true;
  }
}

// An int of Python (bools included) that fits int64.
bool rt_int(const RtValue& v, int64_t* out) {
  if (v.k != RtValue::K::Json) return false;
  const ojson& j = *v.j;
  if (j.is_boolean()) {
    *out = j.get<bool>() ? 1 : 0;
    return true;
  }
  if (j.is_number_integer() && !j.is_number_unsigned()) {
    *out = j.get<int64_t>();
    return true;
  }
  if (j.is_number_unsigned() && j.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX)) {
    *out = static_cast<int64_t>(j.get<uint64_t>());
    return true;
  }
  return false;
}

bool rt_number(const RtValue& v) { return v.k == RtValue::K::Json && (v.j->is_number() || v.j->is_boolean()); }

double rt_double(const RtValue& v) {
  const ojson& j = *v.j;
  if (j.is_boolean()) return j.get<bool>() ? 1.0 : 0.0;
  if (j.is_number_unsigned()) return static_cast<double>(j.get<uint64_t>());
  if (j.is_number_integer()) return static_cast<double>(j.get<int64_t>());
  return j.get<double>();
}

// Python's repr() of a float.
std::string rt_float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string s(buf, res.ptr);
  std::string sign;
  if (!s.empty() && s[0] == '-') {
    sign = "-";
    s.erase(0, 1);
  }
  const size_t e = s.find('e');
  std::string digits = s.substr(0, e);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  const int exp10 = std::stoi(s.substr(e + 1));
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  std::string out;
  if (exp10 < -4 || exp10 >= 16) {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    const int a = std::abs(exp10);
    out += exp10 < 0 ? "e-" : "e+";
    if (a < 10) out += "0";
    out += std::to_string(a);
  } else if (exp10 >= 0) {
    const size_t intlen = static_cast<size_t>(exp10) + 1;
    if (digits.size() <= intlen) {
      out = digits + std::string(intlen - digits.size(), '0') + ".0";
    } else {
      out = digits.substr(0, intlen) + "." + digits.substr(intlen);
    }
  } else {
    out = "0." + std::string(static_cast<size_t>(-exp10 - 1), '0') + digits;
  }
  return sign + out;
}

std::string rt_hex(uint32_t v, int width) {
  static const char* kHex = "0123456789abcdef";
  std::string s(static_cast<size_t>(width), '0');
  for (int i = width - 1; i >= 0; --i, v >>= 4) s[static_cast<size_t>(i)] = kHex[v & 0xF];
  return s;
}

// Code points str.isprintable() rejects, besides the ASCII and C1 controls: the
// separators and the common format characters (docs/chat_templates.md).
bool rt_unprintable(uint32_t cp) {
  if (cp < 0x20 || (cp >= 0x7F && cp <= 0xA0)) return true;
  if (cp == 0xAD || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200F) || (cp >= 0x2028 && cp <= 0x202F) ||
      (cp >= 0x205F && cp <= 0x206F) || cp == 0x3000 || cp == 0xFEFF || (cp >= 0xFFF9 && cp <= 0xFFFB))
    return true;
  if ((cp >= 0x600 && cp <= 0x605) || cp == 0x61C || cp == 0x6DD || cp == 0x70F || cp == 0x180E) return true;
  if ((cp >= 0xD800 && cp <= 0xDFFF) || (cp >= 0xE000 && cp <= 0xF8FF) || cp >= 0xF0000) return true;
  if ((cp >= 0xE0000 && cp <= 0xE007F)) return true;
  return false;
}

// Python's repr() of a str.
std::string rt_str_repr(const std::string& s) {
  const bool has_single = s.find('\'') != std::string::npos;
  const bool has_double = s.find('"') != std::string::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (size_t i = 0; i < s.size();) {
    uint32_t cp = 0;
    const size_t n = utf8_decode(s, i, &cp);
    if (cp == static_cast<uint32_t>(quote) || cp == '\\') {
      out += '\\';
      out += static_cast<char>(cp);
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp == '\t') {
      out += "\\t";
    } else if (rt_unprintable(cp)) {
      if (cp <= 0xFF) out += "\\x" + rt_hex(cp, 2);
      else if (cp <= 0xFFFF) out += "\\u" + rt_hex(cp, 4);
      else out += "\\U" + rt_hex(cp, 8);
    } else {
      out.append(s, i, n);
    }
    i += n;
  }
  out += quote;
  return out;
}

void rt_repr_into(const ojson& j, std::string& out, int depth) {
  if (depth > kRtMaxJsonDepth) throw Error(Status::InvalidArgument, "chat template: a value nests too deeply");
  switch (j.type()) {
    case ojson::value_t::null: out += "None"; return;
    case ojson::value_t::boolean: out += j.get<bool>() ? "True" : "False"; return;
    case ojson::value_t::number_integer: out += std::to_string(j.get<int64_t>()); return;
    case ojson::value_t::number_unsigned: out += std::to_string(j.get<uint64_t>()); return;
    case ojson::value_t::number_float: out += rt_float_repr(j.get<double>()); return;
    case ojson::value_t::string: out += rt_str_repr(j.get_ref<const std::string&>()); return;
    case ojson::value_t::array: {
      out += '[';
      bool first = true;
      for (const auto& e : j) {
        if (!first) out += ", ";
        first = false;
        rt_repr_into(e, out, depth + 1);
      }
      out += ']';
      return;
    }
    case ojson::value_t::object: {
      out += '{';
      bool first = true;
      for (const auto& [k, v] : j.items()) {
        if (!first) out += ", ";
        first = false;
        out += rt_str_repr(k);
        out += ": ";
        rt_repr_into(v, out, depth + 1);
      }
      out += '}';
      return;
    }
    default: throw Error(Status::InvalidArgument, "chat template: a binary value cannot be printed");
  }
}

// Python's json.dumps(..., ensure_ascii, indent, separators, sort_keys), as
// transformers' tojson filter calls it.
struct RtJsonStyle {
  bool ensure_ascii = false;
  bool indent = false;
  std::string indent_unit;
  std::string item_sep = ", ", key_sep = ": ";
  bool sort_keys = false;
};

void rt_json_string(const std::string& s, bool ensure_ascii, std::string& out) {
  out += '"';
  for (size_t i = 0; i < s.size();) {
    uint32_t cp = 0;
    const size_t n = utf8_decode(s, i, &cp);
    switch (cp) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (cp < 0x20 || (ensure_ascii && cp > 0x7E)) {
          if (cp >= 0x10000) {
            const uint32_t v = cp - 0x10000;
            out += "\\u" + rt_hex(0xD800 + (v >> 10), 4) + "\\u" + rt_hex(0xDC00 + (v & 0x3FF), 4);
          } else {
            out += "\\u" + rt_hex(cp, 4);
          }
        } else {
          out.append(s, i, n);
        }
    }
    i += n;
  }
  out += '"';
}

void rt_dump_into(const ojson& j, const RtJsonStyle& st, int level, std::string& out) {
  if (level > kRtMaxJsonDepth) throw Error(Status::InvalidArgument, "chat template: a value nests too deeply for tojson");
  auto newline = [&](int lv) {
    out += '\n';
    for (int i = 0; i < lv; ++i) out += st.indent_unit;
  };
  switch (j.type()) {
    case ojson::value_t::null: out += "null"; return;
    case ojson::value_t::boolean: out += j.get<bool>() ? "true" : "false"; return;
    case ojson::value_t::number_integer: out += std::to_string(j.get<int64_t>()); return;
    case ojson::value_t::number_unsigned: out += std::to_string(j.get<uint64_t>()); return;
    case ojson::value_t::number_float: {
      const double d = j.get<double>();
      if (std::isnan(d)) out += "NaN";
      else if (std::isinf(d)) out += d < 0 ? "-Infinity" : "Infinity";
      else out += rt_float_repr(d);
      return;
    }
    case ojson::value_t::string: rt_json_string(j.get_ref<const std::string&>(), st.ensure_ascii, out); return;
    case ojson::value_t::array: {
      if (j.empty()) {
        out += "[]";
        return;
      }
      out += '[';
      bool first = true;
      for (const auto& e : j) {
        if (!first) out += st.item_sep;
        first = false;
        if (st.indent) newline(level + 1);
        rt_dump_into(e, st, level + 1, out);
      }
      if (st.indent) newline(level);
      out += ']';
      return;
    }
    case ojson::value_t::object: {
      if (j.empty()) {
        out += "{}";
        return;
      }
      std::vector<std::pair<const std::string*, const ojson*>> items;
      for (const auto& [k, v] : j.items()) items.emplace_back(&k, &v);
      if (st.sort_keys)
        std::stable_sort(items.begin(), items.end(), [](const auto& a, const auto& b) { return *a.first < *b.first; });
      out += '{';
      bool first = true;
      for (const auto& [k, v] : items) {
        if (!first) out += st.item_sep;
        first = false;
        if (st.indent) newline(level + 1);
        rt_json_string(*k, st.ensure_ascii, out);
        out += st.key_sep;
        rt_dump_into(*v, st, level + 1, out);
      }
      if (st.indent) newline(level);
      out += '}';
      return;
    }
    default: throw Error(Status::InvalidArgument, "chat template: a binary value cannot be serialised");
  }
}

bool rt_json_eq(const ojson& a, const ojson& b, int depth) {
  if (depth > kRtMaxJsonDepth) throw Error(Status::InvalidArgument, "chat template: a value nests too deeply to compare");
  const bool an = a.is_number() || a.is_boolean(), bn = b.is_number() || b.is_boolean();
  if (an && bn) {
    auto as_i = [](const ojson& x, int64_t* o) {
      if (x.is_boolean()) return *o = x.get<bool>(), true;
      if (x.is_number_unsigned()) return x.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX) ? (*o = static_cast<int64_t>(x.get<uint64_t>()), true) : false;
      if (x.is_number_integer()) return *o = x.get<int64_t>(), true;
      return false;
    };
    int64_t x = 0, y = 0;
    if (as_i(a, &x) && as_i(b, &y)) return x == y;
    if (a.is_number_unsigned() && b.is_number_unsigned()) return a.get<uint64_t>() == b.get<uint64_t>();
    auto as_d = [](const ojson& v) {
      if (v.is_boolean()) return v.get<bool>() ? 1.0 : 0.0;
      if (v.is_number_unsigned()) return static_cast<double>(v.get<uint64_t>());
      if (v.is_number_integer()) return static_cast<double>(v.get<int64_t>());
      return v.get<double>();
    };
    return as_d(a) == as_d(b);
  }
  if (a.type() != b.type()) return false;
  switch (a.type()) {
    case ojson::value_t::null: return true;
    case ojson::value_t::string: return a.get_ref<const std::string&>() == b.get_ref<const std::string&>();
    case ojson::value_t::array: {
      if (a.size() != b.size()) return false;
      for (size_t i = 0; i < a.size(); ++i)
        if (!rt_json_eq(a[i], b[i], depth + 1)) return false;
      return true;
    }
    case ojson::value_t::object: {
      if (a.size() != b.size()) return false;
      for (const auto& [k, v] : a.items()) {
        auto it = b.find(k);
        if (it == b.end() || !rt_json_eq(v, *it, depth + 1)) return false;
      }
      return true;
    }
    default: return a == b;
  }
}

bool rt_eq(const RtValue& a, const RtValue& b) {
  if (a.k != b.k) return false;
  switch (a.k) {
    case RtValue::K::Undefined: return true;
    case RtValue::K::Json: return rt_json_eq(*a.j, *b.j, 0);
    case RtValue::K::Macro: return a.macro == b.macro;
    case RtValue::K::Builtin: return a.fn == b.fn;
    default: return a.obj == b.obj;
  }
}

// ---- strings as Python sees them (code points) ----

std::vector<uint32_t> rt_cps(const std::string& s) {
  std::vector<uint32_t> cps;
  cps.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    uint32_t cp = 0;
    i += utf8_decode(s, i, &cp);
    cps.push_back(cp);
  }
  return cps;
}

std::string rt_from_cps(const std::vector<uint32_t>& cps, size_t from = 0, size_t to = std::string::npos) {
  std::string out;
  to = std::min(to, cps.size());
  for (size_t i = from; i < to; ++i) utf8_append(out, cps[i]);
  return out;
}

size_t rt_len_cps(const std::string& s) {
  size_t n = 0;
  for (size_t i = 0; i < s.size();) {
    uint32_t cp = 0;
    i += utf8_decode(s, i, &cp);
    ++n;
  }
  return n;
}

// Latin Extended-A: pairs of (upper, lower) code points; true when c is in one.
bool rt_latin_ext_pair(uint32_t c, uint32_t* upper, uint32_t* lower) {
  const bool even_upper = (c >= 0x100 && c <= 0x12F) || (c >= 0x132 && c <= 0x137) || (c >= 0x14A && c <= 0x177);
  const bool odd_upper = (c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17E);
  if (!even_upper && !odd_upper) return false;
  const bool is_upper = even_upper ? c % 2 == 0 : c % 2 == 1;
  *upper = is_upper ? c : c - 1;
  *lower = is_upper ? c + 1 : c;
  return true;
}

// Case mapping of ASCII, Latin-1, Latin Extended-A, basic Greek and basic
// Cyrillic (Python maps all of Unicode; chat templates case role names and keywords).
uint32_t rt_upper(uint32_t c) {
  if (c >= 'a' && c <= 'z') return c - 32;
  if (c < 0x80) return c;
  if (c >= 0xE0 && c <= 0xFE && c != 0xF7) return c - 0x20;
  if (c == 0xFF) return 0x178;
  uint32_t up = 0, lo = 0;
  if (rt_latin_ext_pair(c, &up, &lo)) return up;
  if (c >= 0x3B1 && c <= 0x3C9 && c != 0x3C2) return c - 0x20;
  if (c == 0x3C2) return 0x3A3;
  if (c >= 0x430 && c <= 0x44F) return c - 0x20;
  if (c >= 0x450 && c <= 0x45F) return c - 0x50;
  return c;
}

uint32_t rt_lower(uint32_t c) {
  if (c >= 'A' && c <= 'Z') return c + 32;
  if (c < 0x80) return c;
  if (c >= 0xC0 && c <= 0xDE && c != 0xD7) return c + 0x20;
  if (c == 0x178) return 0xFF;
  uint32_t up = 0, lo = 0;
  if (rt_latin_ext_pair(c, &up, &lo)) return lo;
  if (c >= 0x391 && c <= 0x3A9 && c != 0x3A2) return c + 0x20;
  if (c >= 0x410 && c <= 0x42F) return c + 0x20;
  if (c >= 0x400 && c <= 0x40F) return c + 0x50;
  return c;
}

bool rt_cased(uint32_t c) { return rt_upper(c) != c || rt_lower(c) != c; }

std::string rt_map_case(const std::string& s, bool upper) {
  std::string out;
  out.reserve(s.size());
  for (uint32_t c : rt_cps(s)) {
    if (upper && c == 0xDF) out += "SS";  // ß, as Python's str.upper()
    else utf8_append(out, upper ? rt_upper(c) : rt_lower(c));
  }
  return out;
}

// str.title(): a cased character after an uncased one is upper-cased, the others lower.
std::string rt_str_title(const std::string& s) {
  std::string out;
  bool prev_cased = false;
  for (uint32_t c : rt_cps(s)) {
    const bool cased = rt_cased(c);
    utf8_append(out, cased ? (prev_cased ? rt_lower(c) : rt_upper(c)) : c);
    prev_cased = cased;
  }
  return out;
}

std::string rt_capitalize(const std::string& s) {
  std::string out;
  bool first = true;
  for (uint32_t c : rt_cps(s)) {
    utf8_append(out, first ? rt_upper(c) : rt_lower(c));
    first = false;
  }
  return out;
}

// jinja's title filter: each word (after -, whitespace, ( { [ <) capitalised.
std::string rt_jinja_title(const std::string& s) {
  std::string out;
  bool at_start = true;
  for (uint32_t c : rt_cps(s)) {
    const bool sep = c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || py_isspace(c);
    if (sep) {
      utf8_append(out, c);
      at_start = true;
    } else {
      utf8_append(out, at_start ? rt_upper(c) : rt_lower(c));
      at_start = false;
    }
  }
  return out;
}

// str.strip/lstrip/rstrip with Python's whitespace or a set of characters.
std::string rt_strip(const std::string& s, const std::string* chars, bool left, bool right) {
  const auto cps = rt_cps(s);
  std::vector<uint32_t> set;
  if (chars) set = rt_cps(*chars);
  auto strip = [&](uint32_t c) { return chars ? std::find(set.begin(), set.end(), c) != set.end() : py_isspace(c); };
  size_t b = 0, e = cps.size();
  if (left)
    while (b < e && strip(cps[b])) ++b;
  if (right)
    while (e > b && strip(cps[e - 1])) --e;
  return rt_from_cps(cps, b, e);
}

std::vector<std::string> rt_split_ws(const std::string& s, int64_t maxsplit) {
  std::vector<std::string> out;
  const auto cps = rt_cps(s);
  size_t i = 0;
  const size_t n = cps.size();
  while (i < n) {
    while (i < n && py_isspace(cps[i])) ++i;
    if (i >= n) break;
    if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
      out.push_back(rt_from_cps(cps, i, n));  // the rest, trailing whitespace kept
      return out;
    }
    size_t j = i;
    while (j < n && !py_isspace(cps[j])) ++j;
    out.push_back(rt_from_cps(cps, i, j));
    i = j;
  }
  return out;
}

std::vector<std::string> rt_rsplit_ws(const std::string& s, int64_t maxsplit) {
  std::vector<std::string> out;
  const auto cps = rt_cps(s);
  size_t e = cps.size();
  while (e > 0) {
    while (e > 0 && py_isspace(cps[e - 1])) --e;
    if (e == 0) break;
    if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
      out.push_back(rt_from_cps(cps, 0, e));  // the rest, leading whitespace kept
      break;
    }
    size_t b = e;
    while (b > 0 && !py_isspace(cps[b - 1])) --b;
    out.push_back(rt_from_cps(cps, b, e));
    e = b;
  }
  std::reverse(out.begin(), out.end());
  return out;
}

std::vector<std::string> rt_split_sep(const std::string& s, const std::string& sep, int64_t maxsplit) {
  std::vector<std::string> out;
  size_t from = 0;
  for (;;) {
    if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) break;
    const size_t at = s.find(sep, from);
    if (at == std::string::npos) break;
    out.push_back(s.substr(from, at - from));
    from = at + sep.size();
  }
  out.push_back(s.substr(from));
  return out;
}

std::vector<std::string> rt_rsplit_sep(const std::string& s, const std::string& sep, int64_t maxsplit) {
  std::vector<std::string> out;
  size_t end = s.size();
  for (;;) {
    if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) break;
    if (end < sep.size()) break;
    const size_t at = s.rfind(sep, end - sep.size());
    if (at == std::string::npos) break;
    out.push_back(s.substr(at + sep.size(), end - at - sep.size()));
    end = at;
  }
  out.push_back(s.substr(0, end));
  std::reverse(out.begin(), out.end());
  return out;
}

// str.splitlines(keepends).
std::vector<std::string> rt_splitlines(const std::string& s, bool keepends) {
  std::vector<std::string> out;
  const auto cps = rt_cps(s);
  size_t b = 0;
  for (size_t i = 0; i < cps.size(); ++i) {
    const uint32_t c = cps[i];
    const bool br = c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || (c >= 0x1C && c <= 0x1E) || c == 0x85 ||
                    c == 0x2028 || c == 0x2029;
    if (!br) continue;
    size_t e = i + 1;
    if (c == '\r' && i + 1 < cps.size() && cps[i + 1] == '\n') e = i + 2;
    out.push_back(rt_from_cps(cps, b, keepends ? e : i));
    b = e;
    i = e - 1;
  }
  if (b < cps.size()) out.push_back(rt_from_cps(cps, b));
  return out;
}

std::string rt_replace(const std::string& s, const std::string& old, const std::string& repl, int64_t count) {
  std::string out;
  if (old.empty()) {  // Python inserts `repl` around every character
    const auto cps = rt_cps(s);
    int64_t done = 0;
    for (size_t i = 0; i <= cps.size(); ++i) {
      if (count < 0 || done < count) {
        out += repl;
        ++done;
      }
      if (i < cps.size()) utf8_append(out, cps[i]);
    }
    return out;
  }
  size_t from = 0;
  int64_t done = 0;
  for (;;) {
    if (count >= 0 && done >= count) break;
    const size_t at = s.find(old, from);
    if (at == std::string::npos) break;
    out.append(s, from, at - from);
    out += repl;
    from = at + old.size();
    ++done;
  }
  out.append(s, from, std::string::npos);
  return out;
}

// ---- the renderer ----

struct RtFrame {
  RtFrame* parent = nullptr;
  std::vector<std::pair<std::string, RtValue>> vars;
  RtValue* find(const std::string& name) {
    for (RtFrame* f = this; f; f = f->parent)
      for (auto& kv : f->vars)
        if (kv.first == name) return &kv.second;
    return nullptr;
  }
  void set(const std::string& name, RtValue v) {
    for (auto& kv : vars)
      if (kv.first == name) {
        kv.second = std::move(v);
        return;
      }
    vars.emplace_back(name, std::move(v));
  }
};

enum class RtFlow : uint8_t { Normal, Break, Continue };

struct RtArgs {
  std::vector<RtValue> pos;
  std::vector<std::pair<std::string, RtValue>> kw;
};

class Renderer {
 public:
  Renderer(const Program& prog, const ojson& context, const ChatTemplateOptions& opt)
      : prog_(prog), opt_(opt), ctx_owner_(std::shared_ptr<const ojson>(), &context) {
    if (!context.is_object() && !context.is_null())
      throw Error(Status::InvalidArgument, "chat template: the render context is not an object");
  }

  std::string run() {
    std::string out;
    out_ = &out;
    RtFrame top;
    top_ = &top;
    exec_body(prog_.body, top);
    return out;
  }

 private:
  // ---- limits ----

  void tick(SrcPos p, int64_t n = 1) {
    steps_ += n;
    if (steps_ > opt_.max_steps)
      rt_fail(p, "the template ran more than " + std::to_string(opt_.max_steps) + " steps (ChatTemplateOptions::max_steps)");
  }

  void check_size(SrcPos p, size_t bytes) {
    if (bytes > opt_.max_output_bytes)
      rt_fail(p, "a string or list of " + std::to_string(bytes) + " bytes is larger than " +
                     std::to_string(opt_.max_output_bytes) + " (ChatTemplateOptions::max_output_bytes)");
  }

  RtValue make_str(SrcPos p, std::string s) {
    check_size(p, s.size());
    tick(p, static_cast<int64_t>(s.size() / 64));
    return rt_json(ojson(std::move(s)));
  }

  void emit(SrcPos p, const std::string& s) {
    check_size(p, out_->size() + s.size());
    out_->append(s);
  }

  // ---- conversions ----

  std::string to_str(const RtValue& v, SrcPos p) {
    switch (v.k) {
      case RtValue::K::Undefined: return {};
      case RtValue::K::Json:
        if (v.j->is_string()) return v.str();
        {
          std::string s;
          rt_repr_into(*v.j, s, 0);
          return s;
        }
      case RtValue::K::Namespace: {
        std::string s = "<Namespace {";
        bool first = true;
        for (const auto& [k, a] : static_cast<RtNamespace&>(*v.obj).attrs) {
          if (!first) s += ", ";
          first = false;
          s += rt_str_repr(k) + ": " + repr(a, p);
        }
        return s + "}>";
      }
      default: rt_unsupported(p, std::string("printing a ") + rt_type_name(v) + " is not supported");
    }
  }

  std::string repr(const RtValue& v, SrcPos p) {
    if (v.k == RtValue::K::Json) {
      std::string s;
      rt_repr_into(*v.j, s, 0);
      return s;
    }
    if (v.k == RtValue::K::Undefined) return "Undefined";
    return to_str(v, p);
  }

  ojson to_json(const RtValue& v, SrcPos p) {
    if (v.k == RtValue::K::Json) return *v.j;
    if (v.k == RtValue::K::Undefined) rt_unsupported(p, "storing an undefined value in a list or dict is not supported");
    rt_unsupported(p, std::string("storing a ") + rt_type_name(v) + " in a list or dict is not supported");
  }

  [[noreturn]] void fail_undefined(const RtValue& v, SrcPos p) { rt_fail(p, v.undef); }

  // The elements a for loop (or list()) sees: a str's characters, a dict's keys.
  std::vector<RtValue> iterate(const RtValue& v, SrcPos p) {
    std::vector<RtValue> out;
    if (v.is_undefined()) return out;
    if (v.k != RtValue::K::Json) rt_fail(p, std::string("'") + rt_type_name(v) + "' object is not iterable");
    const ojson& j = *v.j;
    if (j.is_array()) {
      out.reserve(j.size());
      for (const auto& e : j) out.push_back(rt_sub(v, &e));
    } else if (j.is_object()) {
      for (const auto& [k, e] : j.items()) out.push_back(rt_json(ojson(k)));
    } else if (j.is_string()) {
      for (uint32_t c : rt_cps(j.get_ref<const std::string&>())) {
        std::string s;
        utf8_append(s, c);
        out.push_back(rt_json(ojson(std::move(s))));
      }
    } else {
      rt_fail(p, std::string("'") + rt_type_name(v) + "' object is not iterable");
    }
    tick(p, static_cast<int64_t>(out.size() / 16));
    return out;
  }

  RtValue list_value(const std::vector<RtValue>& items, SrcPos p) {
    ojson arr = ojson::array();
    for (const auto& it : items) arr.push_back(to_json(it, p));
    return rt_json(std::move(arr));
  }

  size_t length(const RtValue& v, SrcPos p) {
    if (v.is_undefined()) return 0;
    if (v.k == RtValue::K::Json) {
      if (v.j->is_string()) return rt_len_cps(v.str());
      if (v.j->is_array() || v.j->is_object()) return v.j->size();
    }
    if (v.k == RtValue::K::Loop) return static_cast<RtLoop&>(*v.obj).items.size();
    rt_fail(p, std::string("object of type '") + rt_type_name(v) + "' has no len()");
  }

  // ---- attribute and item access (the sandbox's getattr / getitem) ----

  static bool dict_method(const std::string& n) { return n == "items" || n == "keys" || n == "values" || n == "get"; }
  static bool str_method(const std::string& n) {
    static const char* const k[] = {"strip", "lstrip", "rstrip", "split", "rsplit", "splitlines", "startswith",
                                    "endswith", "upper", "lower", "title", "capitalize", "replace", "find",
                                    "rfind", "count", "join"};
    for (const char* m : k)
      if (n == m) return true;
    return false;
  }

  RtValue get_attr(const RtValue& obj, const std::string& name, SrcPos p) {
    switch (obj.k) {
      case RtValue::K::Undefined: fail_undefined(obj, p);
      case RtValue::K::Namespace: {
        if (RtValue* v = static_cast<RtNamespace&>(*obj.obj).find(name)) return *v;
        return rt_undef("'Namespace' object has no attribute '" + name + "'");
      }
      case RtValue::K::Loop: return loop_attr(obj, name, p);
      case RtValue::K::Json: break;
      default: return rt_undef(std::string("'") + rt_type_name(obj) + "' object has no attribute '" + name + "'");
    }
    const ojson& j = *obj.j;
    if (j.is_object()) {
      if (dict_method(name)) return rt_method(obj, name);
      auto it = j.find(name);
      if (it != j.end()) return rt_sub(obj, &*it);
    } else if (j.is_string()) {
      if (str_method(name)) return rt_method(obj, name);
    }
    return rt_undef(std::string("'") + rt_type_name(obj) + " object' has no attribute '" + name + "'");
  }

  RtValue get_item(const RtValue& obj, const RtValue& key, SrcPos p) {
    if (obj.is_undefined()) fail_undefined(obj, p);
    if (obj.k == RtValue::K::Json) {
      const ojson& j = *obj.j;
      int64_t idx = 0;
      if (j.is_object() && key.is_str()) {
        auto it = j.find(key.str());
        if (it != j.end()) return rt_sub(obj, &*it);
      } else if ((j.is_array() || j.is_string()) && rt_int(key, &idx)) {
        if (j.is_array()) {
          const auto n = static_cast<int64_t>(j.size());
          if (idx < 0) idx += n;
          if (idx >= 0 && idx < n) return rt_sub(obj, &j[static_cast<size_t>(idx)]);
        } else {
          const auto cps = rt_cps(obj.str());
          const auto n = static_cast<int64_t>(cps.size());
          if (idx < 0) idx += n;
          if (idx >= 0 && idx < n) {
            std::string s;
            utf8_append(s, cps[static_cast<size_t>(idx)]);
            return rt_json(ojson(std::move(s)));
          }
        }
        return rt_undef(std::string("'") + rt_type_name(obj) + " object' has no element " + std::to_string(idx));
      }
    }
    if (key.is_str()) {  // getitem falls back to getattr for a string key
      RtValue v = get_attr(obj, key.str(), p);
      return v;
    }
    return rt_undef(std::string("'") + rt_type_name(obj) + " object' has no element " + repr(key, p));
  }

  RtValue loop_attr(const RtValue& lv, const std::string& name, SrcPos p) {
    const auto& l = static_cast<RtLoop&>(*lv.obj);
    const auto n = static_cast<int64_t>(l.items.size());
    const auto i = static_cast<int64_t>(l.index0);
    if (name == "index") return rt_json(i + 1);
    if (name == "index0") return rt_json(i);
    if (name == "revindex") return rt_json(n - i);
    if (name == "revindex0") return rt_json(n - i - 1);
    if (name == "first") return rt_json(i == 0);
    if (name == "last") return rt_json(i == n - 1);
    if (name == "length") return rt_json(n);
    if (name == "depth") return rt_json(1);
    if (name == "depth0") return rt_json(0);
    if (name == "previtem") return i > 0 ? l.items[static_cast<size_t>(i - 1)] : rt_undef("there is no previous item");
    if (name == "nextitem") return i + 1 < n ? l.items[static_cast<size_t>(i + 1)] : rt_undef("there is no next item");
    if (name == "cycle") return rt_method(lv, name);
    (void)p;
    return rt_undef("'LoopContext' object has no attribute '" + name + "'");
  }

  RtValue slice(const RtValue& obj, const RtValue* a, const RtValue* b, const RtValue* c, SrcPos p) {
    if (obj.is_undefined()) fail_undefined(obj, p);
    auto num = [&](const RtValue* v, int64_t dflt) {
      if (!v || (v->k == RtValue::K::Json && v->j->is_null())) return std::optional<int64_t>();
      int64_t x = 0;
      if (!rt_int(*v, &x)) rt_fail(p, "slice indices must be integers or None");
      (void)dflt;
      return std::optional<int64_t>(x);
    };
    const auto start = num(a, 0), stop = num(b, 0), step_o = num(c, 1);
    const int64_t step = step_o.value_or(1);
    if (step == 0) rt_fail(p, "slice step cannot be zero");
    const bool is_list = obj.k == RtValue::K::Json && obj.j->is_array();
    const bool is_str = obj.is_str();
    if (!is_list && !is_str) rt_fail(p, std::string("'") + rt_type_name(obj) + "' object is not subscriptable");
    std::vector<uint32_t> cps;
    if (is_str) cps = rt_cps(obj.str());
    const int64_t n = is_list ? static_cast<int64_t>(obj.j->size()) : static_cast<int64_t>(cps.size());
    // Python's slice.indices()
    auto adjust = [&](std::optional<int64_t> v, int64_t dflt_pos, int64_t dflt_neg) {
      if (!v) return step > 0 ? dflt_pos : dflt_neg;
      int64_t x = *v;
      if (x < 0) {
        x += n;
        if (x < 0) x = step < 0 ? -1 : 0;
      } else if (x >= n) {
        x = step < 0 ? n - 1 : n;
      }
      return x;
    };
    const int64_t lo = adjust(start, 0, n - 1), hi = adjust(stop, n, -1);
    std::vector<int64_t> idx;
    if (step > 0)
      for (int64_t i = lo; i < hi; i += step) idx.push_back(i);
    else
      for (int64_t i = lo; i > hi; i += step) idx.push_back(i);
    if (is_list) {
      ojson out = ojson::array();
      for (int64_t i : idx) out.push_back((*obj.j)[static_cast<size_t>(i)]);
      return rt_json(std::move(out));
    }
    std::string s;
    for (int64_t i : idx) utf8_append(s, cps[static_cast<size_t>(i)]);
    return rt_json(ojson(std::move(s)));
  }

  // ---- operators ----

  [[noreturn]] void op_type_error(const std::string& op, const RtValue& a, const RtValue& b, SrcPos p) {
    if (a.is_undefined()) fail_undefined(a, p);
    if (b.is_undefined()) fail_undefined(b, p);
    rt_fail(p, "unsupported operand types for " + op + ": '" + rt_type_name(a) + "' and '" + rt_type_name(b) + "'");
  }

  RtValue arith(const std::string& op, const RtValue& a, const RtValue& b, SrcPos p) {
    if (op == "~") return make_str(p, to_str(a, p) + to_str(b, p));
    if (a.is_undefined()) fail_undefined(a, p);
    if (b.is_undefined()) fail_undefined(b, p);
    int64_t x = 0, y = 0;
    const bool ints = rt_int(a, &x) && rt_int(b, &y);
    if (op == "+") {
      if (a.is_str() && b.is_str()) return make_str(p, a.str() + b.str());
      if (a.is_json() && b.is_json() && a.j->is_array() && b.j->is_array()) {
        check_size(p, (a.j->size() + b.j->size()) * sizeof(ojson));
        ojson r = *a.j;
        for (const auto& e : *b.j) r.push_back(e);
        return rt_json(std::move(r));
      }
    }
    if (op == "*") {
      const RtValue* seq = nullptr;
      int64_t times = 0;
      if ((a.is_str() || (a.is_json() && a.j->is_array())) && rt_int(b, &times)) seq = &a;
      else if ((b.is_str() || (b.is_json() && b.j->is_array())) && rt_int(a, &times)) seq = &b;
      if (seq) {
        times = std::max<int64_t>(times, 0);
        const size_t unit = seq->is_str() ? seq->str().size() : seq->j->size() * sizeof(ojson);
        if (times > 0 && unit > opt_.max_output_bytes / static_cast<size_t>(times))
          check_size(p, opt_.max_output_bytes + 1);  // NOTE: before multiplying, which could overflow
        if (seq->is_str()) {
          check_size(p, seq->str().size() * static_cast<size_t>(times));
          std::string s;
          for (int64_t i = 0; i < times; ++i) s += seq->str();
          return make_str(p, std::move(s));
        }
        check_size(p, seq->j->size() * static_cast<size_t>(times) * sizeof(ojson));
        ojson r = ojson::array();
        for (int64_t i = 0; i < times; ++i)
          for (const auto& e : *seq->j) r.push_back(e);
        return rt_json(std::move(r));
      }
    }
    if (op == "%" && a.is_str()) rt_unsupported(p, "string formatting with '%' is not supported");
    if (!rt_number(a) || !rt_number(b)) op_type_error(op, a, b, p);
    if (ints && op != "/") {
      int64_t r = 0;
      if (op == "+") {
        if (__builtin_add_overflow(x, y, &r)) rt_unsupported(p, "integers beyond 64 bits are not supported");
      } else if (op == "-") {
        if (__builtin_sub_overflow(x, y, &r)) rt_unsupported(p, "integers beyond 64 bits are not supported");
      } else if (op == "*") {
        if (__builtin_mul_overflow(x, y, &r)) rt_unsupported(p, "integers beyond 64 bits are not supported");
      } else if (op == "//" || op == "%") {
        if (y == 0) rt_fail(p, "integer division or modulo by zero");
        if (x == INT64_MIN && y == -1) rt_unsupported(p, "integers beyond 64 bits are not supported");
        int64_t q = x / y, m = x % y;
        if (m != 0 && ((m < 0) != (y < 0))) {
          --q;
          m += y;
        }
        r = op == "//" ? q : m;
      } else if (op == "**") {
        if (y < 0) return rt_json(std::pow(static_cast<double>(x), static_cast<double>(y)));
        r = 1;
        for (int64_t i = 0; i < y; ++i)
          if (__builtin_mul_overflow(r, x, &r)) rt_unsupported(p, "integers beyond 64 bits are not supported");
      }
      return rt_json(r);
    }
    const double dx = rt_double(a), dy = rt_double(b);
    double r = 0;
    if (op == "+") r = dx + dy;
    else if (op == "-") r = dx - dy;
    else if (op == "*") r = dx * dy;
    else if (op == "/") {
      if (dy == 0) rt_fail(p, "division by zero");
      r = dx / dy;
    } else if (op == "//") {
      if (dy == 0) rt_fail(p, "float floor division by zero");
      r = std::floor(dx / dy);
    } else if (op == "%") {
      if (dy == 0) rt_fail(p, "float modulo");
      r = std::fmod(dx, dy);
      if (r != 0 && ((r < 0) != (dy < 0))) r += dy;
    } else if (op == "**") {
      r = std::pow(dx, dy);
    }
    return rt_json(r);
  }

  // Python's a < b (and the others through it).
  bool less(const RtValue& a, const RtValue& b, SrcPos p, const char* op) {
    if (a.is_undefined()) fail_undefined(a, p);
    if (b.is_undefined()) fail_undefined(b, p);
    if (rt_number(a) && rt_number(b)) {
      int64_t x = 0, y = 0;
      if (rt_int(a, &x) && rt_int(b, &y)) return x < y;
      return rt_double(a) < rt_double(b);
    }
    if (a.is_str() && b.is_str()) return a.str() < b.str();
    if (a.is_json() && b.is_json() && a.j->is_array() && b.j->is_array()) {
      const size_t n = std::min(a.j->size(), b.j->size());
      for (size_t i = 0; i < n; ++i) {
        const RtValue x = rt_sub(a, &(*a.j)[i]), y = rt_sub(b, &(*b.j)[i]);
        if (!rt_eq(x, y)) return less(x, y, p, op);
      }
      return a.j->size() < b.j->size();
    }
    rt_fail(p, std::string("'") + op + "' not supported between instances of '" + rt_type_name(a) + "' and '" +
                   rt_type_name(b) + "'");
  }

  bool contains(const RtValue& container, const RtValue& item, SrcPos p) {
    if (container.is_undefined()) return false;
    if (container.k != RtValue::K::Json)
      rt_fail(p, std::string("argument of type '") + rt_type_name(container) + "' is not iterable");
    const ojson& c = *container.j;
    if (c.is_string()) {
      if (!item.is_str()) {
        if (item.is_undefined()) fail_undefined(item, p);
        rt_fail(p, std::string("'in <string>' requires string as left operand, not ") + rt_type_name(item));
      }
      return c.get_ref<const std::string&>().find(item.str()) != std::string::npos;
    }
    if (c.is_array()) {
      for (const auto& e : c)
        if (rt_eq(rt_sub(container, &e), item)) return true;
      return false;
    }
    if (c.is_object()) return item.is_str() && c.contains(item.str());
    rt_fail(p, std::string("argument of type '") + rt_type_name(container) + "' is not iterable");
  }

  bool compare(const std::string& op, const RtValue& a, const RtValue& b, SrcPos p) {
    if (op == "==") return rt_eq(a, b);
    if (op == "!=") return !rt_eq(a, b);
    if (op == "<") return less(a, b, p, "<");
    if (op == ">") return less(b, a, p, ">");
    if (op == "<=") return !less(b, a, p, "<=");
    if (op == ">=") return !less(a, b, p, ">=");
    if (op == "in") return contains(b, a, p);
    return !contains(b, a, p);  // notin
  }

  // ---- expressions ----

  RtValue lookup(const std::string& name, RtFrame& f) {
    if (RtValue* v = f.find(name)) return *v;
    if (ctx_owner_->is_object()) {
      auto it = ctx_owner_->find(name);
      if (it != ctx_owner_->end()) {
        RtValue r;
        r.k = RtValue::K::Json;
        r.owner = ctx_owner_;
        r.j = &*it;
        return r;
      }
    }
    RtValue b;
    b.k = RtValue::K::Builtin;
    if (name == "raise_exception") return b.fn = RtBuiltin::RaiseException, b;
    if (name == "namespace") return b.fn = RtBuiltin::Namespace, b;
    if (name == "strftime_now") return b.fn = RtBuiltin::StrftimeNow, b;
    if (name == "range") return b.fn = RtBuiltin::Range, b;
    if (name == "dict") return b.fn = RtBuiltin::Dict, b;
    return rt_undef("'" + name + "' is undefined");
  }

  RtArgs eval_args(const Expr& e, size_t from, RtFrame& f) {
    RtArgs a;
    for (size_t i = from; i < e.args.size(); ++i) a.pos.push_back(eval(*e.args[i], f));
    for (const auto& [k, v] : e.kwargs) a.kw.emplace_back(k, eval(*v, f));
    return a;
  }

  struct RtNest {
    RtNest(Renderer& r, SrcPos p) : r_(r) {
      if (++r_.nest_ > kRtMaxRecursion)
        rt_fail(p, "the template nests too deeply while rendering (recursive macros?)");
    }
    ~RtNest() { --r_.nest_; }
    Renderer& r_;
  };

  RtValue eval(const Expr& e, RtFrame& f) {
    RtNest nest(*this, e.pos);
    switch (e.kind) {
      case ExprKind::Const: return rt_json(e.constant);
      case ExprKind::Name: return lookup(e.str, f);
      case ExprKind::List:
      case ExprKind::Tuple: {
        ojson arr = ojson::array();
        for (const auto& a : e.args) arr.push_back(to_json(eval(*a, f), a->pos));
        return rt_json(std::move(arr));
      }
      case ExprKind::Dict: {
        ojson obj = ojson::object();
        for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
          const RtValue k = eval(*e.args[i], f);
          if (!k.is_str()) rt_unsupported(e.args[i]->pos, "dict keys other than strings are not supported");
          obj[k.str()] = to_json(eval(*e.args[i + 1], f), e.args[i + 1]->pos);
        }
        return rt_json(std::move(obj));
      }
      case ExprKind::GetAttr: return get_attr(eval(*e.args[0], f), e.str, e.pos);
      case ExprKind::GetItem: {
        const RtValue obj = eval(*e.args[0], f);
        return get_item(obj, eval(*e.args[1], f), e.pos);
      }
      case ExprKind::Slice: {
        const RtValue obj = eval(*e.args[0], f);
        RtValue v[3];
        const RtValue* pv[3] = {nullptr, nullptr, nullptr};
        for (int i = 0; i < 3; ++i)
          if (e.args[static_cast<size_t>(i) + 1]) {
            v[i] = eval(*e.args[static_cast<size_t>(i) + 1], f);
            pv[i] = &v[i];
          }
        return slice(obj, pv[0], pv[1], pv[2], e.pos);
      }
      case ExprKind::Call: return eval_call(e, f);
      case ExprKind::Filter: {
        const RtValue in = eval(*e.args[0], f);
        return apply_filter(e.str, in, eval_args(e, 1, f), e.pos);
      }
      case ExprKind::Test: {
        const RtValue in = eval(*e.args[0], f);
        const bool r = apply_test(e.str, in, eval_args(e, 1, f), e.pos);
        return rt_json(r != e.negated);
      }
      case ExprKind::Not: return rt_json(!rt_truthy(eval(*e.args[0], f)));
      case ExprKind::Neg:
      case ExprKind::Pos: {
        const RtValue v = eval(*e.args[0], f);
        if (v.is_undefined()) fail_undefined(v, e.pos);
        if (!rt_number(v)) rt_fail(e.pos, std::string("bad operand type for unary ") + (e.kind == ExprKind::Neg ? "-" : "+") + ": '" + rt_type_name(v) + "'");
        int64_t x = 0;
        if (rt_int(v, &x)) {
          if (e.kind == ExprKind::Pos) return rt_json(x);
          if (x == INT64_MIN) rt_unsupported(e.pos, "integers beyond 64 bits are not supported");
          return rt_json(-x);
        }
        return rt_json(e.kind == ExprKind::Neg ? -rt_double(v) : rt_double(v));
      }
      case ExprKind::Binary: {
        if (e.str == "and" || e.str == "or") {
          RtValue l = eval(*e.args[0], f);
          if (rt_truthy(l) == (e.str == "or")) return l;
          return eval(*e.args[1], f);
        }
        const RtValue l = eval(*e.args[0], f);
        const RtValue r = eval(*e.args[1], f);
        return arith(e.str, l, r, e.pos);
      }
      case ExprKind::Compare: {
        RtValue l = eval(*e.args[0], f);
        for (size_t i = 0; i < e.ops.size(); ++i) {
          RtValue r = eval(*e.args[i + 1], f);
          if (!compare(e.ops[i], l, r, e.pos)) return rt_json(false);
          l = std::move(r);
        }
        return rt_json(true);
      }
      case ExprKind::CondExpr: {
        if (rt_truthy(eval(*e.args[1], f))) return eval(*e.args[0], f);
        if (e.args[2]) return eval(*e.args[2], f);
        return rt_undef("the inline if-expression on line " + std::to_string(e.pos.line) +
                        " evaluated to false and no else section was defined");
      }
    }
    rt_fail(e.pos, "unknown expression");
  }

  // ---- calls ----

  // Binds `a` to parameters (positionally, then by name); a missing one is null.
  std::vector<const RtValue*> bind(const RtArgs& a, std::initializer_list<const char*> params, const std::string& what,
                                   SrcPos p) {
    std::vector<const RtValue*> out(params.size(), nullptr);
    if (a.pos.size() > params.size())
      rt_fail(p, what + " takes at most " + std::to_string(params.size()) + " arguments (" +
                     std::to_string(a.pos.size()) + " given)");
    for (size_t i = 0; i < a.pos.size(); ++i) out[i] = &a.pos[i];
    for (const auto& [k, v] : a.kw) {
      size_t i = 0;
      for (const char* name : params) {
        if (k == name) break;
        ++i;
      }
      if (i == params.size()) rt_fail(p, what + " got an unexpected keyword argument '" + k + "'");
      if (out[i]) rt_fail(p, what + " got multiple values for argument '" + k + "'");
      out[i] = &v;
    }
    return out;
  }

  std::string str_arg(const RtValue* v, const std::string& what, SrcPos p) {
    if (!v || !v->is_str()) rt_fail(p, what + " must be a string, not " + (v ? rt_type_name(*v) : "nothing"));
    return v->str();
  }

  int64_t int_arg(const RtValue* v, int64_t dflt, const std::string& what, SrcPos p) {
    if (!v || (v->is_json() && v->j->is_null())) return dflt;
    int64_t x = 0;
    if (!rt_int(*v, &x)) rt_fail(p, what + " must be an integer, not " + rt_type_name(*v));
    return x;
  }

  RtValue eval_call(const Expr& e, RtFrame& f) {
    const Expr& callee = *e.args[0];
    if (callee.kind == ExprKind::GetAttr) {
      const RtValue self = eval(*callee.args[0], f);
      const RtValue m = get_attr(self, callee.str, callee.pos);
      if (m.k == RtValue::K::Method) {
        const auto& mo = static_cast<RtMethod&>(*m.obj);
        return call_method(mo.self, mo.name, eval_args(e, 1, f), e.pos);
      }
      if (m.is_undefined()) fail_undefined(m, e.pos);
      return call_value(m, eval_args(e, 1, f), e.pos);
    }
    const RtValue fn = eval(callee, f);
    return call_value(fn, eval_args(e, 1, f), e.pos);
  }

  RtValue call_value(const RtValue& fn, RtArgs a, SrcPos p) {
    if (fn.k == RtValue::K::Macro) return call_macro(*fn.macro, std::move(a), p);
    if (fn.k == RtValue::K::Builtin) return call_builtin(fn.fn, a, p);
    if (fn.k == RtValue::K::Method) {
      const auto& mo = static_cast<RtMethod&>(*fn.obj);
      return call_method(mo.self, mo.name, a, p);
    }
    if (fn.is_undefined()) fail_undefined(fn, p);
    rt_fail(p, std::string("'") + rt_type_name(fn) + "' object is not callable");
  }

  RtValue call_macro(const Node& m, RtArgs a, SrcPos p) {
    tick(p);
    if (depth_ >= opt_.max_call_depth)
      rt_fail(p, "macro calls nest deeper than " + std::to_string(opt_.max_call_depth) + " (ChatTemplateOptions::max_call_depth)");
    const size_t np = m.targets.size(), nd = m.defaults.size();
    if (a.pos.size() > np)
      rt_fail(p, "macro '" + m.text + "' takes not more than " + std::to_string(np) + " argument(s)");
    RtFrame frame;
    frame.parent = top_;
    for (const auto& [k, v] : a.kw)
      if (std::find(m.targets.begin(), m.targets.end(), k) == m.targets.end())
        rt_fail(p, "macro '" + m.text + "' takes no keyword argument '" + k + "'");
    ++depth_;
    for (size_t i = 0; i < np; ++i) {
      const std::string& name = m.targets[i];
      RtValue v;
      bool have = false;
      if (i < a.pos.size()) {
        v = a.pos[i];
        have = true;
      }
      for (const auto& [k, kv] : a.kw)
        if (k == name) {
          if (have) rt_fail(p, "macro '" + m.text + "' got multiple values for argument '" + name + "'");
          v = kv;
          have = true;
        }
      if (!have) {
        if (i >= np - nd) v = eval(*m.defaults[i - (np - nd)], frame);
        else v = rt_undef("parameter '" + name + "' was not provided");
      }
      frame.set(name, std::move(v));
    }
    std::string buf;
    std::string* saved = out_;
    out_ = &buf;
    try {
      exec_body(m.body, frame);
    } catch (...) {
      out_ = saved;
      --depth_;
      throw;
    }
    out_ = saved;
    --depth_;
    return rt_json(ojson(std::move(buf)));
  }

  RtValue call_builtin(RtBuiltin fn, const RtArgs& a, SrcPos p) {
    switch (fn) {
      case RtBuiltin::RaiseException: {
        const auto b = bind(a, {"message"}, "raise_exception()", p);
        // NOTE: the template's own message, exactly (transformers raises TemplateError(message)).
        throw Error(Status::InvalidArgument, b[0] ? to_str(*b[0], p) : std::string());
      }
      case RtBuiltin::Namespace: {
        auto ns = std::make_shared<RtNamespace>();
        if (a.pos.size() > 1) rt_fail(p, "namespace() takes at most one positional argument");
        if (!a.pos.empty()) {
          const RtValue& d = a.pos[0];
          if (!d.is_json() || !d.j->is_object()) rt_fail(p, "namespace() needs a dict as its positional argument");
          for (const auto& [k, v] : d.j->items()) ns->attrs.emplace_back(k, rt_sub(d, &v));
        }
        for (const auto& [k, v] : a.kw) {
          if (RtValue* have = ns->find(k)) *have = v;
          else ns->attrs.emplace_back(k, v);
        }
        RtValue r;
        r.k = RtValue::K::Namespace;
        r.obj = std::move(ns);
        return r;
      }
      case RtBuiltin::StrftimeNow: {
        const auto b = bind(a, {"format"}, "strftime_now()", p);
        const std::string fmt = str_arg(b[0], "strftime_now()'s format", p);
        if (fmt.size() > 256 || fmt.find('\0') != std::string::npos) rt_fail(p, "strftime_now(): format too long");
        std::tm tm{};
        if (opt_.fixed_time) {
          const auto t = static_cast<std::time_t>(*opt_.fixed_time);
          gmtime_r(&t, &tm);
        } else {
          const std::time_t t = std::time(nullptr);
          localtime_r(&t, &tm);
        }
        if (fmt.empty()) return rt_json(ojson(""));
        char buf[2048];
        const size_t n = std::strftime(buf, sizeof buf, fmt.c_str(), &tm);
        if (n == 0) rt_fail(p, "strftime_now(): the format gives an empty or too long date");
        return rt_json(ojson(std::string(buf, n)));
      }
      case RtBuiltin::Range: {
        if (!a.kw.empty() || a.pos.empty() || a.pos.size() > 3) rt_fail(p, "range() takes 1 to 3 integer arguments");
        int64_t v[3] = {0, 0, 1};
        for (size_t i = 0; i < a.pos.size(); ++i)
          if (!rt_int(a.pos[i], &v[i])) rt_fail(p, "range() takes integers");
        int64_t start = 0, stop = v[0], step = 1;
        if (a.pos.size() >= 2) start = v[0], stop = v[1];
        if (a.pos.size() == 3) step = v[2];
        if (step == 0) rt_fail(p, "range() step must not be zero");
        ojson arr = ojson::array();
        for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
          if (static_cast<int64_t>(arr.size()) >= kRtMaxRange) rt_fail(p, "range() of more than 1000000 numbers");
          arr.push_back(i);
          if ((step > 0 && i > INT64_MAX - step) || (step < 0 && i < INT64_MIN - step)) break;
        }
        tick(p, static_cast<int64_t>(arr.size() / 16));
        return rt_json(std::move(arr));
      }
      case RtBuiltin::Dict: {
        if (!a.pos.empty()) rt_fail(p, "dict() takes keyword arguments only");
        ojson obj = ojson::object();
        for (const auto& [k, v] : a.kw) obj[k] = to_json(v, p);
        return rt_json(std::move(obj));
      }
    }
    rt_fail(p, "unknown function");
  }

  RtValue strings_value(const std::vector<std::string>& parts, SrcPos p) {
    ojson arr = ojson::array();
    size_t bytes = 0;
    for (const auto& s : parts) {
      bytes += s.size();
      arr.push_back(s);
    }
    check_size(p, bytes);
    return rt_json(std::move(arr));
  }

  RtValue call_method(const RtValue& self, const std::string& name, const RtArgs& a, SrcPos p) {
    const std::string what = name + "()";
    if (self.k == RtValue::K::Loop && name == "cycle") {
      if (a.pos.empty()) rt_fail(p, "loop.cycle() needs at least one argument");
      const auto& l = static_cast<RtLoop&>(*self.obj);
      return a.pos[l.index0 % a.pos.size()];
    }
    if (self.is_json() && self.j->is_object()) {
      const ojson& d = *self.j;
      if (name == "get") {
        const auto b = bind(a, {"key", "default"}, what, p);
        if (!b[0]) rt_fail(p, "get() needs a key");
        if (b[0]->is_str()) {
          auto it = d.find(b[0]->str());
          if (it != d.end()) return rt_sub(self, &*it);
        }
        return b[1] ? *b[1] : rt_json(nullptr);
      }
      bind(a, {}, what, p);
      ojson arr = ojson::array();
      for (const auto& [k, v] : d.items()) {
        if (name == "keys") arr.push_back(k);
        else if (name == "values") arr.push_back(v);
        else arr.push_back(ojson::array({k, v}));
      }
      return rt_json(std::move(arr));
    }
    if (!self.is_str()) rt_fail(p, std::string("'") + rt_type_name(self) + "' object has no method '" + name + "'");
    const std::string& s = self.str();
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
      const auto b = bind(a, {"chars"}, what, p);
      const bool none = !b[0] || (b[0]->is_json() && b[0]->j->is_null());
      std::string chars;
      if (!none) chars = str_arg(b[0], what + "'s chars", p);
      return make_str(p, rt_strip(s, none ? nullptr : &chars, name != "rstrip", name != "lstrip"));
    }
    if (name == "split" || name == "rsplit") {
      const auto b = bind(a, {"sep", "maxsplit"}, what, p);
      const int64_t maxsplit = int_arg(b[1], -1, what + "'s maxsplit", p);
      if (!b[0] || (b[0]->is_json() && b[0]->j->is_null()))
        return strings_value(name == "split" ? rt_split_ws(s, maxsplit) : rt_rsplit_ws(s, maxsplit), p);
      const std::string sep = str_arg(b[0], what + "'s separator", p);
      if (sep.empty()) rt_fail(p, "empty separator");
      return strings_value(name == "split" ? rt_split_sep(s, sep, maxsplit) : rt_rsplit_sep(s, sep, maxsplit), p);
    }
    if (name == "splitlines") {
      const auto b = bind(a, {"keepends"}, what, p);
      return strings_value(rt_splitlines(s, b[0] && rt_truthy(*b[0])), p);
    }
    if (name == "startswith" || name == "endswith") {
      const auto b = bind(a, {"prefix"}, what, p);
      if (!b[0]) rt_fail(p, what + " needs an argument");
      std::vector<std::string> cands;
      if (b[0]->is_json() && b[0]->j->is_array()) {
        for (const auto& e : *b[0]->j) {
          if (!e.is_string()) rt_fail(p, what + " needs strings");
          cands.push_back(e.get<std::string>());
        }
      } else {
        cands.push_back(str_arg(b[0], what + "'s argument", p));
      }
      for (const auto& c : cands) {
        if (c.size() > s.size()) continue;
        if (name == "startswith" ? s.compare(0, c.size(), c) == 0 : s.compare(s.size() - c.size(), c.size(), c) == 0)
          return rt_json(true);
      }
      return rt_json(false);
    }
    if (name == "upper" || name == "lower") {
      bind(a, {}, what, p);
      return make_str(p, rt_map_case(s, name == "upper"));
    }
    if (name == "title") {
      bind(a, {}, what, p);
      return make_str(p, rt_str_title(s));
    }
    if (name == "capitalize") {
      bind(a, {}, what, p);
      return make_str(p, rt_capitalize(s));
    }
    if (name == "replace") {
      const auto b = bind(a, {"old", "new", "count"}, what, p);
      const std::string r = rt_replace(s, str_arg(b[0], what + "'s old", p), str_arg(b[1], what + "'s new", p),
                                       int_arg(b[2], -1, what + "'s count", p));
      return make_str(p, r);
    }
    if (name == "find" || name == "rfind" || name == "count") {
      const auto b = bind(a, {"sub"}, what, p);
      const std::string sub = str_arg(b[0], what + "'s argument", p);
      if (name == "count") {
        if (sub.empty()) return rt_json(static_cast<int64_t>(rt_len_cps(s) + 1));
        int64_t n = 0;
        for (size_t at = s.find(sub); at != std::string::npos; at = s.find(sub, at + sub.size())) ++n;
        return rt_json(n);
      }
      const size_t at = name == "find" ? s.find(sub) : s.rfind(sub);
      if (at == std::string::npos) return rt_json(-1);
      return rt_json(static_cast<int64_t>(rt_len_cps(s.substr(0, at))));
    }
    if (name == "join") {
      const auto b = bind(a, {"iterable"}, what, p);
      if (!b[0]) rt_fail(p, "join() needs an argument");
      std::string out;
      bool first = true;
      for (const RtValue& v : iterate(*b[0], p)) {
        if (!v.is_str()) rt_fail(p, std::string("sequence item: expected str instance, ") + rt_type_name(v) + " found");
        if (!first) out += s;
        first = false;
        out += v.str();
        check_size(p, out.size());
      }
      return make_str(p, std::move(out));
    }
    rt_fail(p, std::string("'str' object has no method '") + name + "'");
  }

  // ---- filters ----

  // An attribute path of selectattr/map/join/sort ("a.b", "0"): environment.getitem per part.
  RtValue attr_path(const RtValue& item, const std::string& path, SrcPos p) {
    RtValue v = item;
    size_t from = 0;
    for (;;) {
      const size_t dot = path.find('.', from);
      const std::string part = path.substr(from, dot == std::string::npos ? std::string::npos : dot - from);
      int64_t idx = 0;
      const auto res = std::from_chars(part.data(), part.data() + part.size(), idx);
      RtValue key = res.ec == std::errc() && res.ptr == part.data() + part.size() ? rt_json(idx) : rt_json(ojson(part));
      v = get_item(v, key, p);
      if (dot == std::string::npos) return v;
      from = dot + 1;
    }
  }

  RtValue apply_filter(const std::string& name, const RtValue& in, const RtArgs& a, SrcPos p) {
    const std::string what = "the filter '" + name + "'";
    if (name == "length" || name == "count") {
      bind(a, {}, what, p);
      return rt_json(static_cast<int64_t>(length(in, p)));
    }
    if (name == "string" || name == "safe") {
      bind(a, {}, what, p);
      return make_str(p, to_str(in, p));
    }
    if (name == "trim") {
      const auto b = bind(a, {"chars"}, what, p);
      const bool none = !b[0] || (b[0]->is_json() && b[0]->j->is_null());
      std::string chars;
      if (!none) chars = str_arg(b[0], "trim's chars", p);
      return make_str(p, rt_strip(to_str(in, p), none ? nullptr : &chars, true, true));
    }
    if (name == "upper" || name == "lower") {
      bind(a, {}, what, p);
      return make_str(p, rt_map_case(to_str(in, p), name == "upper"));
    }
    if (name == "capitalize") {
      bind(a, {}, what, p);
      return make_str(p, rt_capitalize(to_str(in, p)));
    }
    if (name == "title") {
      bind(a, {}, what, p);
      return make_str(p, rt_jinja_title(to_str(in, p)));
    }
    if (name == "default" || name == "d") {
      const auto b = bind(a, {"default_value", "boolean"}, what, p);
      const bool boolean = b[1] && rt_truthy(*b[1]);
      if (in.is_undefined() || (boolean && !rt_truthy(in))) return b[0] ? *b[0] : rt_json(ojson(""));
      return in;
    }
    if (name == "tojson") return tojson(in, a, p);
    if (name == "int") {
      const auto b = bind(a, {"default", "base"}, what, p);
      return to_int(in, b[0] ? *b[0] : rt_json(0), int_arg(b[1], 10, "int's base", p), p);
    }
    if (name == "float") {
      const auto b = bind(a, {"default"}, what, p);
      return to_float(in, b[0] ? *b[0] : rt_json(0.0), p);
    }
    if (name == "abs") {
      bind(a, {}, what, p);
      if (!rt_number(in)) rt_fail(p, std::string("bad operand type for abs(): '") + rt_type_name(in) + "'");
      int64_t x = 0;
      if (rt_int(in, &x)) {
        if (x == INT64_MIN) rt_unsupported(p, "integers beyond 64 bits are not supported");
        return rt_json(x < 0 ? -x : x);
      }
      return rt_json(std::fabs(rt_double(in)));
    }
    if (name == "join") {
      const auto b = bind(a, {"d", "attribute"}, what, p);
      const std::string sep = b[0] ? to_str(*b[0], p) : std::string();
      std::string out;
      bool first = true;
      for (const RtValue& v : iterate(in, p)) {
        if (!first) out += sep;
        first = false;
        out += to_str(b[1] ? attr_path(v, to_str(*b[1], p), p) : v, p);
        check_size(p, out.size());
      }
      return make_str(p, std::move(out));
    }
    if (name == "first" || name == "last") {
      bind(a, {}, what, p);
      const auto items = iterate(in, p);
      if (items.empty()) return rt_undef("No " + name + " item, sequence was empty.");
      return name == "first" ? items.front() : items.back();
    }
    if (name == "list") {
      bind(a, {}, what, p);
      return list_value(iterate(in, p), p);
    }
    if (name == "reverse") {
      bind(a, {}, what, p);
      if (in.is_str()) {
        auto cps = rt_cps(in.str());
        std::reverse(cps.begin(), cps.end());
        return make_str(p, rt_from_cps(cps));
      }
      auto items = iterate(in, p);
      std::reverse(items.begin(), items.end());
      return list_value(items, p);
    }
    if (name == "items") {
      bind(a, {}, what, p);
      if (in.is_undefined()) return rt_json(ojson::array());
      if (!in.is_json() || !in.j->is_object()) rt_fail(p, std::string("can only get item pairs from a mapping, not ") + rt_type_name(in));
      ojson arr = ojson::array();
      for (const auto& [k, v] : in.j->items()) arr.push_back(ojson::array({k, v}));
      return rt_json(std::move(arr));
    }
    if (name == "replace") {
      const auto b = bind(a, {"old", "new", "count"}, what, p);
      return make_str(p, rt_replace(to_str(in, p), b[0] ? to_str(*b[0], p) : "", b[1] ? to_str(*b[1], p) : "",
                                    int_arg(b[2], -1, "replace's count", p)));
    }
    if (name == "escape" || name == "e") {
      bind(a, {}, what, p);
      std::string out;
      for (char c : to_str(in, p)) {
        switch (c) {
          case '&': out += "&amp;"; break;
          case '<': out += "&lt;"; break;
          case '>': out += "&gt;"; break;
          case '"': out += "&#34;"; break;
          case '\'': out += "&#39;"; break;
          default: out += c;
        }
      }
      return make_str(p, std::move(out));
    }
    if (name == "indent") return indent(in, a, p);
    if (name == "map") {
      std::vector<RtValue> out;
      const RtValue* attribute = nullptr;
      const RtValue* dflt = nullptr;
      for (const auto& [k, v] : a.kw) {
        if (k == "attribute") attribute = &v;
        else if (k == "default") dflt = &v;
        else if (attribute == nullptr) rt_fail(p, "map got an unexpected keyword argument '" + k + "'");
      }
      const auto items = iterate(in, p);
      if (attribute) {
        if (!a.pos.empty()) rt_fail(p, "map(attribute=...) takes no positional arguments");
        for (const RtValue& v : items) {
          RtValue r = attr_path(v, to_str(*attribute, p), p);
          if (r.is_undefined() && dflt) r = *dflt;
          out.push_back(std::move(r));
        }
      } else {
        if (a.pos.empty()) rt_fail(p, "map() needs a filter name or attribute=");
        const std::string fname = str_arg(&a.pos[0], "map's filter", p);
        if (!filter_supported(fname) || fname == "map")
          rt_fail(p, "map(): the filter '" + fname + "' is not supported");
        RtArgs sub;
        sub.pos.assign(a.pos.begin() + 1, a.pos.end());
        sub.kw = a.kw;
        for (const RtValue& v : items) out.push_back(apply_filter(fname, v, sub, p));
      }
      return list_value(out, p);
    }
    if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
      const bool attr = name == "selectattr" || name == "rejectattr";
      const bool keep_if = name == "select" || name == "selectattr";
      if (!a.kw.empty()) rt_fail(p, what + " takes no keyword arguments");
      size_t k = 0;
      std::string path;
      if (attr) {
        if (a.pos.empty()) rt_fail(p, what + " needs an attribute");
        path = to_str(a.pos[k++], p);
      }
      std::string test;
      if (k < a.pos.size()) test = str_arg(&a.pos[k++], what + "'s test", p);
      if (!test.empty() && !test_supported(test)) rt_fail(p, what + ": the test '" + test + "' is not supported");
      RtArgs targs;
      targs.pos.assign(a.pos.begin() + static_cast<std::ptrdiff_t>(k), a.pos.end());
      std::vector<RtValue> out;
      for (const RtValue& v : iterate(in, p)) {
        const RtValue x = attr ? attr_path(v, path, p) : v;
        const bool ok = test.empty() ? rt_truthy(x) : apply_test(test, x, targs, p);
        if (ok == keep_if) out.push_back(v);
      }
      return list_value(out, p);
    }
    if (name == "sort") {
      const auto b = bind(a, {"reverse", "case_sensitive", "attribute"}, what, p);
      const bool rev = b[0] && rt_truthy(*b[0]);
      const bool cs = b[1] && rt_truthy(*b[1]);
      auto items = iterate(in, p);
      std::vector<std::pair<RtValue, RtValue>> keyed;
      for (auto& v : items) {
        RtValue key = b[2] ? attr_path(v, to_str(*b[2], p), p) : v;
        if (!cs && key.is_str()) key = rt_json(ojson(rt_map_case(key.str(), false)));
        keyed.emplace_back(std::move(key), std::move(v));
      }
      std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& x, const auto& y) {
        return rev ? less(y.first, x.first, p, "<") : less(x.first, y.first, p, "<");
      });
      std::vector<RtValue> out;
      for (auto& kv : keyed) out.push_back(std::move(kv.second));
      return list_value(out, p);
    }
    rt_fail(p, "the filter '" + name + "' is not supported");
  }

  RtValue tojson(const RtValue& in, const RtArgs& a, SrcPos p) {
    // transformers' tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)
    const auto b = bind(a, {"ensure_ascii", "indent", "separators", "sort_keys"}, "the filter 'tojson'", p);
    if (in.is_undefined()) rt_fail(p, "Object of type Undefined is not JSON serializable");
    if (!in.is_json()) rt_fail(p, std::string("Object of type ") + rt_type_name(in) + " is not JSON serializable");
    RtJsonStyle st;
    st.ensure_ascii = b[0] && rt_truthy(*b[0]);
    if (b[1] && !(b[1]->is_json() && b[1]->j->is_null())) {
      st.indent = true;
      st.item_sep = ",";
      int64_t n = 0;
      if (b[1]->is_str()) st.indent_unit = b[1]->str();
      else if (rt_int(*b[1], &n)) st.indent_unit = std::string(static_cast<size_t>(std::clamp<int64_t>(n, 0, 64)), ' ');
      else rt_fail(p, "tojson's indent must be an integer or a string");
    }
    if (b[2] && !(b[2]->is_json() && b[2]->j->is_null())) {
      const RtValue& s = *b[2];
      if (!s.is_json() || !s.j->is_array() || s.j->size() != 2 || !(*s.j)[0].is_string() || !(*s.j)[1].is_string())
        rt_fail(p, "tojson's separators must be two strings");
      st.item_sep = (*s.j)[0].get<std::string>();
      st.key_sep = (*s.j)[1].get<std::string>();
    }
    st.sort_keys = b[3] && rt_truthy(*b[3]);
    std::string out;
    rt_dump_into(*in.j, st, 0, out);
    return make_str(p, std::move(out));
  }

  // Python's int(str, base) for jinja's int filter: sign, digits with single
  // underscores, surrounding whitespace, a 0b/0o/0x prefix matching the base.
  static bool parse_py_int(std::string s, int64_t base, int64_t* out) {
    s = rt_strip(s, nullptr, true, true);
    bool neg = false;
    size_t i = 0;
    if (i < s.size() && (s[i] == '+' || s[i] == '-')) neg = s[i++] == '-';
    if (i + 1 < s.size() && s[i] == '0') {
      const char c = static_cast<char>(s[i + 1] | 0x20);
      const int64_t pb = c == 'x' ? 16 : c == 'o' ? 8 : c == 'b' ? 2 : 0;
      if (pb && (base == pb || base == 0)) {
        base = pb;
        i += 2;
        if (i < s.size() && s[i] == '_') ++i;
      }
    }
    if (base == 0) base = 10;
    if (base < 2 || base > 36 || i >= s.size()) return false;
    uint64_t v = 0;
    bool prev_digit = false;
    for (; i < s.size(); ++i) {
      const char c = s[i];
      if (c == '_') {
        if (!prev_digit || i + 1 >= s.size()) return false;
        prev_digit = false;
        continue;
      }
      int d = -1;
      if (c >= '0' && c <= '9') d = c - '0';
      else if ((c | 0x20) >= 'a' && (c | 0x20) <= 'z') d = (c | 0x20) - 'a' + 10;
      if (d < 0 || d >= base) return false;
      if (v > (static_cast<uint64_t>(INT64_MAX) - static_cast<uint64_t>(d)) / static_cast<uint64_t>(base)) return false;
      v = v * static_cast<uint64_t>(base) + static_cast<uint64_t>(d);
      prev_digit = true;
    }
    *out = neg ? -static_cast<int64_t>(v) : static_cast<int64_t>(v);
    return true;
  }

  static bool parse_py_float(const std::string& raw, double* out) {
    std::string s = rt_strip(raw, nullptr, true, true);
    std::string lower = rt_map_case(s, false);
    const bool neg = !lower.empty() && lower[0] == '-';
    const std::string body = !lower.empty() && (lower[0] == '-' || lower[0] == '+') ? lower.substr(1) : lower;
    if (body == "inf" || body == "infinity") return *out = neg ? -INFINITY : INFINITY, true;
    if (body == "nan") return *out = NAN, true;
    std::string clean;
    for (size_t i = 0; i < s.size(); ++i) {
      if (s[i] == '_') {
        if (i == 0 || i + 1 >= s.size() || !std::isdigit(static_cast<unsigned char>(s[i - 1])) ||
            !std::isdigit(static_cast<unsigned char>(s[i + 1])))
          return false;
        continue;
      }
      clean += s[i];
    }
    if (clean.empty()) return false;
    const char* b = clean.c_str();
    if (*b == '+') ++b;
    const auto res = std::from_chars(b, clean.c_str() + clean.size(), *out);
    if (res.ptr != clean.c_str() + clean.size()) return false;
    if (res.ec == std::errc::result_out_of_range) *out = clean.find_first_of("eE") != std::string::npos && clean.find("e-") == std::string::npos && clean.find("E-") == std::string::npos ? (clean[0] == '-' ? -INFINITY : INFINITY) : 0.0;
    return res.ec == std::errc() || res.ec == std::errc::result_out_of_range;
  }

  RtValue to_int(const RtValue& in, const RtValue& dflt, int64_t base, SrcPos p) {
    int64_t x = 0;
    if (rt_int(in, &x)) return rt_json(x);
    if (in.is_str()) {
      if (parse_py_int(in.str(), base, &x)) return rt_json(x);
      double d = 0;
      if (parse_py_float(in.str(), &d)) {
        if (std::isinf(d)) rt_fail(p, "cannot convert float infinity to integer");
        if (!std::isnan(d)) {
          if (std::fabs(d) >= 9.2e18) rt_unsupported(p, "integers beyond 64 bits are not supported");
          return rt_json(static_cast<int64_t>(d));
        }
      }
      return dflt;
    }
    if (in.is_json() && in.j->is_number_float()) {
      const double d = in.j->get<double>();
      if (std::isinf(d)) rt_fail(p, "cannot convert float infinity to integer");
      if (std::isnan(d)) return dflt;
      if (std::fabs(d) >= 9.2e18) rt_unsupported(p, "integers beyond 64 bits are not supported");
      return rt_json(static_cast<int64_t>(d));
    }
    return dflt;
  }

  RtValue to_float(const RtValue& in, const RtValue& dflt, SrcPos) {
    if (rt_number(in)) return rt_json(rt_double(in));
    double d = 0;
    if (in.is_str() && parse_py_float(in.str(), &d)) return rt_json(d);
    return dflt;
  }

  RtValue indent(const RtValue& in, const RtArgs& a, SrcPos p) {
    const auto b = bind(a, {"width", "first", "blank"}, "the filter 'indent'", p);
    std::string ind;
    if (b[0] && b[0]->is_str()) ind = b[0]->str();
    else ind = std::string(static_cast<size_t>(std::clamp<int64_t>(int_arg(b[0], 4, "indent's width", p), 0, 256)), ' ');
    const bool first = b[1] && rt_truthy(*b[1]);
    const bool blank = b[2] && rt_truthy(*b[2]);
    const auto lines = rt_splitlines(to_str(in, p) + "\n", false);
    std::string rv;
    if (blank) {
      for (size_t i = 0; i < lines.size(); ++i) {
        if (i) rv += "\n" + ind;
        rv += lines[i];
      }
    } else if (!lines.empty()) {
      rv = lines[0];
      for (size_t i = 1; i < lines.size(); ++i) rv += "\n" + (lines[i].empty() ? lines[i] : ind + lines[i]);
    }
    if (first) rv = ind + rv;
    return make_str(p, std::move(rv));
  }

  // ---- tests ----

  bool apply_test(const std::string& name, const RtValue& v, const RtArgs& a, SrcPos p) {
    const bool json = v.is_json();
    const ojson* j = v.j;
    auto arg = [&](const char* what) -> const RtValue& {
      if (a.pos.size() != 1 || !a.kw.empty()) rt_fail(p, std::string("the test '") + name + "' takes one " + what);
      return a.pos[0];
    };
    auto no_args = [&] {
      if (!a.pos.empty() || !a.kw.empty()) rt_fail(p, "the test '" + name + "' takes no arguments");
    };
    if (name == "defined") return no_args(), !v.is_undefined();
    if (name == "undefined") return no_args(), v.is_undefined();
    if (name == "none") return no_args(), json && j->is_null();
    if (name == "boolean") return no_args(), json && j->is_boolean();
    if (name == "true") return no_args(), json && j->is_boolean() && j->get<bool>();
    if (name == "false") return no_args(), json && j->is_boolean() && !j->get<bool>();
    if (name == "string") return no_args(), v.is_str();
    if (name == "mapping") return no_args(), json && j->is_object();
    if (name == "number") return no_args(), rt_number(v);
    if (name == "integer") return no_args(), json && j->is_number_integer();
    if (name == "float") return no_args(), json && j->is_number_float();
    if (name == "iterable") return no_args(), v.is_undefined() || (json && (j->is_array() || j->is_object() || j->is_string()));
    if (name == "sequence") return no_args(), v.is_undefined() || (json && (j->is_array() || j->is_object() || j->is_string()));
    if (name == "callable") return no_args(), v.k == RtValue::K::Macro || v.k == RtValue::K::Builtin || v.k == RtValue::K::Method;
    if (name == "lower" || name == "upper") {
      no_args();
      const std::string s = to_str(v, p);
      bool cased = false;
      for (uint32_t c : rt_cps(s)) {
        if (!rt_cased(c)) continue;
        cased = true;
        if (name == "lower" ? rt_lower(c) != c : rt_upper(c) != c) return false;
      }
      return cased;
    }
    if (name == "even" || name == "odd") {
      no_args();
      int64_t x = 0;
      if (!rt_int(v, &x)) {
        if (v.is_undefined()) fail_undefined(v, p);
        rt_fail(p, std::string("the test '") + name + "' needs an integer, not " + rt_type_name(v));
      }
      return (x % 2 == 0) == (name == "even");
    }
    if (name == "divisibleby") {
      const RtValue& d = arg("number");
      int64_t x = 0, y = 0;
      if (!rt_int(v, &x) || !rt_int(d, &y)) rt_fail(p, "divisibleby needs integers");
      if (y == 0) rt_fail(p, "integer division or modulo by zero");
      return y == -1 || x % y == 0;
    }
    if (name == "eq" || name == "equalto" || name == "==") return rt_eq(v, arg("value"));
    if (name == "ne" || name == "!=") return !rt_eq(v, arg("value"));
    if (name == "lt" || name == "lessthan" || name == "<") return less(v, arg("value"), p, "<");
    if (name == "gt" || name == "greaterthan" || name == ">") return less(arg("value"), v, p, ">");
    if (name == "le" || name == "<=") return !less(arg("value"), v, p, "<=");
    if (name == "ge" || name == ">=") return !less(v, arg("value"), p, ">=");
    if (name == "in") return contains(arg("sequence"), v, p);
    if (name == "sameas") {
      const RtValue& o = arg("value");
      if (json && o.is_json() && (j->is_null() || j->is_boolean()) && j->type() == o.j->type()) return *j == *o.j;
      return v.k == o.k && v.k != RtValue::K::Json && rt_eq(v, o);
    }
    rt_fail(p, "the test '" + name + "' is not supported");
  }

  // ---- statements ----

  RtFlow exec_body(const std::vector<std::unique_ptr<Node>>& body, RtFrame& f) {
    for (const auto& n : body) {
      const RtFlow fl = exec(*n, f);
      if (fl != RtFlow::Normal) return fl;
    }
    return RtFlow::Normal;
  }

  void assign(RtFrame& f, const Node& n, const RtValue& v) {
    if (!n.unpack) {
      f.set(n.targets[0], v);
      return;
    }
    const auto items = iterate(v, n.pos);
    if (items.size() != n.targets.size())
      rt_fail(n.pos, "cannot unpack " + std::to_string(items.size()) + " values into " +
                         std::to_string(n.targets.size()) + " names");
    for (size_t i = 0; i < items.size(); ++i) f.set(n.targets[i], items[i]);
  }

  RtValue apply_filters(const std::vector<std::unique_ptr<Expr>>& filters, RtValue v, RtFrame& f) {
    for (const auto& fe : filters) v = apply_filter(fe->str, v, eval_args(*fe, 1, f), fe->pos);
    return v;
  }

  std::string capture(const std::vector<std::unique_ptr<Node>>& body, RtFrame& f, RtFlow* flow) {
    std::string buf;
    std::string* saved = out_;
    out_ = &buf;
    try {
      *flow = exec_body(body, f);
    } catch (...) {
      out_ = saved;
      throw;
    }
    out_ = saved;
    return buf;
  }

  RtFlow exec(const Node& n, RtFrame& f) {
    tick(n.pos);
    RtNest nest(*this, n.pos);
    switch (n.kind) {
      case NodeKind::Text: emit(n.pos, n.text); return RtFlow::Normal;
      case NodeKind::Print: emit(n.pos, to_str(eval(*n.expr, f), n.expr->pos)); return RtFlow::Normal;
      case NodeKind::If:
        return exec_body(rt_truthy(eval(*n.expr, f)) ? n.body : n.else_body, f);
      case NodeKind::For: return exec_for(n, f);
      case NodeKind::Set: {
        RtValue v = eval(*n.expr, f);
        if (n.attr.empty()) {
          assign(f, n, v);
          return RtFlow::Normal;
        }
        RtValue* ns = f.find(n.targets[0]);
        RtValue lookedup;
        if (!ns) {
          lookedup = lookup(n.targets[0], f);
          ns = &lookedup;
        }
        if (ns->k != RtValue::K::Namespace) rt_fail(n.pos, "cannot assign attribute on non-namespace object");
        auto& obj = static_cast<RtNamespace&>(*ns->obj);
        if (RtValue* have = obj.find(n.attr)) *have = std::move(v);
        else obj.attrs.emplace_back(n.attr, std::move(v));
        return RtFlow::Normal;
      }
      case NodeKind::SetBlock: {
        RtFlow flow = RtFlow::Normal;
        RtValue v = make_str(n.pos, capture(n.body, f, &flow));
        v = apply_filters(n.filters, std::move(v), f);
        if (n.attr.empty()) {
          f.set(n.targets[0], std::move(v));
        } else {
          RtValue ns = lookup(n.targets[0], f);
          if (ns.k != RtValue::K::Namespace) rt_fail(n.pos, "cannot assign attribute on non-namespace object");
          auto& obj = static_cast<RtNamespace&>(*ns.obj);
          if (RtValue* have = obj.find(n.attr)) *have = std::move(v);
          else obj.attrs.emplace_back(n.attr, std::move(v));
        }
        return flow;
      }
      case NodeKind::FilterBlock: {
        RtFlow flow = RtFlow::Normal;
        RtValue v = make_str(n.pos, capture(n.body, f, &flow));
        emit(n.pos, to_str(apply_filters(n.filters, std::move(v), f), n.pos));
        return flow;
      }
      case NodeKind::Macro: {
        RtValue m;
        m.k = RtValue::K::Macro;
        m.macro = &n;
        f.set(n.text, std::move(m));
        return RtFlow::Normal;
      }
      case NodeKind::Break: return RtFlow::Break;
      case NodeKind::Continue: return RtFlow::Continue;
      case NodeKind::Scope: return exec_body(n.body, f);
    }
    return RtFlow::Normal;
  }

  RtFlow exec_for(const Node& n, RtFrame& f) {
    auto items = iterate(eval(*n.expr, f), n.expr->pos);
    if (n.cond) {
      std::vector<RtValue> kept;
      for (auto& it : items) {
        RtFrame tmp;
        tmp.parent = &f;
        assign(tmp, n, it);
        tick(n.pos);
        if (rt_truthy(eval(*n.cond, tmp))) kept.push_back(std::move(it));
      }
      items = std::move(kept);
    }
    if (items.empty()) return exec_body(n.else_body, f);
    auto loop = std::make_shared<RtLoop>();
    loop->items = std::move(items);
    RtValue lv;
    lv.k = RtValue::K::Loop;
    lv.obj = loop;
    for (size_t i = 0; i < loop->items.size(); ++i) {
      loop->index0 = i;
      // NOTE: a fresh scope per iteration: jinja resets what the body set (its
      // values do not carry to the next iteration nor out of the loop).
      RtFrame it;
      it.parent = &f;
      it.set("loop", lv);
      assign(it, n, loop->items[i]);
      if (exec_body(n.body, it) == RtFlow::Break) break;
    }
    return RtFlow::Normal;
  }

  const Program& prog_;
  const ChatTemplateOptions& opt_;
  std::shared_ptr<const ojson> ctx_owner_;
  std::string* out_ = nullptr;
  RtFrame* top_ = nullptr;
  int64_t steps_ = 0;
  int depth_ = 0;
  int nest_ = 0;
};

}  // namespace

bool filter_supported(const std::string& name) {
  static const char* const k[] = {"abs",   "capitalize", "count", "d",     "default", "e",      "escape",
                                  "first", "float",      "indent", "int",  "items",   "join",   "last",
                                  "length", "list",      "lower",  "map",  "reject",  "rejectattr", "replace",
                                  "reverse", "safe",     "select", "selectattr", "sort", "string", "title",
                                  "tojson", "trim",      "upper"};
  for (const char* f : k)
    if (name == f) return true;
  return false;
}

bool test_supported(const std::string& name) {
  static const char* const k[] = {"boolean", "callable", "defined", "undefined", "divisibleby", "eq", "equalto",
                                  "==", "ne", "!=", "gt", "greaterthan", ">", "ge", ">=", "lt", "lessthan", "<",
                                  "le", "<=", "even", "odd", "false", "true", "float", "integer", "in", "iterable",
                                  "lower", "upper", "mapping", "none", "number", "sameas", "sequence", "string"};
  for (const char* t : k)
    if (name == t) return true;
  return false;
}

bool method_supported(const std::string& name) {
  static const char* const k[] = {"strip", "lstrip", "rstrip", "split", "rsplit", "splitlines", "startswith",
                                  "endswith", "upper", "lower", "title", "capitalize", "replace", "find", "rfind",
                                  "count", "join", "items", "keys", "values", "get", "cycle"};
  for (const char* m : k)
    if (name == m) return true;
  return false;
}

}  // namespace jinja

ChatTemplate::ChatTemplate(std::string source) : source_(std::move(source)), program_(jinja::parse_template(source_)) {}

std::string ChatTemplate::render(const nlohmann::ordered_json& context, const ChatTemplateOptions& options) const {
  jinja::Renderer r(*program_, context, options);
  return r.run();
}

std::string apply_chat_template(const ChatTemplate& tmpl, const nlohmann::ordered_json& messages,
                                bool add_generation_prompt, const std::string& bos_token,
                                const std::string& eos_token, const nlohmann::ordered_json& extra,
                                const ChatTemplateOptions& options) {
  if (!extra.is_null() && !extra.is_object())
    throw Error(Status::InvalidArgument, "apply_chat_template: the extra context is not an object");
  nlohmann::ordered_json ctx = nlohmann::ordered_json::object();
  ctx["messages"] = messages;
  ctx["tools"] = nullptr;
  ctx["documents"] = nullptr;
  ctx["add_generation_prompt"] = add_generation_prompt;
  if (!bos_token.empty()) ctx["bos_token"] = bos_token;
  if (!eos_token.empty()) ctx["eos_token"] = eos_token;
  if (extra.is_object())
    for (const auto& [k, v] : extra.items()) ctx[k] = v;
  return tmpl.render(ctx, options);
}

}  // namespace colibri
