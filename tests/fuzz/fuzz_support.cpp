// fuzz_support.cpp: the shared pieces of the fuzz targets (see fuzz_support.h),
// and the C API's status string, which model/dtype.cpp needs and which would
// otherwise pull the whole engine (launcher/capi/capi.cpp) into every fuzzer.
#include "fuzz_support.h"

#include <cxxabi.h>
#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "colibri.h"

// colibri_status_string comes from model/dtype.cpp.

namespace colibri::fuzz {

InputFile& InputFile::get() {
  static InputFile f;
  return f;
}

InputFile::InputFile() {
  // The parsers may log (spdlog); a fuzzer's output is its reports only.
  spdlog::set_level(spdlog::level::off);
  fd_ = ::memfd_create("colibri-fuzz-input", MFD_CLOEXEC);
  if (fd_ >= 0) {
    path_ = "/proc/self/fd/" + std::to_string(fd_);
    if (::access(path_.c_str(), R_OK) == 0) return;
    ::close(fd_);
    fd_ = -1;
  }
  const char* tmp = std::getenv("TMPDIR");
  path_ = std::string(tmp && *tmp ? tmp : "/tmp") + "/colibri-fuzz-input." + std::to_string(::getpid());
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd_ < 0) finding("setup", "cannot create " + path_ + ": " + std::strerror(errno));
  // NOTE: unlinked at exit, also when libFuzzer exits after a crash report.
  static std::string to_remove = path_;
  std::atexit([] { ::unlink(to_remove.c_str()); });
}

int lowest_free_fd() {
  const int fd = ::fcntl(0, F_DUPFD, 0);  // -1 where 0 is closed: then never a finding
  if (fd >= 0) ::close(fd);
  return fd;
}

void check_no_fd_leak(int before) {
  const int now = lowest_free_fd();
  if (now != before)
    finding("file descriptors", "the lowest free descriptor was " + std::to_string(before) + " before the parsers ran and is " +
                                    std::to_string(now) + " after: one was left open");
}

void InputFile::set(const uint8_t* data, size_t size, size_t file_size) {
  if (::ftruncate(fd_, 0) != 0) finding("setup", std::string("ftruncate: ") + std::strerror(errno));
  size_t done = 0;
  while (done < size) {
    ssize_t w = ::pwrite(fd_, data + done, size - done, static_cast<off_t>(done));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) finding("setup", std::string("pwrite: ") + std::strerror(errno));
    done += static_cast<size_t>(w);
  }
  if (file_size > size && ::ftruncate(fd_, static_cast<off_t>(file_size)) != 0)
    finding("setup", std::string("ftruncate: ") + std::strerror(errno));
}

void finding(const char* what, const std::string& detail) {
  std::fprintf(stderr, "\n==colibri-fuzz== FINDING in %s: %s\n", what, detail.c_str());
  std::fflush(stderr);
  std::abort();
}

std::string type_name(const std::type_info& t) {
  int status = 0;
  char* d = abi::__cxa_demangle(t.name(), nullptr, nullptr, &status);
  std::string s = (status == 0 && d) ? d : t.name();
  std::free(d);
  return s;
}

bool verbose() {
  static const bool v = [] {
    const char* e = std::getenv("COLIBRI_FUZZ_VERBOSE");
    return e && *e && *e != '0';
  }();
  return v;
}

void note(const char* what, bool accepted) {
  if (verbose()) std::fprintf(stderr, "  %s: %s\n", what, accepted ? "accepted" : "rejected");
}

uint64_t load_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

}  // namespace colibri::fuzz
