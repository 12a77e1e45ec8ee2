// commands.h: the subcommands of the colibri executable.
#pragma once
#include <initializer_list>
#include <string>
#include <vector>

// NOTE: repeated options keep commas (--prompt-ids 1,2,3 is one prompt).
#define CXXOPTS_VECTOR_DELIMITER '\x1f'
#include <cxxopts.hpp>

namespace colibri::cli {

int cmd_convert(int argc, char** argv);
int cmd_inspect(int argc, char** argv);
int cmd_synth(int argc, char** argv);
int cmd_generate(int argc, char** argv);
int cmd_run(int argc, char** argv);
int cmd_launch(int argc, char** argv);
int cmd_place(int argc, char** argv);
int cmd_stats(int argc, char** argv);
int cmd_cache_sim(int argc, char** argv);
int cmd_simulate(int argc, char** argv);
int cmd_bench(int argc, char** argv);
int cmd_batch(int argc, char** argv);

// A word as a POSIX shell reads it back (quoted only when it must be).
std::string shell_quote(const std::string& s);

// Adds --verbose/--log-level/--help to a subcommand's options.
void add_common_options(cxxopts::Options& o);
// Applies the common options; returns true when --help was printed.
bool handle_common(const cxxopts::Options& o, const cxxopts::ParseResult& r);

// The file paths given to these options (absent options skipped; a repeatable
// option gives every value), e.g. a command's inputs for check_output().
std::vector<std::string> option_paths(const cxxopts::ParseResult& r, std::initializer_list<const char*> single,
                                      std::initializer_list<const char*> repeated = {});
// Refuses, before any work, an output option's path that is one of `inputs` or
// an existing non-regular file (model/file_io.h check_output), and two output
// options naming the same file. `outputs`: option names; absent ones skipped.
void check_output_options(const cxxopts::ParseResult& r, std::initializer_list<const char*> outputs,
                          const std::vector<std::string>& inputs);

// Progress on stderr: a rewritten line on a terminal, a line per quarter otherwise.
class Progress {
 public:
  explicit Progress(std::string what) : what_(std::move(what)) {}
  void update(uint64_t done, uint64_t total);
  void finish();

 private:
  std::string what_;
  int last_decile_ = -1;
};

}  // namespace colibri::cli
