// chat_template_impl.h: the parsed form of a chat template (model/chat_template.h),
// shared by the parser (chat_template.cpp) and the renderer (chat_template_render.cpp).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace colibri::jinja {

using ojson = nlohmann::ordered_json;

// Where a construct starts in the template source (1-based; the column counts
// characters).
struct SrcPos {
  int line = 0, col = 0;
};

enum class ExprKind : uint8_t {
  Const,     // constant
  Name,      // str
  List,      // args: items
  Tuple,     // args: items (a tuple is a list here)
  Dict,      // args: key0, value0, key1, value1, ...
  GetAttr,   // args[0].str
  GetItem,   // args[0][args[1]]
  Slice,     // args[0][args[1]:args[2]:args[3]] (null: omitted)
  Call,      // args[0](args[1..], kwargs)
  Filter,    // args[0] | str(args[1..], kwargs)
  Test,      // args[0] is [not] str(args[1..], kwargs)
  Not,       // not args[0]
  Neg,       // -args[0]
  Pos,       // +args[0]
  Binary,    // args[0] str args[1]; str: + - * / // % ** ~ and or
  Compare,   // args[0] ops[0] args[1] ops[1] args[2] ...; ops: == != < <= > >= in notin
  CondExpr,  // args[0] if args[1] else args[2] (args[2] null: undefined)
};

struct Expr {
  ExprKind kind = ExprKind::Const;
  SrcPos pos;
  std::string str;
  ojson constant;
  bool negated = false;  // Test: `is not`
  int height = 1;        // of this subtree (bounded by the parser)
  std::vector<std::unique_ptr<Expr>> args;
  std::vector<std::pair<std::string, std::unique_ptr<Expr>>> kwargs;
  std::vector<std::string> ops;  // Compare
};

enum class NodeKind : uint8_t {
  Text,      // text
  Print,     // expr
  If,        // expr; body; else_body (an elif is an If alone in else_body)
  For,       // targets in expr [if cond]; body; else_body
  Set,       // targets = expr; attr non-empty: targets[0].attr = expr
  SetBlock,  // targets[0] = body rendered, then filters
  Macro,     // name; params with defaults; body
  FilterBlock,  // body rendered, then filters
  Break,
  Continue,
  Scope,     // body ({% generation %}, transparent)
};

struct Node {
  NodeKind kind = NodeKind::Text;
  SrcPos pos;
  std::string text;                 // Text: the data; Macro: the name
  std::string attr;                 // Set of a namespace attribute
  std::unique_ptr<Expr> expr;       // Print/If/For(iterable)/Set value
  std::unique_ptr<Expr> cond;       // For: the `if` filter
  std::vector<std::string> targets;  // For/Set names; Macro parameters
  bool unpack = false;              // For/Set: the target is a tuple
  std::vector<std::unique_ptr<Expr>> defaults;  // Macro: defaults of the last parameters
  std::vector<std::unique_ptr<Expr>> filters;   // SetBlock/FilterBlock: Filter exprs, args[0] null
  std::vector<std::unique_ptr<Node>> body, else_body;
};

struct Program {
  std::vector<std::unique_ptr<Node>> body;
};

// Parses a template. Throws Error(Format) or Error(Unsupported) with line:column.
std::unique_ptr<Program> parse_template(const std::string& source);

// UTF-8 helpers shared by the parser and the renderer. An invalid byte b decodes
// (one byte) as the lone surrogate U+DC00 + b and encodes back to the byte, as
// Python's "surrogateescape" does: nothing is lost, and it is never a space.
inline size_t utf8_decode(const std::string& s, size_t i, uint32_t* cp) {
  const auto b = static_cast<unsigned char>(s[i]);
  auto cont = [&](size_t k) { return i + k < s.size() && (static_cast<unsigned char>(s[i + k]) & 0xC0) == 0x80; };
  if (b < 0x80) {
    *cp = b;
    return 1;
  }
  if ((b & 0xE0) == 0xC0 && b >= 0xC2 && cont(1)) {
    *cp = ((b & 0x1Fu) << 6) | (static_cast<unsigned char>(s[i + 1]) & 0x3Fu);
    return 2;
  }
  if ((b & 0xF0) == 0xE0 && cont(1) && cont(2)) {
    *cp = ((b & 0x0Fu) << 12) | ((static_cast<unsigned char>(s[i + 1]) & 0x3Fu) << 6) |
          (static_cast<unsigned char>(s[i + 2]) & 0x3Fu);
    if (*cp >= 0x800 && (*cp < 0xD800 || *cp > 0xDFFF)) return 3;
  }
  if ((b & 0xF8) == 0xF0 && cont(1) && cont(2) && cont(3)) {
    *cp = ((b & 0x07u) << 18) | ((static_cast<unsigned char>(s[i + 1]) & 0x3Fu) << 12) |
          ((static_cast<unsigned char>(s[i + 2]) & 0x3Fu) << 6) | (static_cast<unsigned char>(s[i + 3]) & 0x3Fu);
    if (*cp >= 0x10000 && *cp <= 0x10FFFF) return 4;
  }
  *cp = 0xDC00u + b;
  return 1;
}

inline void utf8_append(std::string& out, uint32_t cp) {
  if (cp >= 0xDC80 && cp <= 0xDCFF) {
    out += static_cast<char>(cp - 0xDC00);  // an invalid byte, decoded by utf8_decode
  } else if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// Python's str.isspace() (and the regex \s of a str pattern).
inline bool py_isspace(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

// Bytes of the whitespace character at s[i], 0 if there is none.
inline size_t py_space_len(const std::string& s, size_t i) {
  if (i >= s.size()) return 0;
  uint32_t cp = 0;
  const size_t n = utf8_decode(s, i, &cp);
  return py_isspace(cp) ? n : 0;
}

// The filters, tests and methods the renderer implements (checked at parse time).
bool filter_supported(const std::string& name);
bool test_supported(const std::string& name);
bool method_supported(const std::string& name);

}  // namespace colibri::jinja
