// cmd_launch.cpp: colibri launch -n N [--hosts h1,h2 | --hostfile F] [--ucx] [...] -- run ARGS...
//
// Builds the command that starts N ranks of this very executable (/proc/self/exe)
// with ARGS, prints it as one shell-quoted line, and execs it, so the exit status
// is the launcher's own. Outside SLURM the command is Open MPI's `mpirun`; inside a
// SLURM allocation (SLURM_JOB_ID set) it is `srun --mpi=pmix`, or mpirun inside the
// allocation when srun offers no PMIx plugin. See docs/cluster.md.
#include <sched.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "launcher/commands.h"
#include "launcher/options.h"
#include "model/error.h"

extern char** environ;

namespace colibri::cli {

// A word as a POSIX shell reads it back: bare when it holds only safe characters,
// otherwise in single quotes (a quote inside becomes '\'').
std::string shell_quote(const std::string& s) {
  if (!s.empty() && s.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_@%+=:,./-") ==
                        std::string::npos)
    return s;
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

namespace {

bool is_executable(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(p.c_str(), X_OK) == 0;
}

// NAME if it holds a slash, else the first executable NAME in $PATH; "" if none.
std::string find_program(const std::string& name) {
  if (name.find('/') != std::string::npos) return is_executable(name) ? name : "";
  const char* path = std::getenv("PATH");
  std::stringstream ss(path ? path : "/usr/local/bin:/usr/bin:/bin");
  std::string dir;
  while (std::getline(ss, dir, ':')) {
    std::string p = (dir.empty() ? "." : dir) + "/" + name;
    if (is_executable(p)) return p;
  }
  return "";
}

std::string self_exe() {
  std::vector<char> buf(4096);
  ssize_t n = ::readlink("/proc/self/exe", buf.data(), buf.size() - 1);
  if (n <= 0) throw Error(Status::Io, std::string("cannot read /proc/self/exe: ") + std::strerror(errno));
  return std::string(buf.data(), static_cast<size_t>(n));
}

// Physical cores this process may run on (Open MPI's default slot count for the
// local host counts cores, not hardware threads); the CPU count when the topology
// is not readable.
int local_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) != 0) return std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN));
  std::set<std::pair<int, int>> cores;
  int cpus = 0;
  bool topology = true;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (!CPU_ISSET(c, &set)) continue;
    ++cpus;
    const std::string dir = "/sys/devices/system/cpu/cpu" + std::to_string(c) + "/topology/";
    std::ifstream pf(dir + "physical_package_id"), cf(dir + "core_id");
    int pkg = -1, core = -1;
    if (!(pf >> pkg) || !(cf >> core)) topology = false;
    cores.insert({pkg, core});
  }
  if (cpus == 0) return 1;
  return topology ? static_cast<int>(cores.size()) : cpus;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep)) out.push_back(item);
  return out;
}

// The MPI plugins `srun --mpi=list` names (e.g. pmix, pmix_v4, pmi2, none). Slurm
// 22.05 prints "MPI plugin types are...", a tab-indented name a line, and "specific
// pmix plugin versions available: pmix_v4"; older ones print "srun: mpi/pmix" lines.
struct SrunMpi {
  std::set<std::string> names;
  std::string failure;  // why srun --mpi=list gave nothing usable ("" when it ran)
};
SrunMpi srun_mpi_plugins(const std::string& srun) {
  SrunMpi out;
  auto& names = out.names;
  const std::string cmd = shell_quote(srun) + " --mpi=list 2>&1";
  std::FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) {
    out.failure = std::string("cannot run srun --mpi=list: ") + std::strerror(errno);
    return out;
  }
  std::string first_error;
  auto word = [](std::string w) {
    w.erase(0, w.find_first_not_of(" \t\r\n"));
    w.erase(w.find_last_not_of(" \t\r\n") + 1);
    if (w.rfind("mpi/", 0) == 0) w = w.substr(4);
    if (w.empty() ||
        w.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_") != std::string::npos)
      return std::string();
    return w;
  };
  char buf[512];
  while (std::fgets(buf, sizeof buf, p)) {
    std::string l(buf);
    if (first_error.empty() && (l.find("error") != std::string::npos || l.find("fatal") != std::string::npos)) {
      first_error = l.substr(0, l.find_last_not_of("\r\n") + 1);
      continue;
    }
    if (l.rfind("srun:", 0) == 0) l = l.substr(5);
    if (l.find("types are") != std::string::npos) continue;
    if (l.find("versions available") != std::string::npos) {
      for (const auto& w : split(l.substr(l.find(':') + 1), ','))
        if (auto n = word(w); !n.empty()) names.insert(n);
      continue;
    }
    if (auto n = word(l); !n.empty()) names.insert(n);
  }
  const int status = ::pclose(p);
  if (status != 0 || names.empty())
    out.failure = "srun --mpi=list failed" + (first_error.empty() ? std::string() : ": " + first_error);
  return out;
}

// True when `MPIRUN --version` names Open MPI (4.x: "mpirun (Open MPI) 4.1.4";
// 5.x prints the same through prterun).
bool is_open_mpi(const std::string& mpirun) {
  const std::string cmd = shell_quote(mpirun) + " --version 2>&1";
  std::FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return false;
  std::string text;
  char buf[256];
  while (std::fgets(buf, sizeof buf, p)) text += buf;
  ::pclose(p);
  return text.find("Open MPI") != std::string::npos || text.find("OpenRTE") != std::string::npos;
}

struct Mca {
  std::vector<std::pair<std::string, std::string>> kv;
  // Sets KEY to VALUE, replacing an earlier value (Open MPI joins a repeated
  // --mca KEY into a comma list, which is never what is meant here).
  void set(const std::string& k, const std::string& v) {
    for (auto& e : kv)
      if (e.first == k) {
        e.second = v;
        return;
      }
    kv.emplace_back(k, v);
  }
};

std::string join_quoted(const std::vector<std::string>& words) {
  std::string line;
  for (const auto& w : words) {
    if (!line.empty()) line += ' ';
    line += shell_quote(w);
  }
  return line;
}

}  // namespace

int cmd_launch(int argc, char** argv) {
  // Everything after the first "--" is the colibri command line of every rank.
  std::vector<std::string> rank_args;
  int own_argc = argc;
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], "--") == 0) {
      own_argc = i;
      for (int j = i + 1; j < argc; ++j) rank_args.emplace_back(argv[j]);
      break;
    }

  cxxopts::Options o("colibri launch",
                     "Start N ranks of this colibri executable with the arguments after --, through Open MPI's\n"
                     "mpirun, or srun inside a SLURM allocation. Prints the command (one shell-quoted line) and\n"
                     "execs it: the exit status is the command's. Example:\n"
                     "  colibri launch -n 3 -- run --model m.colibri --prompt-ids 1,2,3");
  o.add_options()("n,np", "Number of ranks, 1..65536 (inside SLURM: default $SLURM_NTASKS)", cxxopts::value<int>())(
      "hosts", "Comma-separated hosts, each host or host:slots (a host without slots gets ceil(N/hosts))",
      cxxopts::value<std::string>())("hostfile", "Open MPI hostfile", cxxopts::value<std::string>())(
      "ucx", "Use UCX for point-to-point (--mca pml ucx --mca pml_ucx_tls any --mca pml_ucx_devices any)")(
      "oversubscribe", "Allow more ranks than cores (automatic on the local host)")(
      "mca", "Open MPI parameter KEY=VALUE (repeatable; replaces a default of the same key)",
      cxxopts::value<std::vector<std::string>>())("x,export",
                                                  "Environment variable NAME or NAME=VALUE for the ranks (repeatable)",
                                                  cxxopts::value<std::vector<std::string>>())(
      "launcher-arg", "Extra argument for mpirun or srun, placed before the executable (repeatable)",
      cxxopts::value<std::vector<std::string>>())("launcher", "auto (srun inside SLURM, else mpirun), mpirun or srun",
                                                  cxxopts::value<std::string>()->default_value("auto"))(
      "mpirun", "mpirun program", cxxopts::value<std::string>()->default_value("mpirun"))(
      "srun", "srun program", cxxopts::value<std::string>()->default_value("srun"))(
      "srun-mpi", "srun --mpi plugin; default pmix when srun lists it", cxxopts::value<std::string>())(
      "dry-run", "Print the command, do not run it");
  add_common_options(o);
  auto r = o.parse(own_argc, argv);
  if (handle_common(o, r)) return 0;
  if (!r.unmatched().empty())
    throw Error(Status::InvalidArgument, "launch: unexpected argument '" + r.unmatched().front() +
                                             "' (the command for the ranks goes after --, e.g. -- run --model M)");
  if (rank_args.empty())
    throw Error(Status::InvalidArgument,
                "launch needs the command for the ranks after --, e.g. colibri launch -n 3 -- run --model M.colibri");
  if (r.count("hosts") && r.count("hostfile"))
    throw Error(Status::InvalidArgument, "launch: give --hosts or --hostfile, not both");

  const char* job = std::getenv("SLURM_JOB_ID");
  const bool in_slurm = job && *job;
  const bool explicit_hosts = r.count("hosts") || r.count("hostfile");
  std::string launcher = r["launcher"].as<std::string>();
  if (launcher != "auto" && launcher != "mpirun" && launcher != "srun")
    throw Error(Status::InvalidArgument, "--launcher '" + launcher + "' is not auto, mpirun or srun");
  if (launcher == "srun" && explicit_hosts)
    throw Error(Status::InvalidArgument, "--hosts/--hostfile are for mpirun; srun takes the hosts of the allocation");

  int np = 0;
  if (r.count("np")) {
    np = option_in_range(r, "np", Range<int>{1, kMaxRanks});
  } else if (in_slurm && std::getenv("SLURM_NTASKS")) {
    np = std::atoi(std::getenv("SLURM_NTASKS"));
  } else {
    throw Error(Status::InvalidArgument, "launch needs -n N, the number of ranks");
  }
  if (np < 1) throw Error(Status::InvalidArgument, "launch: -n must be at least 1, got " + std::to_string(np));

  // Which launcher: srun inside an allocation when it has a PMIx plugin (Debian's
  // Open MPI starts under srun only through PMIx; pmi2 and none fail in MPI_Init).
  std::string srun_mpi;
  if (launcher == "auto") launcher = in_slurm && !explicit_hosts ? "srun" : "mpirun";
  if (launcher == "srun") {
    const std::string srun = find_program(r["srun"].as<std::string>());
    std::string why;  // why srun cannot be used
    if (srun.empty()) {
      why = "no srun program found ('" + r["srun"].as<std::string>() + "')";
    } else if (r.count("srun-mpi")) {
      srun_mpi = r["srun-mpi"].as<std::string>();
    } else {
      auto plugins = srun_mpi_plugins(srun);
      if (plugins.names.count("pmix")) {
        srun_mpi = "pmix";
      } else {
        for (const auto& p : plugins.names)
          if (p.rfind("pmix", 0) == 0) srun_mpi = p;
      }
      if (srun_mpi.empty()) {
        if (!plugins.failure.empty()) {
          why = plugins.failure;
        } else {
          std::string list;
          for (const auto& p : plugins.names) list += (list.empty() ? "" : ", ") + p;
          why = "srun has no PMIx MPI plugin (srun --mpi=list: " + list + ")";
        }
      }
    }
    if (!why.empty()) {
      if (r["launcher"].as<std::string>() == "srun")
        throw Error(Status::InvalidArgument, "launch: " + why + "; give --srun-mpi NAME or --launcher mpirun");
      spdlog::warn("launch: {}; using mpirun inside the SLURM allocation (job {})", why, job);
      launcher = "mpirun";
    }
  } else if (in_slurm && !explicit_hosts) {
    spdlog::info("launch: mpirun inside the SLURM allocation (job {}) takes its hosts and slots", job);
  }

  const std::string exe = self_exe();
  const bool root = ::geteuid() == 0;
  const bool want_oversubscribe = r.count("oversubscribe") > 0;

  Mca mca;
  mca.set("mpi_yield_when_idle", "1");  // ranks waiting in MPI give up the core (oversubscribed runs)
  if (r.count("ucx")) {
    mca.set("pml", "ucx");
    mca.set("pml_ucx_tls", "any");
    mca.set("pml_ucx_devices", "any");
  }
  if (r.count("mca"))
    for (const auto& kv : r["mca"].as<std::vector<std::string>>()) {
      auto eq = kv.find('=');
      if (eq == std::string::npos || eq == 0)
        throw Error(Status::InvalidArgument,
                    "--mca '" + kv + "' is not KEY=VALUE (e.g. --mca btl_tcp_if_include=eth0)");
      mca.set(kv.substr(0, eq), kv.substr(eq + 1));
    }
  std::vector<std::string> exports =
      r.count("export") ? r["export"].as<std::vector<std::string>>() : std::vector<std::string>{};
  for (const auto& e : exports)
    if (e.empty() || e[0] == '=') throw Error(Status::InvalidArgument, "-x '" + e + "' is not NAME or NAME=VALUE");
  const std::vector<std::string> extra =
      r.count("launcher-arg") ? r["launcher-arg"].as<std::vector<std::string>>() : std::vector<std::string>{};

  std::vector<std::string> env;  // NAME=VALUE set for the launcher (srun passes its environment on)
  std::vector<std::string> cmd;
  if (launcher == "mpirun") {
    const std::string mpirun = find_program(r["mpirun"].as<std::string>());
    if (mpirun.empty())
      throw Error(Status::InvalidArgument,
                  "launch: no mpirun found ('" + r["mpirun"].as<std::string>() +
                      "'); install Open MPI (apt-get install openmpi-bin) or give --mpirun PATH");
    if (!is_open_mpi(mpirun))
      spdlog::warn("launch: {} does not say it is Open MPI (mpirun --version); the command uses Open MPI's options",
                   mpirun);
    cmd = {mpirun, "-np", std::to_string(np)};
    if (r.count("hosts")) {
      auto hosts = split(r["hosts"].as<std::string>(), ',');
      hosts.erase(std::remove(hosts.begin(), hosts.end(), std::string()), hosts.end());
      if (hosts.empty()) throw Error(Status::InvalidArgument, "--hosts names no host");
      const int per_host = (np + static_cast<int>(hosts.size()) - 1) / static_cast<int>(hosts.size());
      std::string list;
      for (auto& h : hosts)
        list += (list.empty() ? "" : ",") + (h.find(':') == std::string::npos ? h + ":" + std::to_string(per_host) : h);
      cmd.insert(cmd.end(), {"--host", list});
    } else if (r.count("hostfile")) {
      const std::string hf = r["hostfile"].as<std::string>();
      if (::access(hf.c_str(), R_OK) != 0)
        throw Error(Status::InvalidArgument, "--hostfile '" + hf + "' is not readable: " + std::strerror(errno));
      cmd.insert(cmd.end(), {"--hostfile", hf});
    }
    const int cores = local_cores();
    if (want_oversubscribe || (!explicit_hosts && !in_slurm && np > cores)) {
      cmd.push_back("--oversubscribe");
      if (!want_oversubscribe) spdlog::debug("launch: {} ranks on {} local cores: --oversubscribe", np, cores);
    }
    cmd.insert(cmd.end(), {"--bind-to", "none"});
    if (root) cmd.push_back("--allow-run-as-root");  // Open MPI refuses root otherwise (CI, containers)
    for (const auto& [k, v] : mca.kv) cmd.insert(cmd.end(), {"--mca", k, v});
    // Remote ranks see only what -x names: pass on colibri's own variables and the paths.
    if (explicit_hosts)
      for (char** e = environ; *e; ++e) {
        std::string name(*e, std::strchr(*e, '=') ? std::strchr(*e, '=') - *e : std::strlen(*e));
        if (name.rfind("COLIBRI_", 0) == 0 || name == "PATH" || name == "LD_LIBRARY_PATH")
          cmd.insert(cmd.end(), {"-x", name});
      }
    for (const auto& e : exports) cmd.insert(cmd.end(), {"-x", e});
  } else {
    const std::string srun = find_program(r["srun"].as<std::string>());
    // srun starts the ranks with its own environment: MCA parameters travel as OMPI_MCA_*.
    for (const auto& [k, v] : mca.kv) {
      const std::string name = "OMPI_MCA_" + k;
      const char* have = std::getenv(name.c_str());
      if (k == "mpi_yield_when_idle" && have) continue;  // the user's own setting wins over the default
      env.push_back(name + "=" + v);
    }
    for (const auto& e : exports)
      if (e.find('=') != std::string::npos) env.push_back(e);
    cmd = {srun, "--mpi=" + srun_mpi, "-n", std::to_string(np), "--kill-on-bad-exit=1"};
    if (want_oversubscribe) cmd.push_back("--overcommit");
  }
  cmd.insert(cmd.end(), extra.begin(), extra.end());
  cmd.push_back(exe);
  cmd.insert(cmd.end(), rank_args.begin(), rank_args.end());

  std::string line = join_quoted(env);
  if (!line.empty()) line += ' ';
  line += join_quoted(cmd);
  if (r.count("dry-run")) {
    std::printf("%s\n", line.c_str());
    return 0;
  }
  std::fprintf(stderr, "%s\n", line.c_str());
  std::fflush(stdout);
  std::fflush(stderr);

  for (const auto& e : env) {
    auto eq = e.find('=');
    ::setenv(e.substr(0, eq).c_str(), e.substr(eq + 1).c_str(), 1);
  }
  std::vector<char*> args;
  for (auto& a : cmd) args.push_back(a.data());
  args.push_back(nullptr);
  ::execv(cmd[0].c_str(), args.data());
  throw Error(Status::Io, "launch: cannot execute " + cmd[0] + ": " + std::strerror(errno));
}

}  // namespace colibri::cli
