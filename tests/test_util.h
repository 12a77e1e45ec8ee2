// test_util.h: helpers shared by the unit tests: temporary directories, seeded
// random inputs (the seed is printed on failure), fixture paths.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "model/error.h"

#ifdef COLIBRI_HAVE_CUDA
#include "kernels/cuda/device_info.h"
#endif

namespace colibri::test {

inline std::string fixtures_dir() { return COLIBRI_FIXTURES_DIR; }

// A CUDA GPU is usable (never without CUDA in the build; always on the emulator).
inline bool have_gpu() {
#ifdef COLIBRI_HAVE_CUDA
  return cuda::device_count() > 0;
#else
  return false;
#endif
}

// The temporaries an atomic write of PATH leaves beside it while unfinished
// (PATH.tmp.XXXXXX, model/file_io.h): none may remain after it ends.
inline std::vector<std::string> temps_of(const std::string& path) {
  namespace fs = std::filesystem;
  std::vector<std::string> v;
  const fs::path p(path);
  const fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
  const std::string prefix = p.filename().string() + ".tmp";
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.path().filename().string().rfind(prefix, 0) == 0) v.push_back(e.path().string());
  return v;
}
inline bool temp_left(const std::string& path) { return !temps_of(path).empty(); }

// A fresh directory under the system temp dir, removed at scope exit.
class TempDir {
 public:
  TempDir() {
    auto base = std::filesystem::temp_directory_path();
    std::random_device rd;
    path_ = base / ("colibri-test-" + std::to_string(::getpid()) + "-" + std::to_string(rd()));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string path() const { return path_.string(); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

// The seed of a test's random inputs: COLIBRI_TEST_SEED if set, else fresh
// from the clock; recorded in the test's output so a failure can be replayed.
inline uint64_t test_seed() {
  static const uint64_t seed = [] {
    if (const char* s = std::getenv("COLIBRI_TEST_SEED")) return static_cast<uint64_t>(std::stoull(s));
    return static_cast<uint64_t>(std::random_device{}()) ^ (static_cast<uint64_t>(::getpid()) << 32);
  }();
  ::testing::Test::RecordProperty("seed", std::to_string(seed));
  return seed;
}

#define COLIBRI_SEED_TRACE(seed) SCOPED_TRACE("random seed " + std::to_string(seed) + " (rerun with COLIBRI_TEST_SEED=" + std::to_string(seed) + ")")

inline std::vector<float> random_floats(std::mt19937_64& rng, size_t n, float lo = -1.f, float hi = 1.f) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// Runs `fn` and requires it to throw colibri::Error with `status` and a message
// containing every string in `needles`.
inline void expect_error(const std::function<void()>& fn, Status status, const std::vector<std::string>& needles) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_STREQ(status_name(e.status()), status_name(status)) << "message: " << e.what();
    for (const auto& n : needles)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << "message '" << e.what() << "' lacks '" << n << "'";
    return;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw a non-colibri exception: " << e.what();
    return;
  }
  ADD_FAILURE() << "did not throw (expected an error mentioning '" << (needles.empty() ? "" : needles.front()) << "')";
}

}  // namespace colibri::test
