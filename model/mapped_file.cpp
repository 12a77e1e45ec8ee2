// mapped_file.cpp: POSIX mmap of a read-only file.
#include "model/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <algorithm>
#include <utility>
#include <atomic>
#include <csignal>
#include <mutex>

#include "model/error.h"
#include "model/file_io.h"

namespace colibri {

namespace {

// ---- the SIGBUS guard -------------------------------------------------------
// A read through a mapping beyond the end of its file (truncated after it was
// mapped) raises SIGBUS. The handler looks the address up in this table of
// live mappings; if it is one of them, it maps zero pages over the rest of the
// mapping (so the read, re-executed, gets zeros) and marks it faulted; the
// engine's check_unchanged() between forward passes then ends the run. Any
// other SIGBUS goes to the previous disposition. The table is fixed-size and
// lock-free: the handler only reads atomics and calls mmap.
constexpr int kGuards = 1024;
struct Guard {
  std::atomic<uintptr_t> begin{0}, end{0};
  std::atomic<int> faulted{0};
};
Guard g_guards[kGuards];
std::atomic<uint64_t> g_faults{0};
struct sigaction g_prev_bus {};
uintptr_t g_page = 4096;
std::once_flag g_installed;

void on_sigbus(int sig, siginfo_t* info, void* uctx) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(info->si_addr);
  for (Guard& g : g_guards) {
    const uintptr_t b = g.begin.load(std::memory_order_acquire), e = g.end.load(std::memory_order_acquire);
    if (b == 0 || a < b || a >= e) continue;
    const uintptr_t page = a & ~(g_page - 1);
    void* p = ::mmap(reinterpret_cast<void*>(page), e - page, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    if (p == MAP_FAILED) break;
    g.faulted.store(1, std::memory_order_release);
    g_faults.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  // Not a guarded mapping: what the process had before.
  if ((g_prev_bus.sa_flags & SA_SIGINFO) && g_prev_bus.sa_sigaction) {
    g_prev_bus.sa_sigaction(sig, info, uctx);
    return;
  }
  if (!(g_prev_bus.sa_flags & SA_SIGINFO) && g_prev_bus.sa_handler != SIG_DFL && g_prev_bus.sa_handler != SIG_IGN) {
    g_prev_bus.sa_handler(sig);
    return;
  }
  // NOTE: returning re-executes the faulting access, which now takes the
  // default action (a core dump), as without the guard.
  ::signal(SIGBUS, SIG_DFL);
}

int guard_mapping(const void* p, size_t n) {
  std::call_once(g_installed, [] {
    const long ps = ::sysconf(_SC_PAGESIZE);
    if (ps > 0) g_page = static_cast<uintptr_t>(ps);
    struct sigaction sa {};
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGBUS, &sa, &g_prev_bus);
  });
  const uintptr_t b = reinterpret_cast<uintptr_t>(p);
  const uintptr_t e = (b + n + g_page - 1) & ~(g_page - 1);
  for (int i = 0; i < kGuards; ++i) {
    uintptr_t zero = 0;
    if (g_guards[i].begin.load(std::memory_order_relaxed) != 0) continue;
    // Claim the slot through `end` first, then publish `begin`.
    if (!g_guards[i].end.compare_exchange_strong(zero, e, std::memory_order_acq_rel)) continue;
    g_guards[i].faulted.store(0, std::memory_order_relaxed);
    g_guards[i].begin.store(b, std::memory_order_release);
    return i;
  }
  return -1;  // table full: the mapping is unguarded (a SIGBUS then ends the process as before)
}

void unguard(int i) {
  if (i < 0) return;
  g_guards[i].begin.store(0, std::memory_order_release);
  g_guards[i].end.store(0, std::memory_order_release);
}

int64_t mtime_ns(const struct stat& st) {
  return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}

}  // namespace

uint64_t mapped_file_faults() { return g_faults.load(); }

MappedFile::MappedFile(const std::string& path) : path_(path) {
  fd_ = open_input(path, "file");  // a regular file, or a clear refusal (never blocks)
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    int e = errno;
    ::close(fd_);
    fd_ = -1;
    throw Error(Status::Io, "cannot stat '" + path + "': " + std::strerror(e));
  }
  size_ = static_cast<size_t>(st.st_size);
  mtime_ns_ = mtime_ns(st);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd_, 0);
    if (p == MAP_FAILED) {
      int e = errno;
      ::close(fd_);
      fd_ = -1;
      throw Error(Status::Io, "cannot mmap '" + path + "': " + std::strerror(e));
    }
    data_ = static_cast<const uint8_t*>(p);
    guard_ = guard_mapping(data_, size_);
  }
}

MappedFile::~MappedFile() { reset(); }

MappedFile::MappedFile(MappedFile&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)),
      size_(std::exchange(o.size_, 0)),
      path_(std::move(o.path_)),
      fd_(std::exchange(o.fd_, -1)),
      guard_(std::exchange(o.guard_, -1)),
      mtime_ns_(o.mtime_ns_) {}

MappedFile& MappedFile::operator=(MappedFile&& o) noexcept {
  if (this != &o) {
    reset();
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    path_ = std::move(o.path_);
    fd_ = std::exchange(o.fd_, -1);
    guard_ = std::exchange(o.guard_, -1);
    mtime_ns_ = o.mtime_ns_;
  }
  return *this;
}

void MappedFile::reset() {
  unguard(guard_);
  guard_ = -1;
  if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  data_ = nullptr;
  size_ = 0;
}

bool MappedFile::changed() const noexcept {
  if (fd_ < 0) return false;
  if (guard_ >= 0 && g_guards[guard_].faulted.load(std::memory_order_acquire)) return true;
  struct stat st {};
  if (::fstat(fd_, &st) != 0) return false;
  return static_cast<size_t>(st.st_size) != size_ || mtime_ns(st) != mtime_ns_;
}

void MappedFile::check_unchanged() const {
  if (!changed()) return;
  std::string what;
  struct stat st {};
  if (guard_ >= 0 && g_guards[guard_].faulted.load()) what = "it was truncated (a read past its new end was caught)";
  else if (::fstat(fd_, &st) == 0 && static_cast<size_t>(st.st_size) != size_)
    what = "its size went from " + std::to_string(size_) + " to " + std::to_string(st.st_size) + " bytes";
  else
    what = "it was written in place (its modification time changed)";
  throw Error(Status::FileChanged, "model file '" + path_ + "' changed while in use: " + what +
                                       "; the results computed since are discarded. Write a new file and rename it "
                                       "over the old one instead of changing a file in use");
}

void MappedFile::prefetch(size_t offset, size_t len) const {
  if (!data_ || offset >= size_) return;
  const size_t page = 4096;
  size_t start = offset & ~(page - 1);
  size_t end = std::min(size_, offset + len);
  ::madvise(const_cast<uint8_t*>(data_) + start, end - start, MADV_WILLNEED);
}

void release_mapped_pages(const void* p, size_t n) {
  const uintptr_t page = 4096, a = reinterpret_cast<uintptr_t>(p);
  uintptr_t start = a & ~(page - 1), end = a + n;
  if (end > start) ::madvise(reinterpret_cast<void*>(start), end - start, MADV_DONTNEED);
}

}  // namespace colibri
