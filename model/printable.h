// printable.h: strings that come from files (tensor names, config strings, a
// tokenizer's kind...) made safe to print on a terminal and to put in JSON.
// Header-only: model/colibri_file.cpp (and the fuzz build, which compiles it
// alone) uses it.
#pragma once
#include <cstddef>
#include <string>
#include <string_view>

namespace colibri {

// The length of the valid UTF-8 sequence at s[i] (1..4), or 0 when the bytes
// there are not one (a stray continuation byte, an overlong form, a surrogate,
// a code point past U+10FFFF, or a sequence cut short).
inline size_t utf8_sequence_length(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const unsigned char c = b(0);
  if (c < 0x80) return 1;
  size_t n = 0;
  unsigned lo = 0x80, hi = 0xBF;  // the range of the second byte
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    if (c == 0xE0) lo = 0xA0;  // no overlong forms
    if (c == 0xED) hi = 0x9F;  // no surrogates
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;  // <= U+10FFFF
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  if (b(1) < lo || b(1) > hi) return 0;
  for (size_t k = 2; k < n; ++k)
    if (b(k) < 0x80 || b(k) > 0xBF) return 0;
  return n;
}

// `s` with every byte a terminal or a JSON encoder could trip on written as
// the text \xNN: control characters (C0, DEL, and C1 whether a stray byte or
// the UTF-8 of U+0080..U+009F) and every byte that is not part of valid UTF-8.
// With escape_backslash a backslash becomes \\, so that distinct strings stay
// distinct. Valid printable UTF-8 (without a backslash) is returned as it is.
inline std::string escape_bytes(std::string_view s, bool escape_backslash) {
  static const char* hex = "0123456789abcdef";
  std::string out;
  out.reserve(s.size());
  auto esc = [&](unsigned char c) {
    out += "\\x";
    out += hex[c >> 4];
    out += hex[c & 15];
  };
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const size_t n = utf8_sequence_length(s, i);
    if (n == 0 || c < 0x20 || c == 0x7F) {
      esc(c);
      ++i;
    } else if (c == '\\' && escape_backslash) {
      out += "\\\\";
      ++i;
    } else if (n == 2 && c == 0xC2 && static_cast<unsigned char>(s[i + 1]) < 0xA0) {
      esc(c);  // U+0080..U+009F: C1 controls
      esc(static_cast<unsigned char>(s[i + 1]));
      i += 2;
    } else {
      out.append(s.substr(i, n));
      i += n;
    }
  }
  return out;
}

// A string from a file (a tensor name...) for a message or a listing: distinct
// strings stay distinct.
inline std::string printable(std::string_view s) { return escape_bytes(s, true); }

// A whole message for a terminal (its file strings may already be printable()):
// control and invalid bytes escaped, backslashes kept, so it is idempotent.
inline std::string terminal_safe(std::string_view s) { return escape_bytes(s, false); }

}  // namespace colibri
