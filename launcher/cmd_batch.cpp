// cmd_batch.cpp: colibri batch: offline inference over a JSONL file of requests
// in the OpenAI Batch API format (docs/batch.md). The requests go through the
// continuous-batching scheduler (coordinator/scheduler.h) in input order; each
// result is appended to the output as one line, with one write() and an fsync,
// as soon as it finishes, so a killed job loses at most the requests in flight.
// A rerun on the same output skips every custom_id already written (SLURM
// --requeue). One process, or an expert-parallel cluster under mpirun/srun
// (rank 0 coordinates, the other ranks serve experts).
#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <nlohmann/json.hpp>

#include "coordinator/engine.h"
#include "coordinator/scheduler.h"
#include "kernels/cpu/kernels.h"
#include "launcher/cluster_setup.h"
#include "launcher/commands.h"
#include "launcher/options.h"
#include "launcher/signals.h"
#include "model/chat_template.h"
#include "model/colibri_file.h"
#include "model/error.h"
#include "model/file_io.h"
#include "model/text.h"

namespace colibri::cli {

namespace {

using ojson = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

constexpr int64_t kDefaultMaxContext = 4096;  // --max-context 0: the model's, at most this
constexpr int32_t kDefaultCompletionTokens = 16;  // /v1/completions without max_tokens (OpenAI's default)

// A bad input line: the error record's code and message.
struct LineError {
  std::string code, message, param;
};

// One request read from the input and accepted.
struct Job {
  int64_t line = 0;
  std::string custom_id;
  bool chat = false;
  std::string model;
  bool return_ids = false;
  std::vector<int32_t> prompt;  // with return_ids
  int64_t prompt_len = 0;
  std::unique_ptr<StopTextStream> text;  // null without a tokenizer
};

std::string batch_hex64(uint64_t v) {
  char b[17];
  std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(v));
  return b;
}

// A stable id for a custom_id's records (FNV-1a), so that a rerun writes the same ids.
std::string record_hash(const std::string& custom_id) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : custom_id) h = (h ^ c) * 1099511628211ull;
  // splitmix64's finaliser: ids of similar custom_ids look unrelated.
  h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
  h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
  return batch_hex64(h ^ (h >> 31));
}

// The output file: created if absent, appended to; one write() per line.
class ResultFile {
 public:
  explicit ResultFile(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd_ < 0) throw Error(Status::Io, "cannot open --output '" + path + "' for appending: " + std::strerror(errno));
  }
  ~ResultFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  ResultFile(const ResultFile&) = delete;
  ResultFile& operator=(const ResultFile&) = delete;
  void write_line(const ojson& j) {
    // NOTE: invalid UTF-8 in generated text (a token cut inside a character is
    // held back, but a model can emit any bytes) is replaced, never refused.
    std::string s = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
    const ssize_t n = ::write(fd_, s.data(), s.size());
    if (n != static_cast<ssize_t>(s.size()))
      throw Error(Status::Io, "writing --output '" + path_ + "' failed: " + (n < 0 ? std::strerror(errno) : "short write"));
    dirty_ = true;
  }
  void sync() {
    if (dirty_ && ::fsync(fd_) != 0) throw Error(Status::Io, "fsync of --output '" + path_ + "' failed: " + std::strerror(errno));
    dirty_ = false;
  }

 private:
  std::string path_;
  int fd_ = -1;
  bool dirty_ = false;
};

// What an existing output already holds (resume).
struct Done {
  std::unordered_set<std::string> ids;       // custom_ids with a record
  std::unordered_set<std::string> dup_ids;   // custom_ids with a duplicate_custom_id record
  std::unordered_set<int64_t> lines;         // input lines without a readable custom_id that have a record
  int64_t records = 0;
};

// Reads the output of an earlier run, truncating a torn last line (a kill in
// the middle of a write) away first.
Done scan_output(const std::string& path) {
  Done d;
  struct stat st{};
  if (::stat(path.c_str(), &st) != 0) return d;  // a new output
  std::string data = read_input(path, "--output");
  const size_t end = data.rfind('\n');
  const size_t keep = end == std::string::npos ? 0 : end + 1;
  if (keep != data.size()) {
    spdlog::warn("--output '{}': removing a torn last line of {} bytes (an interrupted write)", path, data.size() - keep);
    if (::truncate(path.c_str(), static_cast<off_t>(keep)) != 0)
      throw Error(Status::Io, "cannot truncate the torn last line of --output '" + path + "': " + std::strerror(errno));
    data.resize(keep);
  }
  size_t pos = 0;
  int64_t n = 0;
  while (pos < data.size()) {
    const size_t nl = data.find('\n', pos);
    const std::string_view line(data.data() + pos, nl - pos);
    pos = nl + 1;
    ++n;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    ojson j = ojson::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object()) {
      spdlog::warn("--output '{}' line {} is not a JSON object: ignored", path, n);
      continue;
    }
    ++d.records;
    const ojson* err = j.contains("error") && j["error"].is_object() ? &j["error"] : nullptr;
    if (j.contains("custom_id") && j["custom_id"].is_string()) {
      const std::string id = j["custom_id"].get<std::string>();
      if (err && err->value("code", std::string()) == "duplicate_custom_id")
        d.dup_ids.insert(id);
      else
        d.ids.insert(id);
    } else if (err && err->contains("line") && (*err)["line"].is_number_integer()) {
      d.lines.insert((*err)["line"].get<int64_t>());
    }
  }
  return d;
}

// The error record of a bad line (OpenAI's shape: a 400 response with an
// error body when the line had a custom_id, and the error itself).
ojson error_record(const std::optional<std::string>& custom_id, int64_t line, const LineError& e) {
  ojson rec = ojson::object();
  const std::string h = record_hash(custom_id ? *custom_id : "line:" + std::to_string(line));
  rec["id"] = "batch_req_" + h;
  rec["custom_id"] = custom_id ? ojson(*custom_id) : ojson(nullptr);
  if (custom_id) {
    ojson body = {{"error", {{"message", e.message},
                             {"type", "invalid_request_error"},
                             {"param", e.param.empty() ? ojson(nullptr) : ojson(e.param)},
                             {"code", e.code}}}};
    rec["response"] = {{"status_code", 400}, {"request_id", "req_" + h}, {"body", std::move(body)}};
  } else {
    rec["response"] = nullptr;
  }
  rec["error"] = {{"code", e.code}, {"message", e.message}, {"line", line}};
  return rec;
}

[[noreturn]] void bad(std::string code, std::string message, std::string param = {}) {
  throw LineError{std::move(code), std::move(message), std::move(param)};
}

// A JSON number as an integer in [lo, hi], or a LineError naming the field.
int64_t int_field(const ojson& v, const char* name, int64_t lo, int64_t hi) {
  if (!v.is_number_integer() && !(v.is_number_float() && std::floor(v.get<double>()) == v.get<double>()))
    bad("invalid_type", std::string("'") + name + "' must be an integer", name);
  const double d = v.get<double>();
  if (d < static_cast<double>(lo) || d > static_cast<double>(hi))
    bad("invalid_value", std::string("'") + name + "' " + v.dump() + " is out of range [" + std::to_string(lo) + ", " +
                             std::to_string(hi) + "]",
        name);
  return v.is_number_unsigned() ? static_cast<int64_t>(v.get<uint64_t>()) : v.get<int64_t>();
}

double num_field(const ojson& v, const char* name) {
  if (!v.is_number()) bad("invalid_type", std::string("'") + name + "' must be a number", name);
  return v.get<double>();
}

bool bool_field(const ojson& v, const char* name) {
  if (!v.is_boolean()) bad("invalid_type", std::string("'") + name + "' must be true or false", name);
  return v.get<bool>();
}

// What the lines need from the model (rank 0).
struct Context {
  const ColibriFile* file = nullptr;
  const Tokenizer* tok = nullptr;     // null: the file has no tokenizer
  const ChatTemplate* tmpl = nullptr;  // null: the file has no usable chat template
  std::string tmpl_problem;            // why not, for chat lines
  std::vector<int32_t> eos_ids;
  int64_t max_context = 0;
  std::string model_name;
};

// Flattens OpenAI's content parts ([{"type": "text", "text": ...}]) to one
// string, as vLLM does for templates that expect a string.
ojson normalize_messages(const ojson& msgs) {
  if (!msgs.is_array() || msgs.empty()) bad("invalid_value", "'messages' must be a non-empty list of messages", "messages");
  ojson out = ojson::array();
  for (size_t i = 0; i < msgs.size(); ++i) {
    const ojson& m = msgs[i];
    const std::string where = "messages[" + std::to_string(i) + "]";
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      bad("invalid_value", where + " must be an object with a string 'role'", "messages");
    ojson c = m;
    if (m.contains("content") && m["content"].is_array()) {
      std::string text;
      for (const auto& part : m["content"]) {
        if (!part.is_object() || part.value("type", std::string()) != "text" || !part.contains("text") ||
            !part["text"].is_string())
          bad("invalid_value", where + ": only text content parts ({\"type\": \"text\", \"text\": ...}) are supported",
              "messages");
        text += part["text"].get<std::string>();
      }
      c["content"] = text;
    }
    out.push_back(std::move(c));
  }
  return out;
}

// Parses the body of an accepted line into `job` and its Request. Throws LineError.
Request parse_body(const ojson& body, bool chat, const Context& cx, Job& job) {
  if (!body.is_object()) bad("invalid_value", "'body' must be an object", "body");
  const char* url = chat ? "/v1/chat/completions" : "/v1/completions";
  Request q;
  q.stop_ids = cx.eos_ids;
  q.sampling.temperature = 1.0f;  // OpenAI's default
  std::optional<int64_t> max_tokens;
  std::vector<std::string> stops;
  const ojson* prompt = nullptr;
  const ojson* messages = nullptr;
  for (auto it = body.begin(); it != body.end(); ++it) {
    const std::string& k = it.key();
    const ojson& v = it.value();
    if (k == "model") {
      if (!v.is_string()) bad("invalid_type", "'model' must be a string", "model");
      job.model = v.get<std::string>();
      continue;
    }
    if (k == "prompt" && !chat) {
      prompt = &v;
      continue;
    }
    if (k == "messages" && chat) {
      messages = &v;
      continue;
    }
    if (v.is_null() && k != "prompt" && k != "messages") continue;  // an optional field left unset
    if (k == "max_tokens" || (k == "max_completion_tokens" && chat)) {
      max_tokens = int_field(v, k.c_str(), 0, kMaxPositions);
    } else if (k == "temperature") {
      q.sampling.temperature = static_cast<float>(num_field(v, "temperature"));
    } else if (k == "top_p") {
      q.sampling.top_p = static_cast<float>(num_field(v, "top_p"));
    } else if (k == "top_k") {
      const int64_t t = int_field(v, "top_k", -1, kMaxPositions);
      q.sampling.top_k = static_cast<int>(t < 0 ? 0 : t);  // -1: off (vLLM)
    } else if (k == "seed") {
      q.sampling.seed = static_cast<uint64_t>(int_field(v, "seed", std::numeric_limits<int64_t>::min(),
                                                        std::numeric_limits<int64_t>::max()));
    } else if (k == "stop") {
      if (v.is_string()) {
        stops.push_back(v.get<std::string>());
      } else if (v.is_array()) {
        for (const auto& s : v) {
          if (!s.is_string()) bad("invalid_type", "'stop' must be a string or a list of strings", "stop");
          stops.push_back(s.get<std::string>());
        }
      } else {
        bad("invalid_type", "'stop' must be a string or a list of strings", "stop");
      }
      for (const auto& s : stops)
        if (s.empty()) bad("invalid_value", "'stop' holds an empty string", "stop");
    } else if (k == "n") {
      if (int_field(v, "n", 1, kMaxPositions) != 1)
        bad("invalid_value", "'n' must be 1: give one line per sample (with different seeds)", "n");
    } else if (k == "ignore_eos") {
      q.ignore_eos = bool_field(v, "ignore_eos");
    } else if (k == "return_token_ids") {
      job.return_ids = bool_field(v, "return_token_ids");
    } else if (k == "stream") {
      if (bool_field(v, "stream")) bad("invalid_value", "'stream' must be false in a batch", "stream");
    } else if (k == "user") {
      if (!v.is_string()) bad("invalid_type", "'user' must be a string", "user");
    } else {
      bad("unknown_field", "unknown or unsupported field '" + k + "' in the body of a " + std::string(url) + " request", k);
    }
  }
  if (!stops.empty() && !cx.tok) bad("invalid_value", "'stop' needs the model's tokenizer; the model file has none", "stop");
  if (chat) {
    if (!messages) bad("missing_field", "a /v1/chat/completions body needs 'messages'", "messages");
    if (!cx.tok) bad("invalid_value", "chat requests need the model's tokenizer; the model file has none", "messages");
    if (!cx.tmpl) bad("invalid_value", cx.tmpl_problem, "messages");
    const ojson msgs = normalize_messages(*messages);
    const TokenizerSpec& spec = cx.file->config().tokenizer;
    std::string text;
    try {
      text = apply_chat_template(*cx.tmpl, msgs, true, spec.special_token("bos_token"), spec.special_token("eos_token"));
    } catch (const Error& e) {
      bad("invalid_value", std::string("the chat template failed on these messages: ") + e.what(), "messages");
    }
    // NOTE: the template writes the special tokens (BOS...) itself: encode
    // without adding them again, as transformers' apply_chat_template(tokenize=True)
    // and vLLM's chat endpoint do.
    q.prompt = cx.tok->encode(text, false);
  } else {
    if (!prompt) bad("missing_field", "a /v1/completions body needs 'prompt'", "prompt");
    if (prompt->is_string()) {
      if (!cx.tok) bad("invalid_value", "a text prompt needs the model's tokenizer; the model file has none: give token ids", "prompt");
      if (prompt->get_ref<const std::string&>().empty()) bad("invalid_value", "'prompt' is empty", "prompt");
      q.prompt = cx.tok->encode(prompt->get<std::string>(), true);
    } else if (prompt->is_array() && !prompt->empty() && (*prompt)[0].is_number()) {
      for (const auto& t : *prompt) q.prompt.push_back(static_cast<int32_t>(int_field(t, "prompt", 0, std::numeric_limits<int32_t>::max())));
    } else if (prompt->is_array() && !prompt->empty()) {
      bad("invalid_value", "'prompt' as a list of prompts is not supported: give one prompt per line", "prompt");
    } else {
      bad("invalid_value", "'prompt' must be a non-empty string or a non-empty list of token ids", "prompt");
    }
  }
  const int64_t plen = static_cast<int64_t>(q.prompt.size());
  if (plen == 0) bad("invalid_value", "the prompt encodes to no tokens", chat ? "messages" : "prompt");
  if (plen >= cx.max_context)
    bad("context_length_exceeded", "the prompt is " + std::to_string(plen) + " tokens; the context holds " +
                                       std::to_string(cx.max_context) + " (--max-context)",
        chat ? "messages" : "prompt");
  const int64_t mt = max_tokens ? *max_tokens : chat ? cx.max_context - plen : kDefaultCompletionTokens;
  if (plen + mt > cx.max_context)
    bad("context_length_exceeded", "the prompt's " + std::to_string(plen) + " tokens + max_tokens " + std::to_string(mt) +
                                       " exceed the context of " + std::to_string(cx.max_context) + " (--max-context)",
        "max_tokens");
  q.max_new_tokens = static_cast<int32_t>(mt);
  if (cx.tok) job.text = std::make_unique<StopTextStream>(*cx.tok, stops, true);
  return q;
}

std::string fmt_duration(double s) {
  char b[32];
  if (!std::isfinite(s) || s < 0) return "?";
  const long t = std::lround(s);
  if (t >= 3600)
    std::snprintf(b, sizeof b, "%ldh%02ldm", t / 3600, (t / 60) % 60);
  else
    std::snprintf(b, sizeof b, "%ldm%02lds", t / 60, t % 60);
  return b;
}

int cmd_batch_impl(int argc, char** argv) {
  cxxopts::Options o("colibri batch",
                     "Offline inference over a JSONL file of requests in the OpenAI Batch API format\n"
                     "(/v1/completions and /v1/chat/completions lines; docs/batch.md). Results are appended\n"
                     "to --output as they finish, fsynced; running again on the same output skips every\n"
                     "custom_id already there (resume after a kill or a SLURM requeue). Under mpirun/srun\n"
                     "(or colibri launch) rank 0 coordinates and the other ranks serve experts.");
  o.add_options()("m,model", ".colibri model file", cxxopts::value<std::string>())(
      "i,input", "Requests, one JSON object a line", cxxopts::value<std::string>())(
      "o,output", "Results, one JSON object a line (appended; resumed)", cxxopts::value<std::string>())(
      "max-running", "Most requests running at once (the KV cache's sequences), 1..65536",
      cxxopts::value<int64_t>()->default_value("16"))(
      "max-step-tokens", "Most tokens per forward pass (decode rows, then prefill chunks), 1..65536",
      cxxopts::value<int64_t>()->default_value("256"))(
      "max-context", "Positions per sequence (prompt + new tokens), 0..the model's; 0 = the model's, at most 4096",
      cxxopts::value<int64_t>()->default_value("0"))(
      "t,threads", "Compute threads per rank, 0..1024; 0 = the cores divided among this node's ranks",
      cxxopts::value<int>()->default_value("0"))(
      "kernels", "CPU kernels: auto, avx512, avx2 or generic (avx512/avx2: x86-64 only)",
      cxxopts::value<std::string>()->default_value("auto"))(
      "no-verify", "Skip the checksum check of dense tensors at load");
  add_kv_options(o, "room for max-running whole contexts");
  add_cluster_options(o, false);
  add_common_options(o);
  auto r = o.parse(argc, argv);
  if (handle_common(o, r)) return 0;
  const int64_t max_running = option_in_range(r, "max-running", Range<int64_t>{1, kMaxChunk});
  const int64_t max_step = option_in_range(r, "max-step-tokens", Range<int64_t>{1, kMaxChunk});
  const int64_t max_context_opt =
      option_in_range(r, "max-context", Range<int64_t>{0, kMaxPositions, false, "(0 = the model's, at most 4096)"});
  const int threads_opt = check_option("threads", r["threads"].as<int>(), Range<int>{0, kernels::kMaxThreads, false, "(0 = all cores)"});
  EngineOptions kv_opts;  // --kv-dtype, --kv-block, --kv-cache-mb, checked before any work; the rest default
  apply_kv_options(r, kv_opts);

  ClusterRuntime rt = open_cluster(r, false);
  Communicator* comm = rt.comm.get();
  const int rank = rt.rank, world = rt.world;

  return run_guarded(rt, [&]() -> int {
    if (!r.count("model")) throw Error(Status::InvalidArgument, "--model FILE is required");
    if (rank == 0) {
      if (!r.count("input")) throw Error(Status::InvalidArgument, "--input FILE (the requests, JSONL) is required");
      if (!r.count("output")) throw Error(Status::InvalidArgument, "--output FILE (the results, JSONL) is required");
      check_input(r["input"].as<std::string>(), "--input");
      check_output_options(r, {"output"}, option_paths(r, {"model", "input", "placement", "stats", "routing-replay"}));
    }
    RankModel rm = open_rank_model(r, threads_opt, rank, world);
    const int threads = rm.threads;
    auto file = std::move(rm.file);
    const ModelConfig& cfg = file->config();
    ExpertSetup es = std::move(rm.es);
    if (rank != 0) {
      serve_worker(rt, file, es);
      return 0;
    }

    // ---- coordinator ----
    const std::string in_path = r["input"].as<std::string>(), out_path = r["output"].as<std::string>();
    if (max_context_opt > cfg.max_position_embeddings)
      throw Error(Status::InvalidArgument, "--max-context " + std::to_string(max_context_opt) + " is more than the model's " +
                                               std::to_string(cfg.max_position_embeddings) + " positions");
    Context cx;
    cx.file = file.get();
    cx.max_context = max_context_opt ? max_context_opt : std::min<int64_t>(cfg.max_position_embeddings, kDefaultMaxContext);
    cx.eos_ids = eos_token_ids(cfg);
    std::unique_ptr<Tokenizer> tok;
    if (file->has_tokenizer()) tok = open_tokenizer(*file);
    cx.tok = tok.get();
    std::unique_ptr<ChatTemplate> tmpl;
    if (file->chat_template().empty()) {
      cx.tmpl_problem = file->path() + " has no chat template: convert the checkpoint again with its tokenizer_config.json "
                                       "(chat_template) or chat_template.jinja, or send /v1/completions requests";
    } else {
      try {
        tmpl = std::make_unique<ChatTemplate>(file->chat_template());
      } catch (const Error& e) {
        cx.tmpl_problem = std::string("the model's chat template cannot be used: ") + e.what();
        spdlog::warn("{}; chat requests will fail", cx.tmpl_problem);
      }
    }
    cx.tmpl = tmpl.get();
    {
      std::string stem = file->path();
      if (auto s = stem.find_last_of('/'); s != std::string::npos) stem = stem.substr(s + 1);
      if (stem.size() > 8 && stem.substr(stem.size() - 8) == ".colibri") stem.resize(stem.size() - 8);
      cx.model_name = stem;
    }

    // Resume: what the output already holds.
    const Done done = scan_output(out_path);
    if (done.records > 0)
      spdlog::info("resuming: {} holds {} results; their requests are skipped", out_path, done.records);
    ResultFile out(out_path);

    // The number of requests (non-blank lines), for the progress line.
    int64_t total = 0;
    {
      std::ifstream f(in_path, std::ios::binary);
      std::string l;
      while (std::getline(f, l))
        if (l.find_first_not_of(" \t\r") != std::string::npos) ++total;
      if (f.bad()) throw Error(Status::Io, "reading --input '" + in_path + "' failed");
    }
    std::ifstream in(in_path, std::ios::binary);
    if (!in) throw Error(Status::Io, "cannot open --input '" + in_path + "'");

    EngineOptions eo = kv_opts;
    eo.max_batch = max_running;
    eo.prefill_chunk = max_step;
    eo.max_context = cx.max_context;
    eo.placement = es.placement;
    eo.store = es.store;
    eo.device = es.dense_device;
    eo.replay = es.replay;
    Engine engine(file, eo, *comm);
    engine.start_workers();
    spdlog::info("model {}: {} layers, {} experts top-{}; {} rank(s) over {}, {} threads/rank, {} kernels; "
                 "max-running {}, max-step-tokens {}, context {}, KV cache {:.1f} MiB of {}",
                 file->path(), cfg.num_layers, cfg.num_experts, cfg.experts_per_token, world, comm->backend(), threads,
                 kernels::active().name, max_running, max_step, cx.max_context, engine.kv_cache_bytes() / 1048576.0,
                 dtype_name(eo.kv_dtype));

    SchedulerOptions so;
    so.max_running = max_running;
    so.max_step_tokens = max_step;
    Scheduler sched(engine, so);

    std::unordered_map<int64_t, Job> jobs;  // scheduler id -> the line's request
    std::unordered_set<std::string> seen;   // custom_ids of this input so far
    std::vector<int64_t> finished;
    int64_t line_no = 0, completed = 0, skipped = 0, errors = 0, prompt_tokens = 0, gen_tokens = 0;
    bool input_done = false;
    const bool tty = isatty(STDERR_FILENO);
    const auto t0 = Clock::now();
    auto last_progress = t0;
    const time_t created = std::time(nullptr);
    const int64_t max_waiting = 4 * max_running;

    auto write_error = [&](const std::optional<std::string>& cid, int64_t line, const LineError& e) {
      out.write_line(error_record(cid, line, e));
      ++errors;
    };

    // Reads lines until one request is submitted (or the input ends).
    auto feed_one = [&]() -> bool {
      std::string l;
      while (std::getline(in, l)) {
        ++line_no;
        if (l.find_first_not_of(" \t\r") == std::string::npos) continue;
        std::optional<std::string> cid;
        try {
          ojson j = ojson::parse(l, nullptr, false);
          if (j.is_discarded()) {
            if (done.lines.count(line_no)) { ++skipped; continue; }
            bad("invalid_json", "line " + std::to_string(line_no) + " is not valid JSON");
          }
          if (!j.is_object()) {
            if (done.lines.count(line_no)) { ++skipped; continue; }
            bad("invalid_request", "line " + std::to_string(line_no) + " is not a JSON object");
          }
          if (j.contains("custom_id") && j["custom_id"].is_string() && !j["custom_id"].get_ref<const std::string&>().empty())
            cid = j["custom_id"].get<std::string>();
          if (!cid) {
            if (done.lines.count(line_no)) { ++skipped; continue; }
            bad("missing_custom_id", "line " + std::to_string(line_no) + " has no 'custom_id' (a non-empty string)", "custom_id");
          }
          if (!seen.insert(*cid).second) {
            if (done.dup_ids.count(*cid)) { ++skipped; continue; }
            bad("duplicate_custom_id", "custom_id '" + *cid + "' (line " + std::to_string(line_no) +
                                           ") was used by an earlier line: every custom_id must be unique", "custom_id");
          }
          if (done.ids.count(*cid)) { ++skipped; continue; }
          for (auto it = j.begin(); it != j.end(); ++it)
            if (it.key() != "custom_id" && it.key() != "method" && it.key() != "url" && it.key() != "body")
              bad("unknown_field", "unknown field '" + it.key() + "' in the request line (custom_id, method, url, body)", it.key());
          if (!j.contains("method") || j["method"] != "POST")
            bad("invalid_method", "'method' must be \"POST\"", "method");
          if (!j.contains("url") || !j["url"].is_string())
            bad("invalid_url", "'url' must be \"/v1/completions\" or \"/v1/chat/completions\"", "url");
          const std::string url = j["url"].get<std::string>();
          if (url != "/v1/completions" && url != "/v1/chat/completions")
            bad("invalid_url", "unknown url '" + url + "': /v1/completions and /v1/chat/completions are served", "url");
          if (!j.contains("body")) bad("missing_field", "the line has no 'body'", "body");
          Job job;
          job.line = line_no;
          job.custom_id = *cid;
          job.chat = url == "/v1/chat/completions";
          Request q = parse_body(j["body"], job.chat, cx, job);
          try {
            engine.validate_request(q, "the request");
          } catch (const Error& e) {
            bad("invalid_value", e.what());
          }
          if (job.model.empty()) job.model = cx.model_name;
          if (job.return_ids) job.prompt = q.prompt;
          RequestCallbacks cb;
          StopTextStream* ts = job.text.get();
          if (ts)
            cb.stop = [ts](int32_t t, const std::string&) {
              ts->push(t);
              return ts->stopped();
            };
          cb.on_finish = [&finished](int64_t id, const SequenceOutput&) { finished.push_back(id); };
          job.prompt_len = static_cast<int64_t>(q.prompt.size());
          int64_t id = 0;
          try {
            id = sched.submit(std::move(q), std::move(cb));
          } catch (const Error& e) {
            if (e.status() != Status::InvalidArgument) throw;
            bad("invalid_value", e.what());
          }
          jobs.emplace(id, std::move(job));
          return true;
        } catch (const LineError& e) {
          write_error(cid, line_no, e);
        }
      }
      if (in.bad()) throw Error(Status::Io, "reading --input '" + in_path + "' failed");
      input_done = true;
      return false;
    };

    auto write_result = [&](int64_t id) {
      SequenceOutput so_ = sched.take(id);
      auto it = jobs.find(id);
      Job& job = it->second;
      const std::string& fr = so_.finish_reason;
      if (fr == "length" || fr == "eos" || fr == "stop") {
        const std::string h = record_hash(job.custom_id);
        std::string text;
        if (job.text) {
          job.text->finish();
          text = job.text->text();
        }
        ojson choice = ojson::object();
        choice["index"] = 0;
        if (job.chat)
          choice["message"] = {{"role", "assistant"}, {"content", text}};
        else
          choice["text"] = text;
        choice["logprobs"] = nullptr;
        choice["finish_reason"] = fr == "length" ? "length" : "stop";
        if (job.return_ids) {
          choice["prompt_token_ids"] = job.prompt;
          choice["token_ids"] = so_.tokens;
        }
        const int64_t ptoks = job.prompt_len;
        ojson body = ojson::object();
        body["id"] = (job.chat ? "chatcmpl-" : "cmpl-") + h;
        body["object"] = job.chat ? "chat.completion" : "text_completion";
        body["created"] = static_cast<int64_t>(created);
        body["model"] = job.model;
        body["choices"] = ojson::array({choice});
        const int64_t ctoks = static_cast<int64_t>(so_.tokens.size());
        body["usage"] = {{"prompt_tokens", ptoks}, {"completion_tokens", ctoks}, {"total_tokens", ptoks + ctoks}};
        ojson rec = ojson::object();
        rec["id"] = "batch_req_" + h;
        rec["custom_id"] = job.custom_id;
        rec["response"] = {{"status_code", 200}, {"request_id", "req_" + h}, {"body", std::move(body)}};
        rec["error"] = nullptr;
        out.write_line(rec);
        ++completed;
        prompt_tokens += ptoks;
        gen_tokens += ctoks;
      }
      // "interrupted", "cancelled", "error": not written; a rerun does the request again.
      jobs.erase(it);
    };

    auto progress = [&](bool force) {
      if (!tty) return;
      const auto now = Clock::now();
      if (!force && now - last_progress < std::chrono::milliseconds(500)) return;
      last_progress = now;
      const double el = std::chrono::duration<double>(now - t0).count();
      const int64_t d = completed + errors + skipped;
      const int64_t this_run = completed + errors;
      const double eta = this_run > 0 ? el / this_run * static_cast<double>(std::max<int64_t>(0, total - d)) : NAN;
      std::fprintf(stderr, "\rbatch: %lld / %lld requests, %lld running, %.1f tokens/s, ETA %s   ", (long long)d,
                   (long long)total, (long long)sched.running(), el > 0 ? gen_tokens / el : 0.0, fmt_duration(eta).c_str());
      std::fflush(stderr);
    };

    const std::atomic<int>* stop = stop_flag();
    int sig = 0;
    try {
      while (true) {
        if ((sig = stop->load()) != 0) break;
        while (!input_done && sched.waiting() < max_waiting) feed_one();
        out.sync();  // error records of this round
        if (sched.idle()) {
          if (input_done) break;
          continue;
        }
        // NOTE: not idle yet nothing to run would spin for ever (submit refuses what the cache cannot hold).
        if (!sched.step() && !sched.idle() && !sched.step())
          throw Error(Status::Internal, "the scheduler has requests but runs none");
        for (int64_t id : finished) write_result(id);
        finished.clear();
        out.sync();
        progress(false);
      }
    } catch (const Error&) {
      // The scheduler ended every unfinished request with "error": keep what finished before.
      for (int64_t id : finished) write_result(id);
      finished.clear();
      try {
        out.sync();
      } catch (const Error&) {
      }
      throw;
    }
    if (sig) {
      // Stop admitting; the requests in flight are dropped (not written): a rerun does them.
      sched.finish_all("interrupted");
      for (auto& [id, job] : jobs) (void)sched.take(id);
      finished.clear();
    }
    out.sync();
    if (tty) {
      progress(true);
      std::fprintf(stderr, "\n");
    }
    const double el = std::chrono::duration<double>(Clock::now() - t0).count();
    const int64_t dropped = static_cast<int64_t>(jobs.size());
    std::fprintf(stderr,
                 "batch: %lld requests done, %lld skipped (already in the output), %lld errors; %lld prompt tokens, "
                 "%lld generated tokens in %.2f s (%.1f tokens/s)\n",
                 (long long)completed, (long long)skipped, (long long)errors, (long long)prompt_tokens,
                 (long long)gen_tokens, el, el > 0 ? gen_tokens / el : 0.0);
    if (errors) std::fprintf(stderr, "batch: %lld bad lines got error records in %s\n", (long long)errors, out_path.c_str());
    if (sig)
      std::fprintf(stderr, "batch: interrupted by %s: %lld requests in flight were dropped; run again on the same output to finish\n",
                   signal_name(sig), (long long)dropped);
    std::fflush(stderr);
    engine.stop_workers();
    if (world > 1) comm->barrier();
    rt.finish();
    return sig ? 128 + sig : 0;
  });
}

}  // namespace

int cmd_batch(int argc, char** argv) { return cmd_batch_impl(argc, argv); }

}  // namespace colibri::cli
