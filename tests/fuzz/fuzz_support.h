// fuzz_support.h: what the libFuzzer targets share: the input as a file (a
// memfd reused for every input, so no fd or file is left behind), and the rule
// that colibri::Error is the only acceptable way for a parser to fail.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <typeinfo>

#include "model/error.h"

namespace colibri::fuzz {

// One file per process holding the current input, reachable by path
// (/proc/self/fd/N of a memfd; a file under $TMPDIR where memfd is missing).
class InputFile {
 public:
  static InputFile& get();
  // Replaces the contents with data[0, size); the file is then `file_size`
  // bytes long (zeros after the data, a sparse tail) when that is larger.
  void set(const uint8_t* data, size_t size, size_t file_size = 0);
  const std::string& path() const { return path_; }

 private:
  InputFile();
  int fd_ = -1;
  std::string path_;
};

// The lowest free file descriptor: taken before a parser runs and checked
// after it (check_no_fd_leak), it shows a descriptor the parser left open.
// NOTE: not once at start-up: libFuzzer opens pipes to llvm-symbolizer between
// inputs when it reports new coverage.
int lowest_free_fd();
void check_no_fd_leak(int lowest_free_before);

// Aborts with a message: libFuzzer reports it as a crash and keeps the input.
[[noreturn]] void finding(const char* what, const std::string& detail);

// Invariant that must hold for anything a parser accepted.
#define FUZZ_CHECK(cond, detail)                                                   \
  do {                                                                             \
    if (!(cond)) ::colibri::fuzz::finding("invariant failed: " #cond, (detail)); \
  } while (0)

// The readable name of an exception's type.
std::string type_name(const std::type_info& t);

// COLIBRI_FUZZ_VERBOSE=1: the targets say what each parser did with each input
// (for checking that the seeds reach the deep paths; off while fuzzing).
bool verbose();
void note(const char* what, bool accepted);

// Runs fn(); a colibri::Error is an expected outcome (returns false), any other
// exception is a finding. Returns true when fn() returned normally.
template <typename Fn>
bool expect_only_colibri_errors(const char* what, Fn&& fn) {
  try {
    fn();
    note(what, true);
    return true;
  } catch (const colibri::Error& e) {
    if (verbose()) std::fprintf(stderr, "  %s: rejected: %s\n", what, e.what());
    return false;
  } catch (const std::exception& e) {
    finding(what, std::string("escaped exception ") + type_name(typeid(e)) + ": " + e.what());
  } catch (...) {
    finding(what, "escaped a non-std exception");
  }
}

// Little-endian integer at p (the input may be unaligned).
uint64_t load_le64(const uint8_t* p);

}  // namespace colibri::fuzz
