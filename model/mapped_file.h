// mapped_file.h: a read-only memory mapping of a whole file (RAII), guarded
// against the file changing under it: a read past the end of a file that was
// truncated while mapped no longer kills the process with SIGBUS (the missing
// pages read as zeros and the mapping is marked changed), and check_unchanged()
// reports a truncation or an in-place rewrite as Error(FileChanged) naming the
// file, so that the engine ends the run with what it has (docs/reliability.md).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace colibri {

class MappedFile {
 public:
  MappedFile() = default;
  // Throws Error(Io) naming the path and the OS error, or the kind of file
  // when it is not a regular one (a FIFO is refused without blocking).
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

  // True when the file changed since it was mapped: a read past its end was
  // caught (it was truncated) or its size or modification time differ (it was
  // truncated, extended or written in place). Replacing the file by a rename
  // is not a change: the mapping keeps the old file. One fstat; thread-safe.
  bool changed() const noexcept;
  // Throws Error(FileChanged) naming the file and what changed, if changed().
  void check_unchanged() const;

 private:
  void reset();
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  std::string path_;
  int fd_ = -1;        // kept open for fstat
  int guard_ = -1;     // slot in the SIGBUS guard's table, -1: none
  int64_t mtime_ns_ = 0;
};

// Reads past the end of a truncated mapping that the SIGBUS guard has caught
// since the process started (a test aid).
uint64_t mapped_file_faults();

// Drops the pages of a read-only file mapping that hold [p, p+n) from this
// process's resident set (they are re-read from the file if touched again), so
// streaming through a large mapping keeps memory flat. Best effort.
void release_mapped_pages(const void* p, size_t n);

}  // namespace colibri
