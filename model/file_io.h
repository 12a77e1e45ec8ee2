// file_io.h: the engine's checked file access. Inputs are opened only when they
// are regular files (a FIFO never blocks the open, a directory is refused with
// its path); an output never destroys one of the inputs or a special file; and
// every output is written through a uniquely named temporary in its own folder,
// renamed over the final name only when complete (docs/reliability.md).
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

namespace colibri {

// Opens PATH read-only after checking that it is a regular file: the open does
// not block on a FIFO (O_NONBLOCK, cleared after the check), and a directory,
// FIFO, socket or device is refused naming the path and what it is. `what`
// names the file's role in messages ("model", "config.json", "--prompt-file").
// Returns the descriptor (O_CLOEXEC); the caller closes it. Throws Error(Io).
int open_input(const std::string& path, std::string_view what = "file");

// Checks that PATH can be opened for reading and is a regular file, for a
// reader that streams it itself (std::ifstream). Throws Error(Io).
void check_input(const std::string& path, std::string_view what = "file");

// The whole content of a regular file (checked as open_input). Throws Error(Io).
std::string read_input(const std::string& path, std::string_view what = "file");

// What kind of file a mode is, for messages: "a directory", "a FIFO", ...
const char* file_kind(unsigned mode);

// True when both paths exist and are one file (same device and inode, through
// symlinks and hard links).
bool same_file(const std::string& a, const std::string& b);

// Checks an output path before any work is done: refuses (Error(InvalidArgument),
// naming both paths) an output that resolves to one of `inputs` (same device
// and inode, through symlinks and hard links) and an existing output that is
// not a regular file (a device such as /dev/null, a FIFO, a directory). Inputs
// that do not exist are skipped; so is an empty path.
void check_output(const std::string& out, const std::vector<std::string>& inputs, std::string_view what = "output");

// A file written through a temporary with a unique name in the output's folder
// (PATH.tmp.XXXXXX): commit() flushes, fsyncs and renames it to PATH, so PATH
// never holds a half-written file, and two writers of one PATH never rename
// each other's work. Destroyed uncommitted, it removes the temporary.
class AtomicOutput {
 public:
  // Creates the temporary (mode 0644 less the umask). Throws Error(Io).
  explicit AtomicOutput(std::string path);
  ~AtomicOutput();
  AtomicOutput(const AtomicOutput&) = delete;
  AtomicOutput& operator=(const AtomicOutput&) = delete;

  const std::string& path() const { return path_; }
  const std::string& temp_path() const { return tmp_; }
  // The descriptor, for pwrite; do not close it.
  int fd() const { return fd_; }
  // A stdio stream over the descriptor (made on first use, fully buffered).
  std::FILE* stream();
  // Appends bytes (through the stream). Throws Error(Io).
  void write(const void* data, size_t n);
  void write(std::string_view s) { write(s.data(), s.size()); }
  // Writes n bytes at `offset` with pwrite (not through the stream). Throws Error(Io).
  void pwrite(const void* data, size_t n, uint64_t offset);
  // Flushes, fsyncs, closes and renames the temporary to PATH; refuses (and
  // removes the temporary) if PATH has meanwhile become a non-regular file.
  // Throws Error(Io). Idempotent.
  void commit();
  // Removes the temporary now (idempotent; commit() then fails).
  void discard();
  bool committed() const { return committed_; }

 private:
  std::string path_, tmp_;
  int fd_ = -1;
  std::FILE* stream_ = nullptr;
  bool committed_ = false;
};

// Writes `data` to PATH atomically (AtomicOutput). Throws Error(Io).
void write_output(const std::string& path, std::string_view data);

}  // namespace colibri
