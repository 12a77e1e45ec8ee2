// test_hardening.cpp: the library side of issue 16's promises (docs/reliability.md,
// "Careless use"): checked inputs (a FIFO never blocks, a directory is named),
// outputs that never replace an input or a special file and are written through
// unique temporaries, a model file truncated or rewritten during generate()
// (GenerationError with the tokens so far; the C API's status and partial
// tokens), and non-finite logits (Status::Numerical). tests/hardening_test.sh
// proves the same through the command line.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "colibri.h"
#include "comm/communicator.h"
#include "coordinator/engine.h"
#include "model/colibri_file.h"
#include "model/converter.h"
#include "model/error.h"
#include "model/file_io.h"
#include "model/mapped_file.h"
#include "model/synth.h"
#include "tests/test_util.h"

namespace colibri {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

std::string slurp(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}
void spit(const std::string& p, const std::string& s) { std::ofstream(p, std::ios::binary) << s; }

template <class F>
Error error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e;
  }
  ADD_FAILURE() << "no error was thrown";
  return Error(Status::Ok, "");
}

TEST(FileIo, OutputThatIsAnInputOrASpecialFileIsRefused) {
  TempDir d;
  const std::string in = d.file("in.bin"), other = d.file("other.bin");
  spit(in, "input bytes");
  spit(other, "other");
  fs::create_symlink(in, d.file("sym"));
  fs::create_hard_link(in, d.file("hard"));
  ASSERT_EQ(::mkfifo(d.file("fifo").c_str(), 0600), 0);
  fs::create_directories(d.file("dir"));
  for (const char* out : {"in.bin", "sym", "hard"}) {
    SCOPED_TRACE(out);
    const Error e = error_of([&] { check_output(d.file(out), {other, in}, "test"); });
    EXPECT_EQ(e.status(), Status::InvalidArgument);
    EXPECT_NE(std::string(e.what()).find(in), std::string::npos) << e.what();    // names the input
    EXPECT_NE(std::string(e.what()).find(d.file(out)), std::string::npos) << e.what();  // and the output
  }
  for (const auto& [name, kind] : {std::pair<const char*, const char*>{"fifo", "a FIFO"}, {"dir", "a directory"}}) {
    const char* out = name;  // NOTE: Clang 14 cannot capture a structured binding in a lambda
    const Error e = error_of([&] { check_output(d.file(out), {in}, "test"); });
    EXPECT_EQ(e.status(), Status::InvalidArgument);
    EXPECT_NE(std::string(e.what()).find(kind), std::string::npos) << e.what();
  }
  if (::getuid() == 0 && ::mknod(d.file("null").c_str(), S_IFCHR | 0666, makedev(1, 3)) == 0) {
    const Error e = error_of([&] { check_output(d.file("null"), {}, "test"); });
    EXPECT_NE(std::string(e.what()).find("a character device"), std::string::npos) << e.what();
    EXPECT_TRUE(fs::is_character_file(d.file("null")));
  }
  // A new path, or an existing regular file that is no input, is fine.
  EXPECT_NO_THROW(check_output(d.file("new.bin"), {in}, "test"));
  EXPECT_NO_THROW(check_output(other, {in}, "test"));
  EXPECT_EQ(slurp(in), "input bytes");
}

TEST(FileIo, FifoAndDirectoryInputsAreRefusedWithoutBlocking) {
  TempDir d;
  ASSERT_EQ(::mkfifo(d.file("fifo").c_str(), 0600), 0);
  fs::create_directories(d.file("dir"));
  // NOTE: a blocking open of a FIFO would hang here; ctest's timeout then fails the test.
  for (const auto& [path, kind] : {std::pair<std::string, const char*>{d.file("fifo"), "a FIFO"}, {d.file("dir"), "a directory"}}) {
    const std::string& p = path;  // NOTE: Clang 14 cannot capture a structured binding in a lambda
    SCOPED_TRACE(p);
    for (auto f : std::vector<std::function<void()>>{[&] { read_input(p, "thing"); }, [&] { check_input(p, "thing"); },
                                                      [&] { MappedFile m(p); }, [&] { ColibriFile::open(p); }}) {
      const Error e = error_of(f);
      EXPECT_EQ(e.status(), Status::Io);
      EXPECT_NE(std::string(e.what()).find(kind), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
    }
  }
  spit(d.file("ok.txt"), "text");
  EXPECT_EQ(read_input(d.file("ok.txt")), "text");
}

TEST(FileIo, AtomicOutputsUseUniqueTemporaries) {
  TempDir d;
  const std::string out = d.file("out.bin");
  spit(out, "old");
  {
    AtomicOutput a(out), b(out);
    EXPECT_NE(a.temp_path(), b.temp_path());
    EXPECT_EQ(test::temps_of(out).size(), 2u);
    a.write("from a");
    b.write("from b");
    b.commit();
    EXPECT_EQ(slurp(out), "from b");
    // a is destroyed uncommitted: its temporary goes, b's file stays.
  }
  EXPECT_EQ(slurp(out), "from b");
  EXPECT_FALSE(test::temp_left(out));
  struct stat st {};
  ASSERT_EQ(::stat(out.c_str(), &st), 0);
  EXPECT_NE(st.st_mode & 0044, 0u) << "an output is readable like any file";
  // A FIFO that appears at PATH while it is written is not replaced.
  const std::string f = d.file("late");
  AtomicOutput c(f);
  c.write("x");
  ASSERT_EQ(::mkfifo(f.c_str(), 0600), 0);
  EXPECT_EQ(error_of([&] { c.commit(); }).status(), Status::InvalidArgument);
  EXPECT_TRUE(fs::is_fifo(f));
  EXPECT_FALSE(test::temp_left(f));
}

// A tiny synthetic model converted into `dir`, and greedy tokens of a prompt.
struct Tiny {
  std::string path;
  std::vector<int32_t> prompt = {1, 2, 3, 4};
};
Tiny make_tiny(const TempDir& d, const std::string& name, uint64_t seed) {
  SynthOptions so;
  so.seed = seed;
  synthesize_model(d.file(name + "-hf"), so);
  Tiny t;
  t.path = d.file(name + ".colibri");
  convert_checkpoint(d.file(name + "-hf"), t.path, ConvertOptions{});
  return t;
}

std::vector<int32_t> generate_alone(const std::string& path, const std::vector<int32_t>& prompt, int n) {
  auto comm = make_local_communicator();
  Engine e(ColibriFile::open(path), EngineOptions{}, *comm);
  Request r;
  r.prompt = prompt;
  r.max_new_tokens = n;
  r.ignore_eos = true;
  return e.generate({r}, GenerateOptions{})[0].tokens;
}

// The model file is changed from the token callback after `at` tokens; the
// next forward pass must end the call with FileChanged and the tokens so far.
void expect_change_caught(const std::function<void(const std::string&)>& change, const char* needle) {
  TempDir d;
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Tiny t = make_tiny(d, "m", seed);
  const std::vector<int32_t> full = generate_alone(t.path, t.prompt, 12);
  auto comm = make_local_communicator();
  Engine e(ColibriFile::open(t.path), EngineOptions{}, *comm);
  Request r;
  r.prompt = t.prompt;
  r.max_new_tokens = 12;
  r.ignore_eos = true;
  GenerateOptions go;
  const int at = 5;
  int seen = 0;
  go.on_token = [&](int, int, int32_t) {
    if (++seen == at) change(t.path);
    return true;
  };
  try {
    e.generate({r}, go);
    FAIL() << "the change went unnoticed";
  } catch (const GenerationError& g) {
    EXPECT_EQ(g.status(), Status::FileChanged);
    EXPECT_NE(std::string(g.what()).find(t.path), std::string::npos) << g.what();
    EXPECT_NE(std::string(g.what()).find(needle), std::string::npos) << g.what();
    ASSERT_EQ(g.partial().size(), 1u);
    EXPECT_EQ(g.partial()[0].finish_reason, "error");
    const std::vector<int32_t> want(full.begin(), full.begin() + at);
    EXPECT_EQ(g.partial()[0].tokens, want) << "the tokens before the change, none after";
  }
  // The engine stays failed: the file is not what it was.
  EXPECT_EQ(error_of([&] { e.generate({r}, GenerateOptions{}); }).status(), Status::FileChanged);
}

TEST(FileChange, TruncatedDuringGenerateEndsWithTheTokensSoFar) {
  // NOTE: cut to 8 KiB, so that the next pass reads dense weights past the end.
  expect_change_caught([](const std::string& p) { fs::resize_file(p, 8192); }, "truncated");
  EXPECT_GT(mapped_file_faults(), 0u) << "the read past the end was caught by the SIGBUS guard";
}

TEST(FileChange, RewrittenInPlaceDuringGenerateIsNoticed) {
  expect_change_caught(
      [](const std::string& p) {
        // The same byte written back: the contents are equal, but the file was written.
        const int fd = ::open(p.c_str(), O_RDWR);
        ASSERT_GE(fd, 0);
        char c = 0;
        ASSERT_EQ(::pread(fd, &c, 1, 4096), 1);
        ::usleep(2000);  // a later modification time even on coarse clocks
        ASSERT_EQ(::pwrite(fd, &c, 1, 4096), 1);
        ::close(fd);
      },
      "written in place");
}

TEST(FileChange, ReplacingTheFileByARenameIsSafe) {
  TempDir d;
  const Tiny t = make_tiny(d, "m", 11), u = make_tiny(d, "u", 12);
  const std::vector<int32_t> full = generate_alone(t.path, t.prompt, 8);
  auto comm = make_local_communicator();
  Engine e(ColibriFile::open(t.path), EngineOptions{}, *comm);
  fs::rename(u.path, t.path);  // the mapping keeps the old file
  Request r;
  r.prompt = t.prompt;
  r.max_new_tokens = 8;
  r.ignore_eos = true;
  EXPECT_EQ(e.generate({r}, GenerateOptions{})[0].tokens, full);
}

TEST(FileChange, CApiReturnsFileChangedWithThePartialTokens) {
  TempDir d;
  const Tiny t = make_tiny(d, "m", 21);
  const std::vector<int32_t> full = generate_alone(t.path, t.prompt, 10);
  colibri_model* m = nullptr;
  ASSERT_EQ(colibri_init(t.path.c_str(), nullptr, &m), COLIBRI_OK) << colibri_last_error();
  struct Ctx {
    std::string path;
    int n = 0;
  } ctx{t.path};
  auto cb = [](void* u, int32_t, int32_t, int32_t) {
    auto* c = static_cast<Ctx*>(u);
    if (++c->n == 4) fs::resize_file(c->path, 8192);
    return 0;
  };
  const int32_t* prompts[] = {t.prompt.data()};
  const int32_t lens[] = {static_cast<int32_t>(t.prompt.size())};
  colibri_sampling s = colibri_default_sampling();
  s.max_new_tokens = 10;
  s.ignore_eos = 1;
  std::vector<int32_t> toks(10, -1);
  int32_t count = -1;
  EXPECT_EQ(colibri_generate(m, prompts, lens, 1, &s, cb, &ctx, toks.data(), &count), COLIBRI_ERR_FILE_CHANGED);
  EXPECT_NE(std::string(colibri_last_error()).find(t.path), std::string::npos) << colibri_last_error();
  ASSERT_EQ(count, 4);
  EXPECT_EQ(std::vector<int32_t>(toks.begin(), toks.begin() + 4), std::vector<int32_t>(full.begin(), full.begin() + 4));
  EXPECT_EQ(toks[4], -1) << "nothing written past the count";
  // The handle stays failed (it holds the old mapping of a changed file).
  EXPECT_EQ(colibri_generate(m, prompts, lens, 1, &s, nullptr, nullptr, nullptr, nullptr), COLIBRI_ERR_FILE_CHANGED);
  colibri_free(m);
  EXPECT_STREQ(colibri_status_string(COLIBRI_ERR_FILE_CHANGED), "model file changed while in use");
}

TEST(Numerics, NonFiniteWeightsAreRefusedAndNonFiniteLogitsEndTheRun) {
  TempDir d;
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  SynthOptions so;
  so.seed = seed;
  synthesize_model(d.file("hf"), so);
  // A NaN in the first layer's query projection (its bytes found through the reader).
  {
    std::string bytes = slurp(d.file("hf/model.safetensors"));
    uint64_t hl = 0;
    std::memcpy(&hl, bytes.data(), 8);
    const std::string header = bytes.substr(8, hl);
    const std::string key = "\"model.layers.0.self_attn.q_proj.weight\":{\"data_offsets\":[";
    const size_t at = header.find(key);
    ASSERT_NE(at, std::string::npos);
    const size_t begin = std::stoull(header.substr(at + key.size()));
    std::mt19937 rng(static_cast<uint32_t>(seed));
    const size_t elem = std::uniform_int_distribution<size_t>(0, 127)(rng);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::memcpy(&bytes[8 + hl + begin + 4 * elem], &nan, 4);
    spit(d.file("hf/model.safetensors"), bytes);
    const Error e = error_of([&] { convert_checkpoint(d.file("hf"), d.file("m.colibri"), ConvertOptions{}); });
    EXPECT_EQ(e.status(), Status::Numerical);
    EXPECT_NE(std::string(e.what()).find("element " + std::to_string(elem)), std::string::npos) << e.what();
    EXPECT_FALSE(fs::exists(d.file("m.colibri")));
    EXPECT_FALSE(test::temp_left(d.file("m.colibri")));
  }
  ConvertOptions co;
  co.allow_non_finite = true;
  convert_checkpoint(d.file("hf"), d.file("m.colibri"), co);
  auto comm = make_local_communicator();
  Engine e(ColibriFile::open(d.file("m.colibri")), EngineOptions{}, *comm);
  Request r;
  r.prompt = {5, 6, 7};
  r.max_new_tokens = 4;
  try {
    e.generate({r}, GenerateOptions{});
    FAIL() << "NaN logits gave tokens";
  } catch (const GenerationError& g) {
    EXPECT_EQ(g.status(), Status::Numerical);
    EXPECT_NE(std::string(g.what()).find("not finite"), std::string::npos) << g.what();
    EXPECT_TRUE(g.partial()[0].tokens.empty());
  }
  EngineOptions eo;
  eo.check_numerics = true;
  Engine dbg(ColibriFile::open(d.file("m.colibri")), eo, *comm);
  const Error g = error_of([&] { dbg.generate({r}, GenerateOptions{}); });
  EXPECT_NE(std::string(g.what()).find("attention output of layer 0"), std::string::npos) << g.what();
  // The C API: the status for numerical failure.
  colibri_model* m = nullptr;
  ASSERT_EQ(colibri_init(d.file("m.colibri").c_str(), nullptr, &m), COLIBRI_OK) << colibri_last_error();
  const int32_t* prompts[] = {r.prompt.data()};
  const int32_t lens[] = {3};
  int32_t count = -1;
  EXPECT_EQ(colibri_generate(m, prompts, lens, 1, nullptr, nullptr, nullptr, nullptr, &count), COLIBRI_ERR_NUMERICAL);
  EXPECT_EQ(count, 0);
  colibri_free(m);
}

}  // namespace
}  // namespace colibri
