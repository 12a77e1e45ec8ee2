// safetensors.h: reader (single file and sharded checkpoints) and streaming
// writer for the Hugging Face safetensors format. Sizes in the header are never
// trusted: every offset, shape and dtype is checked against the file.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "model/dtype.h"
#include "model/mapped_file.h"

namespace colibri {

struct SafeTensor {
  std::string name;
  std::string dtype_name;       // as written in the header, e.g. "BF16"
  std::optional<DType> dtype;   // set for the dtypes the engine computes with
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  size_t nbytes = 0;
  int64_t numel() const;
};

class SafetensorsFile {
 public:
  // Maps and validates the file; throws Error(Io|Format) naming the path.
  explicit SafetensorsFile(const std::string& path);
  const std::vector<SafeTensor>& tensors() const { return tensors_; }
  const SafeTensor* find(const std::string& name) const;
  const std::string& path() const { return file_.path(); }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const MappedFile& mapping() const { return file_; }

  // Validates a header without a file (exposed for tests and fuzzing).
  // `header` is the JSON text, `data_size` the bytes after it.
  static std::vector<SafeTensor> parse_header(const std::string& header, size_t data_size,
                                              std::map<std::string, std::string>* metadata,
                                              const std::string& what);

 private:
  MappedFile file_;
  std::vector<SafeTensor> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// A Hugging Face checkpoint directory: config.json plus model.safetensors, or
// model.safetensors.index.json naming shards.
class Checkpoint {
 public:
  explicit Checkpoint(const std::string& dir);
  const SafeTensor* find(const std::string& name) const;
  // Throws Error(Format) naming the tensor when it is missing.
  const SafeTensor& get(const std::string& name) const;
  std::vector<std::string> names() const;
  size_t num_shards() const { return shards_.size(); }
  // Every file read: the index (if any) and the shards.
  const std::vector<std::string>& files() const { return files_; }
  // Throws Error(FileChanged) if a shard was truncated or rewritten since it was mapped.
  void check_unchanged() const;

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> shards_;
  std::vector<std::string> files_;
  std::map<std::string, const SafeTensor*> by_name_;
};

// Streaming writer: the header is written from the declared tensors first, then
// each tensor's bytes in declaration order, so peak memory is one tensor.
class SafetensorsWriter {
 public:
  struct Spec {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
  };
  SafetensorsWriter(const std::string& path, const std::vector<Spec>& specs,
                    const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  // Writes the next tensor; `nbytes` must equal its declared size.
  void write_next(const void* data, size_t nbytes);
  void finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace colibri
