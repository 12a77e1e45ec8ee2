// safetensors.cpp: safetensors parsing, validation and writing.
#include "model/safetensors.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>

#include <nlohmann/json.hpp>

#include "model/error.h"
#include "model/file_io.h"

namespace colibri {

using nlohmann::json;
namespace fs = std::filesystem;

namespace {

constexpr uint64_t kMaxHeader = 100ull << 20;  // the reference implementation's limit

// Sizes of the dtypes the format defines, so even tensors we do not compute
// with are checked for consistent sizes.
std::optional<size_t> st_dtype_size(const std::string& t) {
  static const std::map<std::string, size_t> sizes = {
      {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8}, {"I32", 4}, {"I16", 2}, {"I8", 1},
      {"U64", 8}, {"U32", 4}, {"U16", 2}, {"U8", 1},   {"BOOL", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1}};
  auto it = sizes.find(t);
  if (it == sizes.end()) return std::nullopt;
  return it->second;
}

std::optional<DType> st_dtype(const std::string& t) {
  if (t == "F32") return DType::F32;
  if (t == "F16") return DType::F16;
  if (t == "BF16") return DType::BF16;
  return std::nullopt;
}

const char* st_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
  }
  return "?";
}

}  // namespace

int64_t SafeTensor::numel() const {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

std::vector<SafeTensor> SafetensorsFile::parse_header(const std::string& header, size_t data_size,
                                                      std::map<std::string, std::string>* metadata,
                                                      const std::string& what) {
  auto fail = [&](const std::string& msg) { throw Error(Status::Format, what + ": " + msg); };
  json h;
  try {
    h = json::parse(header);
  } catch (const json::exception& e) {
    fail(std::string("header is not valid JSON (") + e.what() + ")");
  }
  if (!h.is_object()) fail("header is not a JSON object");
  std::vector<SafeTensor> out;
  struct Range { uint64_t b, e; std::string name; };
  std::vector<Range> ranges;
  for (auto it = h.begin(); it != h.end(); ++it) {
    const std::string& name = it.key();
    if (name == "__metadata__") {
      if (!it->is_object()) fail("__metadata__ is not an object");
      if (metadata)
        for (auto m = it->begin(); m != it->end(); ++m)
          if (m->is_string()) (*metadata)[m.key()] = m->get<std::string>();
      continue;
    }
    const json& t = *it;
    std::string where = "tensor '" + name + "'";
    if (!t.is_object()) fail(where + " is not an object");
    if (!t.contains("dtype") || !t["dtype"].is_string()) fail(where + " has no dtype");
    if (!t.contains("shape") || !t["shape"].is_array()) fail(where + " has no shape");
    if (!t.contains("data_offsets") || !t["data_offsets"].is_array() || t["data_offsets"].size() != 2)
      fail(where + " has no data_offsets [begin, end]");
    SafeTensor st;
    st.name = name;
    st.dtype_name = t["dtype"].get<std::string>();
    st.dtype = st_dtype(st.dtype_name);
    auto esize = st_dtype_size(st.dtype_name);
    if (!esize) fail(where + " has unknown dtype '" + st.dtype_name + "'");
    // NOTE: the element count is computed with overflow checks; a hostile
    // header can claim any shape.
    uint64_t numel = 1, nonzero = 1;
    for (const auto& d : t["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) fail(where + " has a negative or non-integer dimension");
      uint64_t v = d.get<uint64_t>();
      if (v != 0 && nonzero > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) / v / *esize) fail(where + " has an absurd shape");
      if (v != 0) nonzero *= v;
      numel *= v;
      st.shape.push_back(static_cast<int64_t>(v));
    }
    const auto& off = t["data_offsets"];
    if (!off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      fail(where + " has negative or non-integer data_offsets");
    uint64_t b = off[0].get<uint64_t>(), e = off[1].get<uint64_t>();
    if (b > e) fail(where + " has data_offsets with begin > end");
    if (e > data_size)
      fail(where + " data_offsets end " + std::to_string(e) + " is past the end of the data (" +
           std::to_string(data_size) + " bytes)");
    if (e - b != numel * *esize)
      fail(where + " occupies " + std::to_string(e - b) + " bytes but its shape and dtype need " +
           std::to_string(numel * *esize));
    st.nbytes = e - b;
    st.data = reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(b));  // offset until rebased
    ranges.push_back({b, e, name});
    out.push_back(std::move(st));
  }
  // NOTE: by (begin, end), so an empty tensor [b, b) sorts before [b, e) and
  // is not mistaken for an overlap.
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) { return a.b != b.b ? a.b < b.b : a.e < b.e; });
  for (size_t i = 1; i < ranges.size(); ++i)
    if (ranges[i].b < ranges[i - 1].e)
      fail("tensors '" + ranges[i - 1].name + "' and '" + ranges[i].name + "' overlap");
  return out;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : file_(path) {
  const size_t size = file_.size();
  if (size < 8) throw Error(Status::Format, path + ": file is " + std::to_string(size) + " bytes, too short for a safetensors header");
  uint64_t n;
  std::memcpy(&n, file_.data(), 8);
  if (n > kMaxHeader) throw Error(Status::Format, path + ": header length " + std::to_string(n) + " exceeds the 100 MiB limit");
  if (n > size - 8)
    throw Error(Status::Format, path + ": header length " + std::to_string(n) + " is beyond the end of the file (" +
                                    std::to_string(size) + " bytes)");
  std::string header(reinterpret_cast<const char*>(file_.data()) + 8, n);
  tensors_ = parse_header(header, size - 8 - n, &metadata_, path);
  const uint8_t* base = file_.data() + 8 + n;
  for (auto& t : tensors_) t.data = base + reinterpret_cast<uintptr_t>(t.data);
  for (size_t i = 0; i < tensors_.size(); ++i) index_[tensors_[i].name] = i;
}

const SafeTensor* SafetensorsFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

Checkpoint::Checkpoint(const std::string& dir) {
  fs::path d(dir);
  if (!fs::is_directory(d)) throw Error(Status::Io, "'" + dir + "' is not a directory");
  fs::path index = d / "model.safetensors.index.json";
  if (fs::exists(index)) {
    json j;
    const std::string text = read_input(index.string(), "checkpoint index");
    files_.push_back(index.string());
    try {
      j = json::parse(text);
    } catch (const json::exception& e) {
      throw Error(Status::Format, index.string() + ": not valid JSON (" + e.what() + ")");
    }
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      throw Error(Status::Format, index.string() + ": missing 'weight_map' object");
    std::map<std::string, SafetensorsFile*> opened;
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      if (!it->is_string()) throw Error(Status::Format, index.string() + ": weight_map entry '" + it.key() + "' is not a file name");
      std::string shard = it->get<std::string>();
      if (shard.find('/') != std::string::npos || shard == ".." )
        throw Error(Status::Format, index.string() + ": shard name '" + shard + "' must be a plain file name");
      if (!opened.count(shard)) {
        fs::path sp = d / shard;
        if (!fs::exists(sp)) throw Error(Status::Io, index.string() + " names shard '" + shard + "', which does not exist");
        shards_.push_back(std::make_unique<SafetensorsFile>(sp.string()));
        files_.push_back(sp.string());
        opened[shard] = shards_.back().get();
      }
      const SafeTensor* t = opened[shard]->find(it.key());
      if (!t) throw Error(Status::Format, index.string() + " maps '" + it.key() + "' to '" + shard + "', which does not contain it");
      by_name_[it.key()] = t;
    }
  } else if (fs::exists(d / "model.safetensors")) {
    shards_.push_back(std::make_unique<SafetensorsFile>((d / "model.safetensors").string()));
    files_.push_back((d / "model.safetensors").string());
    for (const auto& t : shards_[0]->tensors()) by_name_[t.name] = &t;
  } else {
    throw Error(Status::Io, "'" + dir + "' has neither model.safetensors nor model.safetensors.index.json");
  }
}

void Checkpoint::check_unchanged() const {
  for (const auto& s : shards_) s->mapping().check_unchanged();
}

const SafeTensor* Checkpoint::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

const SafeTensor& Checkpoint::get(const std::string& name) const {
  const SafeTensor* t = find(name);
  if (!t) throw Error(Status::Format, "checkpoint has no tensor '" + name + "'");
  return *t;
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> v;
  for (const auto& [k, _] : by_name_) v.push_back(k);
  return v;
}

struct SafetensorsWriter::Impl {
  std::string path;
  std::unique_ptr<AtomicOutput> out;  // PATH.tmp.XXXXXX until finish()
  std::FILE* f = nullptr;             // out's stream
  std::vector<size_t> sizes;
  std::vector<std::string> names;
  size_t next = 0;
};

SafetensorsWriter::SafetensorsWriter(const std::string& path, const std::vector<Spec>& specs,
                                     const std::map<std::string, std::string>& metadata)
    : impl_(std::make_unique<Impl>()) {
  impl_->path = path;
  json h = json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  uint64_t off = 0;
  for (const auto& s : specs) {
    uint64_t n = dtype_size(s.dtype);
    for (auto d : s.shape) n *= static_cast<uint64_t>(d);
    h[s.name] = {{"dtype", st_name(s.dtype)}, {"shape", s.shape}, {"data_offsets", {off, off + n}}};
    off += n;
    impl_->sizes.push_back(n);
    impl_->names.push_back(s.name);
  }
  std::string text = h.dump();
  while ((8 + text.size()) % 8) text.push_back(' ');  // keep data 8-byte aligned
  impl_->out = std::make_unique<AtomicOutput>(path);
  impl_->f = impl_->out->stream();
  uint64_t n = text.size();
  if (std::fwrite(&n, 8, 1, impl_->f) != 1 || std::fwrite(text.data(), 1, n, impl_->f) != n)
    throw Error(Status::Io, "write to '" + path + "' failed");
}

// NOTE: an unfinished writer's AtomicOutput removes its temporary.
SafetensorsWriter::~SafetensorsWriter() = default;

void SafetensorsWriter::write_next(const void* data, size_t nbytes) {
  if (impl_->next >= impl_->sizes.size()) throw Error(Status::Internal, "SafetensorsWriter: more tensors than declared");
  if (nbytes != impl_->sizes[impl_->next])
    throw Error(Status::Internal, "SafetensorsWriter: tensor '" + impl_->names[impl_->next] + "' size mismatch");
  if (std::fwrite(data, 1, nbytes, impl_->f) != nbytes) throw Error(Status::Io, "write to '" + impl_->path + "' failed");
  ++impl_->next;
}

void SafetensorsWriter::finish() {
  if (impl_->next != impl_->sizes.size()) throw Error(Status::Internal, "SafetensorsWriter: fewer tensors written than declared");
  impl_->f = nullptr;
  impl_->out->commit();
}

}  // namespace colibri
