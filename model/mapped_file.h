// mapped_file.h: a read-only memory mapping of a whole file (RAII).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace colibri {

class MappedFile {
 public:
  MappedFile() = default;
  // Throws Error(Io) naming the path and the OS error.
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  MappedFile(MappedFile&& o) noexcept;
  MappedFile& operator=(MappedFile&& o) noexcept;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }
  // Hints the kernel to read [offset, offset+len) ahead (best effort).
  void prefetch(size_t offset, size_t len) const;

 private:
  void reset();
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  std::string path_;
};

// Drops the pages of a read-only file mapping that hold [p, p+n) from this
// process's resident set (they are re-read from the file if touched again), so
// streaming through a large mapping keeps memory flat. Best effort.
void release_mapped_pages(const void* p, size_t n);

}  // namespace colibri
