// file_io.cpp: checked inputs, guarded outputs and atomic writes (POSIX).
#include "model/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "model/error.h"

namespace colibri {

namespace {

std::string quoted(std::string_view s) { return "'" + std::string(s) + "'"; }

std::string os_error(int e) { return std::strerror(e); }

// The process's umask, read once (umask() can only be read by setting it).
mode_t process_umask() {
  static const mode_t m = [] {
    const mode_t u = ::umask(022);
    ::umask(u);
    return u;
  }();
  return m;
}

}  // namespace

const char* file_kind(unsigned mode) {
  switch (mode & S_IFMT) {
    case S_IFREG: return "a regular file";
    case S_IFDIR: return "a directory";
    case S_IFIFO: return "a FIFO";
    case S_IFSOCK: return "a socket";
    case S_IFCHR: return "a character device";
    case S_IFBLK: return "a block device";
    default: return "not a regular file";
  }
}

int open_input(const std::string& path, std::string_view what) {
  // NOTE: O_NONBLOCK: opening a FIFO for reading would otherwise wait for a
  // writer forever, before any check could run.
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) {
    const int e = errno;
    throw Error(Status::Io, "cannot open " + std::string(what) + " " + quoted(path) + ": " + os_error(e));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    throw Error(Status::Io, "cannot stat " + std::string(what) + " " + quoted(path) + ": " + os_error(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(Status::Io, std::string(what) + " " + quoted(path) + " is " + file_kind(st.st_mode) +
                                ", not a regular file");
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  return fd;
}

void check_input(const std::string& path, std::string_view what) { ::close(open_input(path, what)); }

std::string read_input(const std::string& path, std::string_view what) {
  const int fd = open_input(path, what);
  std::string text;
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int e = errno;
      ::close(fd);
      throw Error(Status::Io, "cannot read " + std::string(what) + " " + quoted(path) + ": " + os_error(e));
    }
    if (n == 0) break;
    text.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return text;
}

bool same_file(const std::string& a, const std::string& b) {
  struct stat sa {}, sb {};
  return ::stat(a.c_str(), &sa) == 0 && ::stat(b.c_str(), &sb) == 0 && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

void check_output(const std::string& out, const std::vector<std::string>& inputs, std::string_view what) {
  if (out.empty()) throw Error(Status::InvalidArgument, std::string(what) + ": the output path is empty");
  struct stat so {};
  if (::stat(out.c_str(), &so) != 0) return;  // does not exist (yet): nothing to destroy
  for (const std::string& in : inputs) {
    if (!in.empty() && same_file(in, out))
      throw Error(Status::InvalidArgument, std::string(what) + " " + quoted(out) + " is the input " + quoted(in) +
                                               ": refusing to overwrite an input");
  }
  if (!S_ISREG(so.st_mode))
    throw Error(Status::InvalidArgument, std::string(what) + " " + quoted(out) + " exists and is " +
                                             file_kind(so.st_mode) + ": refusing to replace it (give a file path)");
}

AtomicOutput::AtomicOutput(std::string path) : path_(std::move(path)) {
  tmp_ = path_ + ".tmp.XXXXXX";
  fd_ = ::mkostemp(tmp_.data(), O_CLOEXEC);
  if (fd_ < 0) {
    const int e = errno;
    throw Error(Status::Io, "cannot create a temporary file beside " + quoted(path_) + ": " + os_error(e));
  }
  // NOTE: mkostemp makes the file 0600; an output is as readable as any file.
  ::fchmod(fd_, 0644 & ~process_umask());
}

AtomicOutput::~AtomicOutput() { discard(); }

std::FILE* AtomicOutput::stream() {
  if (!stream_) {
    if (fd_ < 0) throw Error(Status::Io, "output " + quoted(path_) + " is already closed");
    stream_ = ::fdopen(fd_, "wb");
    if (!stream_) throw Error(Status::Io, "cannot write " + quoted(tmp_) + ": " + os_error(errno));
    std::setvbuf(stream_, nullptr, _IOFBF, 1 << 20);
  }
  return stream_;
}

void AtomicOutput::write(const void* data, size_t n) {
  if (n == 0) return;
  std::FILE* f = stream();
  if (std::fwrite(data, 1, n, f) != n) throw Error(Status::Io, "cannot write " + quoted(tmp_) + ": " + os_error(errno));
}

void AtomicOutput::pwrite(const void* data, size_t n, uint64_t offset) {
  const char* c = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::pwrite(fd_, c, n, static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      throw Error(Status::Io, "write to " + quoted(tmp_) + " failed: " + os_error(errno));
    }
    c += w;
    n -= static_cast<size_t>(w);
    offset += static_cast<uint64_t>(w);
  }
}

void AtomicOutput::commit() {
  if (committed_) return;
  if (fd_ < 0) throw Error(Status::Io, "output " + quoted(path_) + " was discarded");
  bool ok = true;
  int e = 0;
  if (stream_ && std::fflush(stream_) != 0) ok = false, e = errno;
  if (ok && ::fsync(fd_) != 0) ok = false, e = errno;
  const int rc = stream_ ? std::fclose(stream_) : ::close(fd_);
  if (ok && rc != 0) ok = false, e = errno;
  stream_ = nullptr;
  fd_ = -1;
  if (!ok) {
    ::unlink(tmp_.c_str());
    throw Error(Status::Io, "cannot write " + quoted(tmp_) + ": " + os_error(e));
  }
  // NOTE: checked again at the end: rename() would replace a device or FIFO
  // that appeared at PATH while the output was being written.
  struct stat so {};
  if (::stat(path_.c_str(), &so) == 0 && !S_ISREG(so.st_mode)) {
    ::unlink(tmp_.c_str());
    throw Error(Status::InvalidArgument, "output " + quoted(path_) + " is " + file_kind(so.st_mode) +
                                             ": refusing to replace it");
  }
  if (std::rename(tmp_.c_str(), path_.c_str()) != 0) {
    e = errno;
    ::unlink(tmp_.c_str());
    throw Error(Status::Io, "cannot rename " + quoted(tmp_) + " to " + quoted(path_) + ": " + os_error(e));
  }
  committed_ = true;
}

void AtomicOutput::discard() {
  if (stream_) std::fclose(stream_);
  else if (fd_ >= 0) ::close(fd_);
  if ((stream_ || fd_ >= 0) && !committed_) ::unlink(tmp_.c_str());
  stream_ = nullptr;
  fd_ = -1;
}

void write_output(const std::string& path, std::string_view data) {
  AtomicOutput out(path);
  out.write(data);
  out.commit();
}

}  // namespace colibri
