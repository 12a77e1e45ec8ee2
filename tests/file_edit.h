// file_edit.h: edits the bytes of a .colibri file in memory for the corruption
// tests (tests/test_colibri_file.cpp, tests/test_quant.cpp).
#pragma once
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "model/colibri_file.h"

namespace colibri::test {

inline FileHeader header_of(const std::string& b) {
  FileHeader h;
  std::memcpy(&h, b.data(), sizeof h);
  return h;
}
inline void set_header(std::string& b, const FileHeader& h) { std::memcpy(b.data(), &h, sizeof h); }

// Recomputes meta_checksum so a structural check, not the checksum, fails.
inline void reseal(std::string& b) {
  FileHeader h = header_of(b);
  h.meta_checksum = checksum64(b.data() + h.config_offset, h.data_offset - h.config_offset);
  set_header(b, h);
}

// Replaces `from` with `to` (same length) inside the embedded config.
inline void edit_config(std::string& b, const std::string& from, const std::string& to) {
  ASSERT_EQ(from.size(), to.size());
  const FileHeader h = header_of(b);
  const size_t p = b.find(from, h.config_offset);
  ASSERT_NE(p, std::string::npos) << from;
  ASSERT_LT(p, h.config_offset + h.config_size) << from;
  b.replace(p, from.size(), to);
}

}  // namespace colibri::test
