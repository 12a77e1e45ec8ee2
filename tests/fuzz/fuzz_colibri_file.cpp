// fuzz_colibri_file.cpp: libFuzzer target for the .colibri reader
// (ColibriFile::open: header, embedded JSON config, tensor directory, expert
// index). Each input is opened twice:
//  1. as it is (the bytes are the file);
//  2. "repaired": the header's meta_checksum recomputed and the file extended
//     with zeros to the header's file_size (up to 16 MiB). Without this almost
//     every mutation of the config, directory or index dies at the checksum or
//     length check, and the validation behind them is never reached. A seed can
//     then be just the header and metadata of a file whose data is all zeros.
// Whatever open() accepts is checked against the format's invariants (every
// view inside the file, aligned, sized by its shape, no overlaps, everything
// the config needs present), and every checksum is verified, which touches
// every byte of every view.
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "fuzz_support.h"
#include "model/colibri_file.h"
#include "model/dtype.h"

using namespace colibri;
using fuzz::expect_only_colibri_errors;

namespace {

constexpr uint64_t kMaxRepairedSize = 16u << 20;

std::string str(uint64_t v) { return std::to_string(v); }

void check_accepted(const ColibriFile& f, uint64_t fsize) {
  const FileHeader& h = f.header();
  const ModelConfig& c = f.config();
  FUZZ_CHECK(f.file_size() == fsize, "file_size " + str(f.file_size()) + " vs " + str(fsize));
  FUZZ_CHECK(h.file_size == fsize, "header file_size " + str(h.file_size));
  FUZZ_CHECK(h.data_offset <= fsize && h.data_offset % kBlockAlign == 0, "data_offset " + str(h.data_offset));
  try {
    c.validate();
  } catch (const std::exception& e) {
    fuzz::finding("ColibriFile::open", std::string("accepted a config that validate() rejects: ") + e.what());
  }

  struct Range { uint64_t b, e; };
  std::vector<Range> ranges;
  const uint8_t* base = nullptr;
  auto in_file = [&](const uint8_t* p, uint64_t off, uint64_t size, const std::string& what) {
    FUZZ_CHECK(off % kBlockAlign == 0, what + " offset " + str(off) + " not aligned");
    FUZZ_CHECK(off >= h.data_offset && off <= fsize && size <= fsize - off,
               what + " [" + str(off) + ", +" + str(size) + ") outside the data region of " + str(fsize));
    if (!base) base = p - off;
    FUZZ_CHECK(p == base + off, what + " data pointer does not match its offset");
    ranges.push_back({off, off + size});
  };

  for (const auto& t : f.tensors()) {
    FUZZ_CHECK(!t.name.empty() && t.name.size() <= kMaxTensorName, "tensor name '" + t.name + "'");
    FUZZ_CHECK(!t.shape.empty() && t.shape.size() <= static_cast<size_t>(kMaxDims), "tensor '" + t.name + "' rank");
    uint64_t n = 1;
    for (auto d : t.shape) {
      FUZZ_CHECK(d >= 1, "tensor '" + t.name + "' dimension " + std::to_string(d));
      FUZZ_CHECK(n <= UINT64_MAX / static_cast<uint64_t>(d), "tensor '" + t.name + "' element count overflows");
      n *= static_cast<uint64_t>(d);
    }
    FUZZ_CHECK(static_cast<uint64_t>(t.numel()) == n, "tensor '" + t.name + "' numel()");
    FUZZ_CHECK(t.size == n * dtype_size(t.dtype), "tensor '" + t.name + "' size " + str(t.size));
    in_file(t.data, t.offset, t.size, "tensor '" + t.name + "'");
    FUZZ_CHECK(f.find(t.name) == &t, "find('" + t.name + "')");
  }
  for (const auto& spec : dense_tensor_specs(c)) {
    const TensorView* t = f.find(spec.name);
    FUZZ_CHECK(t && t->shape == spec.shape, "tensor '" + spec.name + "' required by the config is missing or misshapen");
  }

  const uint64_t want = static_cast<uint64_t>(c.num_layers) * c.num_experts;
  FUZZ_CHECK(f.experts().size() == want, "expert count " + str(f.experts().size()) + " vs " + str(want));
  const ExpertLayout lay = expert_layout(c, f.expert_dtype());
  for (int l = 0; l < c.num_layers; ++l)
    for (int e = 0; e < c.num_experts; ++e) {
      const ExpertView& x = f.expert(l, e);
      const std::string what = "expert " + std::to_string(e) + " of layer " + std::to_string(l);
      FUZZ_CHECK(x.layer == l && x.expert == e, what + " is stored in the wrong slot");
      FUZZ_CHECK(x.dtype == f.expert_dtype(), what + " dtype");
      FUZZ_CHECK(x.size == lay.size, what + " size " + str(x.size));
      in_file(x.block, x.offset, x.size, what);
      const uint64_t mat = static_cast<uint64_t>(c.intermediate_size) * c.hidden_size * dtype_size(x.dtype);
      auto inside = [&](const void* m) {
        const uint8_t* p = static_cast<const uint8_t*>(m);
        return p >= x.block && static_cast<uint64_t>(p - x.block) + mat <= x.size;
      };
      FUZZ_CHECK(inside(x.gate) && inside(x.up) && inside(x.down), what + " matrices outside its block");
    }
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) { return a.b < b.b; });
  for (size_t i = 1; i < ranges.size(); ++i)
    FUZZ_CHECK(ranges[i].b >= ranges[i - 1].e, "blocks at " + str(ranges[i - 1].b) + " and " + str(ranges[i].b) + " overlap");

  // Touches every byte of every view: a view past the mapping faults here.
  for (const auto& t : f.tensors()) expect_only_colibri_errors("verify_tensor", [&] { f.verify_tensor(t); });
  for (const auto& x : f.experts()) expect_only_colibri_errors("verify_expert", [&] { f.verify_expert(x); });
  expect_only_colibri_errors("tensor(missing)", [&] { f.tensor("no such tensor"); });
  expect_only_colibri_errors("expert(out of range)", [&] { f.expert(static_cast<int>(c.num_layers), 0); });
}

void open_and_check(uint64_t fsize) {
  auto& in = fuzz::InputFile::get();
  ColibriFile::Options opts;
  opts.verify_dense = false;  // verified below, after the structural checks
  std::shared_ptr<ColibriFile> f;
  if (expect_only_colibri_errors("ColibriFile::open", [&] { f = ColibriFile::open(in.path(), opts); }))
    check_accepted(*f, fsize);
  opts.verify_dense = true;
  expect_only_colibri_errors("ColibriFile::open (verify_dense)", [&] { ColibriFile::open(in.path(), opts); });
}

// XXH3-64 of bytes [b, e) of `data` followed by zeros up to `e`.
uint64_t checksum_zero_extended(const std::vector<uint8_t>& data, uint64_t b, uint64_t e) {
  static const std::vector<uint8_t> zeros(1 << 16, 0);
  XXH3_state_t* st = XXH3_createState();
  XXH3_64bits_reset(st);
  if (b < data.size()) XXH3_64bits_update(st, data.data() + b, std::min<uint64_t>(e, data.size()) - b);
  for (uint64_t p = std::max<uint64_t>(b, data.size()); p < e;) {
    const uint64_t n = std::min<uint64_t>(zeros.size(), e - p);
    XXH3_64bits_update(st, zeros.data(), n);
    p += n;
  }
  const uint64_t h = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  return h;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto& in = fuzz::InputFile::get();
  const int fds = fuzz::lowest_free_fd();
  in.set(data, size);
  open_and_check(size);

  if (size < kHeaderSize) return 0;
  std::vector<uint8_t> buf(data, data + size);
  FileHeader h;
  std::memcpy(&h, buf.data(), sizeof h);
  const uint64_t fsize = (h.file_size > size && h.file_size <= kMaxRepairedSize) ? h.file_size : size;
  if (h.config_offset <= h.data_offset && h.data_offset <= fsize) {
    h.meta_checksum = checksum_zero_extended(buf, h.config_offset, h.data_offset);
    std::memcpy(buf.data(), &h, sizeof h);
  }
  in.set(buf.data(), buf.size(), fsize);
  open_and_check(fsize);
  fuzz::check_no_fd_leak(fds);
  return 0;
}
