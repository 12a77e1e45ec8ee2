// main.cpp: the colibri executable: dispatches to subcommands and turns errors
// into messages and exit codes (the only place that does).
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <cstring>
#include <string>

#include "kernels/cpu/kernels.h"
#include "launcher/commands.h"
#include "model/error.h"
#include "model/file_io.h"
#include "model/printable.h"

namespace colibri::cli {

void add_common_options(cxxopts::Options& o) {
  o.add_options("common")("v,verbose", "Log more (debug level)")(
      "log-level", "Log level: trace, debug, info, warn, error, off", cxxopts::value<std::string>()->default_value("info"))(
      "h,help", "Show this help");
}

bool handle_common(const cxxopts::Options& o, const cxxopts::ParseResult& r) {
  if (r.count("help")) {
    std::printf("%s\n", o.help().c_str());
    return true;
  }
  const std::string name = r["log-level"].as<std::string>();
  auto lvl = spdlog::level::from_str(name);
  if (lvl == spdlog::level::off && name != "off")
    throw colibri::Error(colibri::Status::InvalidArgument,
                         "unknown --log-level '" + name + "' (trace, debug, info, warn, error, critical, off)");
  if (r.count("verbose")) lvl = spdlog::level::debug;
  spdlog::set_level(lvl);
  return false;
}

std::vector<std::string> option_paths(const cxxopts::ParseResult& r, std::initializer_list<const char*> single,
                                      std::initializer_list<const char*> repeated) {
  std::vector<std::string> v;
  for (const char* n : single)
    if (r.count(n)) v.push_back(r[n].as<std::string>());
  for (const char* n : repeated)
    if (r.count(n))
      for (const auto& x : r[n].as<std::vector<std::string>>()) v.push_back(x);
  return v;
}

void check_output_options(const cxxopts::ParseResult& r, std::initializer_list<const char*> outputs,
                          const std::vector<std::string>& inputs) {
  std::vector<std::string> seen;  // the outputs checked so far: two must not be one file
  for (const char* n : outputs) {
    if (!r.count(n)) continue;
    const std::string out = r[n].as<std::string>();
    check_output(out, inputs, "--" + std::string(n));
    for (const std::string& s : seen) {
      if (s == out || same_file(s, out))
        throw colibri::Error(colibri::Status::InvalidArgument,
                             "--" + std::string(n) + " '" + out + "' is also the output of another option ('" + s + "')");
    }
    seen.push_back(out);
  }
}

void Progress::update(uint64_t done, uint64_t total) {
  if (total == 0) return;
  int pct = static_cast<int>(100.0 * done / total);
  if (isatty(STDERR_FILENO)) {
    std::fprintf(stderr, "\r%s: %3d%% (%.1f / %.1f MiB)", what_.c_str(), pct, done / 1048576.0, total / 1048576.0);
    std::fflush(stderr);
    last_decile_ = 0;
  } else if (pct / 25 != last_decile_) {
    last_decile_ = pct / 25;
    spdlog::info("{}: {}% ({:.1f} / {:.1f} MiB)", what_, pct, done / 1048576.0, total / 1048576.0);
  }
}

void Progress::finish() {
  if (isatty(STDERR_FILENO) && last_decile_ >= 0) std::fprintf(stderr, "\n");
}

}  // namespace colibri::cli

namespace {

struct Command {
  const char* name;
  int (*fn)(int, char**);
  const char* help;
};

const Command kCommands[] = {
    {"synth", colibri::cli::cmd_synth, "write a Hugging Face-format model with seeded random weights"},
    {"convert", colibri::cli::cmd_convert, "convert a Hugging Face checkpoint directory to a .colibri file"},
    {"inspect", colibri::cli::cmd_inspect, "show (and verify) a .colibri file"},
    {"generate", colibri::cli::cmd_generate, "generate tokens from prompts of token ids (one process)"},
    {"run", colibri::cli::cmd_run, "generate as an expert-parallel cluster (under mpirun: rank 0 coordinates)"},
    {"batch", colibri::cli::cmd_batch, "offline inference over a JSONL file of OpenAI Batch API requests (resumable)"},
    {"launch", colibri::cli::cmd_launch, "build and run the mpirun (or srun) command for a cluster run"},
    {"place", colibri::cli::cmd_place, "make an expert placement (which ranks own which experts)"},
    {"stats", colibri::cli::cmd_stats, "aggregate a routing trace into expert-load statistics"},
    {"cache-sim", colibri::cli::cmd_cache_sim, "replay a routing trace through the expert-cache policies"},
    {"simulate", colibri::cli::cmd_simulate, "project step time of an expert-parallel cluster (roofline + alpha-beta)"},
    {"bench", colibri::cli::cmd_bench, "measure generation speed, memory bandwidth or peak FMA throughput"},
};

void usage(std::FILE* f) {
  std::fprintf(f, "colibri %s: expert-parallel inference for Mixture-of-Experts models\n\n", COLIBRI_VERSION);
  std::fprintf(f, "usage: colibri <command> [options]   (colibri <command> --help for its options)\n\ncommands:\n");
  for (const auto& c : kCommands) std::fprintf(f, "  %-10s %s\n", c.name, c.help);
  std::fprintf(f, "\nexit codes: 0 ok, 2 usage, 11 invalid argument, 12 i/o, 13 malformed file, 14 checksum,\n"
                  "            15 unsupported, 16 out of memory, 17 communication, 18 cancelled, 19 internal,\n"
                  "            20 numerical failure, 21 model file changed while in use, 130/143 stopped by SIGINT/SIGTERM\n");
}

}  // namespace

int main(int argc, char** argv) {
  auto logger = spdlog::stderr_color_mt("colibri");
  spdlog::set_default_logger(logger);
  spdlog::set_pattern("[%H:%M:%S.%e] [%^%l%$] %v");
  if (argc < 2) {
    usage(stderr);
    return 2;
  }
  std::string cmd = argv[1];
  if (cmd == "-h" || cmd == "--help" || cmd == "help") {
    usage(stdout);
    return 0;
  }
  if (cmd == "--version") {
    std::printf("colibri %s\n", COLIBRI_VERSION);
    // The architecture built for and its CPU kernel tables (only "generic" off x86-64).
#if defined(__x86_64__)
    const char* arch = "x86_64";
#elif defined(__aarch64__)
    const char* arch = "aarch64";
#else
    const char* arch = "other";
#endif
    std::printf("built for %s; CPU kernels: %s; in use: %s\n", arch,
                COLIBRI_X86_KERNELS ? "generic avx2 avx512" : "generic", colibri::kernels::active().name);
    return 0;
  }
  for (const auto& c : kCommands) {
    if (cmd != c.name) continue;
    try {
      return c.fn(argc - 1, argv + 1);
    } catch (const colibri::Error& e) {
      // NOTE: messages quote strings from files (tensor names...): no raw control bytes on the terminal.
      spdlog::error("{}", colibri::terminal_safe(e.what()));
      return colibri::exit_code(e.status());
    } catch (const cxxopts::exceptions::exception& e) {
      spdlog::error("{} (see colibri {} --help)", colibri::terminal_safe(e.what()), c.name);
      return 2;
    } catch (const std::filesystem::filesystem_error& e) {
      spdlog::error("{}", colibri::terminal_safe(e.what()));
      return colibri::exit_code(colibri::Status::Io);
    } catch (const std::bad_alloc&) {
      spdlog::error("out of memory");
      return colibri::exit_code(colibri::Status::OutOfMemory);
    } catch (const std::exception& e) {
      spdlog::error("internal error: {}", colibri::terminal_safe(e.what()));
      return colibri::exit_code(colibri::Status::Internal);
    }
  }
  std::fprintf(stderr, "colibri: unknown command '%s'\n\n", cmd.c_str());
  usage(stderr);
  return 2;
}
