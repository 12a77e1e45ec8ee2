// tokenizer_impl.h: internals shared by tokenizer.cpp, tokenizer_bpe.cpp and
// tokenizer_spm.cpp (not part of the public interface).
#pragma once
#include <memory>
#include <string>
#include <string_view>

#include "model/tokenizer.h"

namespace colibri::detail {

std::unique_ptr<Tokenizer> load_hf_json(std::string_view bytes, const TokenizerOptions& opts);
std::unique_ptr<Tokenizer> load_sentencepiece(std::string_view bytes, const TokenizerOptions& opts);

// Bytes at the end of s that start a multi-byte UTF-8 character not yet complete (0 if none).
size_t utf8_incomplete_tail(std::string_view s);
// s with every ill-formed subsequence replaced by U+FFFD (maximal subparts, as
// Rust's String::from_utf8_lossy and Python's errors="replace" do).
std::string utf8_sanitize(std::string_view s);
bool utf8_valid(std::string_view s);

}  // namespace colibri::detail
