// fuzz_safetensors.cpp: libFuzzer target for the safetensors reader. Each input
// is used two ways:
//  1. as a whole file (8-byte header length, JSON header, data): SafetensorsFile;
//  2. as [8-byte data size][JSON header text]: SafetensorsFile::parse_header on
//     the text, then (for a data size up to 1 MiB) a file built from it with a
//     correct length prefix and a zero data region, so mutations of the JSON do
//     not break the length prefix.
// Whatever is accepted is checked: offsets inside the data, sizes equal to
// shape x dtype, no overlaps, find() finds every tensor, and every tensor's
// bytes are read.
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "fuzz_support.h"
#include "model/dtype.h"
#include "model/safetensors.h"

using namespace colibri;
using fuzz::expect_only_colibri_errors;

namespace {

// The format's dtypes and sizes, written here independently of the reader.
std::optional<uint64_t> elem_size(const std::string& t) {
  static const std::map<std::string, uint64_t> m = {
      {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8}, {"I32", 4}, {"I16", 2}, {"I8", 1},
      {"U64", 8}, {"U32", 4}, {"U16", 2}, {"U8", 1},   {"BOOL", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1}};
  auto it = m.find(t);
  if (it == m.end()) return std::nullopt;
  return it->second;
}

// `offset_of(t)`: the tensor's begin offset in the data region.
template <typename OffsetOf>
void check_tensors(const std::vector<SafeTensor>& ts, uint64_t data_size, OffsetOf offset_of) {
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& t : ts) {
    const std::string what = "tensor '" + t.name + "'";
    auto es = elem_size(t.dtype_name);
    FUZZ_CHECK(es.has_value(), what + " accepted with dtype '" + t.dtype_name + "'");
    if (t.dtype) FUZZ_CHECK(dtype_size(*t.dtype) == *es, what + " dtype");
    unsigned __int128 n = 1;
    for (auto d : t.shape) {
      FUZZ_CHECK(d >= 0, what + " negative dimension");
      n *= static_cast<uint64_t>(d);
      if (n == 0) break;
    }
    FUZZ_CHECK(n * *es == t.nbytes, what + " nbytes " + std::to_string(t.nbytes) + " does not match shape x dtype");
    // NOTE: numel() is what the converter and the engine size buffers with.
    FUZZ_CHECK(static_cast<unsigned __int128>(t.numel()) == n, what + " numel()");
    const uint64_t off = offset_of(t);
    FUZZ_CHECK(off <= data_size && t.nbytes <= data_size - off,
               what + " [" + std::to_string(off) + ", +" + std::to_string(t.nbytes) + ") outside " + std::to_string(data_size));
    ranges.emplace_back(off, off + t.nbytes);
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i)
    FUZZ_CHECK(ranges[i].first >= ranges[i - 1].second, "overlapping tensors accepted");
}

// Opens the current input file, whose first `written` bytes are `file` and
// whose total length is `total` (zeros after `written`).
void open_file(const uint8_t* file, size_t written, uint64_t total) {
  std::optional<SafetensorsFile> f;
  if (!expect_only_colibri_errors("SafetensorsFile", [&] { f.emplace(fuzz::InputFile::get().path()); })) return;
  FUZZ_CHECK(written >= 8, "accepted a file of " + std::to_string(total) + " bytes");
  const uint64_t n = fuzz::load_le64(file);
  FUZZ_CHECK(n <= written - 8, "accepted a header length past the end");
  // The reader's offsets are not exposed: the same header parsed alone gives
  // them, and every tensor must sit at one base + its offset.
  const uint64_t data_size = total - 8 - n;
  std::vector<SafeTensor> ref;
  try {
    ref = SafetensorsFile::parse_header(std::string(reinterpret_cast<const char*>(file) + 8, n), data_size, nullptr, "ref");
  } catch (const std::exception& e) {
    fuzz::finding("SafetensorsFile", std::string("accepted a header that parse_header rejects: ") + e.what());
  }
  const auto& ts = f->tensors();
  FUZZ_CHECK(ts.size() == ref.size(), "tensor count differs from parse_header");
  auto offset = [](const SafeTensor& t) { return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(t.data)); };
  check_tensors(ref, data_size, offset);
  const uint8_t* base = nullptr;
  for (size_t i = 0; i < ts.size(); ++i) {
    const auto& t = ts[i];
    FUZZ_CHECK(t.name == ref[i].name && t.nbytes == ref[i].nbytes && t.shape == ref[i].shape, "tensor '" + t.name + "' differs");
    if (!base) base = t.data - offset(ref[i]);
    FUZZ_CHECK(t.data == base + offset(ref[i]), "tensor '" + t.name + "' is not at base + its offset");
    FUZZ_CHECK(f->find(t.name) == &t, "find('" + t.name + "')");
  }
  for (const auto& t : ts) (void)XXH3_64bits(t.data, t.nbytes);  // every byte must be readable
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto& in = fuzz::InputFile::get();
  const int fds = fuzz::lowest_free_fd();
  in.set(data, size);
  open_file(data, size, size);

  if (size < 8) return 0;
  const uint64_t data_size = fuzz::load_le64(data);
  const std::string header(reinterpret_cast<const char*>(data) + 8, size - 8);
  std::map<std::string, std::string> meta;
  std::vector<SafeTensor> ts;
  if (expect_only_colibri_errors("parse_header", [&] {
        ts = SafetensorsFile::parse_header(header, static_cast<size_t>(data_size), &meta, "fuzz");
      }))
    check_tensors(ts, data_size, [](const SafeTensor& t) { return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(t.data)); });

  if (data_size <= (1u << 20)) {
    std::vector<uint8_t> file(8 + header.size());
    const uint64_t n = header.size();
    std::memcpy(file.data(), &n, 8);
    std::memcpy(file.data() + 8, header.data(), header.size());
    in.set(file.data(), file.size(), file.size() + data_size);
    open_file(file.data(), file.size(), file.size() + data_size);
  }
  fuzz::check_no_fd_leak(fds);
  return 0;
}
