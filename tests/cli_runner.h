// cli_runner.h: runs the colibri executable from a test and captures its exit
// status (or the signal that killed it), stdout and stderr.
#pragma once
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "tests/test_util.h"

extern char** environ;

namespace colibri::test {

struct CliResult {
  bool exited = false;  // false: killed by a signal
  int code = -1;        // exit status, or the signal number when !exited
  std::string out, err;
};

inline std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Runs COLIBRI_EXE with `args`; stdout/stderr go to files in `tmp`.
inline CliResult run_cli(const TempDir& tmp, const std::vector<std::string>& args) {
  const std::string out = tmp.file("cli.out"), err = tmp.file("cli.err");
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&fa, 2, err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  std::vector<std::string> all = {COLIBRI_EXE};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  CliResult r;
  if (posix_spawn(&pid, COLIBRI_EXE, &fa, nullptr, argv.data(), environ) != 0) {
    posix_spawn_file_actions_destroy(&fa);
    r.err = "posix_spawn failed";
    return r;
  }
  posix_spawn_file_actions_destroy(&fa);
  int status = 0;
  waitpid(pid, &status, 0);
  r.exited = WIFEXITED(status);
  r.code = r.exited ? WEXITSTATUS(status) : WTERMSIG(status);
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

}  // namespace colibri::test
