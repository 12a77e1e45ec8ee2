// routing_trace.cpp: the routing-trace writer, the reader (our JSONL format and
// the Mixtral import format, auto-detected) and expert-load statistics.
#include "model/routing_trace.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <tuple>

#include "model/config.h"
#include "model/error.h"
#include "model/file_io.h"
#include "model/json_util.h"

namespace colibri {

using nlohmann::json;


namespace {

// NOTE: bounds on ids read from files, so a corrupt value cannot make
// aggregate_stats allocate a huge matrix.
constexpr int64_t kMaxLayers = 1 << 16;
constexpr int64_t kMaxExperts = 1 << 16;

std::string where(const std::string& path, int64_t line) { return path + ":" + std::to_string(line) + ": "; }

[[noreturn]] void bad(const std::string& path, int64_t line, const std::string& msg) {
  throw Error(Status::Format, where(path, line) + msg);
}

// An integer field in [lo, hi]; Format error naming file, line and key otherwise.
int64_t get_int(const json& j, const char* key, int64_t lo, int64_t hi, const std::string& path, int64_t line) {
  auto it = j.find(key);
  if (it == j.end()) bad(path, line, std::string("missing \"") + key + "\"");
  if (!it->is_number_integer()) bad(path, line, std::string("\"") + key + "\" is not an integer: " + json_show(*it));
  int64_t v = 0;
  if (it->is_number_unsigned()) {
    uint64_t u = it->get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      bad(path, line, std::string("\"") + key + "\" is out of range: " + json_show(*it));
    v = static_cast<int64_t>(u);
  } else {
    v = it->get<int64_t>();
  }
  if (v < lo || v > hi)
    bad(path, line, std::string("\"") + key + "\" = " + std::to_string(v) + " is out of range [" + std::to_string(lo) +
                        ", " + std::to_string(hi) + "]");
  return v;
}

// The experts and weights of one row: same non-zero length, ids in [0, max_expert),
// no id twice, finite weights.
void get_row(const json& j, const char* ekey, const char* wkey, int64_t max_expert, const std::string& path,
             int64_t line, RoutingRecord& r) {
  auto ei = j.find(ekey), wi = j.find(wkey);
  if (ei == j.end()) bad(path, line, std::string("missing \"") + ekey + "\"");
  if (wi == j.end()) bad(path, line, std::string("missing \"") + wkey + "\"");
  if (!ei->is_array() || ei->empty()) bad(path, line, std::string("\"") + ekey + "\" is not a non-empty array");
  if (!wi->is_array()) bad(path, line, std::string("\"") + wkey + "\" is not an array");
  if (ei->size() != wi->size())
    bad(path, line, std::string("\"") + ekey + "\" has " + std::to_string(ei->size()) + " entries but \"" + wkey +
                        "\" has " + std::to_string(wi->size()));
  r.experts.clear();
  r.weights.clear();
  for (const auto& e : *ei) {
    if (!e.is_number_integer()) bad(path, line, std::string("\"") + ekey + "\" holds a non-integer: " + json_show(e));
    int64_t v = e.is_number_unsigned() ? static_cast<int64_t>(std::min<uint64_t>(e.get<uint64_t>(), INT64_MAX))
                                       : e.get<int64_t>();
    if (v < 0 || v >= max_expert)
      bad(path, line, "expert " + std::to_string(v) + " is out of range [0, " + std::to_string(max_expert) + ")");
    if (std::find(r.experts.begin(), r.experts.end(), v) != r.experts.end())
      bad(path, line, "expert " + std::to_string(v) + " appears twice in one row");
    r.experts.push_back(static_cast<int32_t>(v));
  }
  for (const auto& w : *wi) {
    if (!w.is_number()) bad(path, line, std::string("\"") + wkey + "\" holds a non-number: " + json_show(w));
    double v = w.get<double>();
    if (!std::isfinite(v)) bad(path, line, std::string("\"") + wkey + "\" holds a non-finite number");
    r.weights.push_back(static_cast<float>(v));
  }
}

json parse_line(const std::string& text, const std::string& path, int64_t line) {
  try {
    json j = json::parse(text);
    if (!j.is_object()) bad(path, line, "not a JSON object");
    return j;
  } catch (const json::exception& e) {
    // NOTE: nlohmann's message says "line 1, column N" of this one line; keep the column.
    std::string m = e.what();
    auto p = m.find("column");
    bad(path, line, "malformed JSON" + (p != std::string::npos ? " at " + m.substr(p) : ": " + m));
  }
}

bool blank(const std::string& s) { return s.find_first_not_of(" \t\r\n") == std::string::npos; }

struct Keyed {
  RoutingRecord rec;
  int64_t line;
};

// Our format after the header line.
void read_colibri(std::ifstream& in, const json& header, const std::string& path, int64_t& line, RoutingTrace& t) {
  auto it = header.find("version");
  if (it == header.end() || !it->is_number_integer() || it->get<int64_t>() != 1)
    bad(path, line, "unsupported colibri-routing version " + (it == header.end() ? std::string("(missing)") : json_show(*it)) +
                        " (this build reads version 1)");
  t.num_layers = static_cast<int32_t>(get_int(header, "num_layers", 1, kMaxLayers, path, line));
  t.num_experts = static_cast<int32_t>(get_int(header, "num_experts", 1, kMaxExperts, path, line));
  t.top_k = static_cast<int32_t>(get_int(header, "top_k", 1, t.num_experts, path, line));
  t.format = "colibri";

  std::vector<Keyed> rows;
  std::string text;
  while (std::getline(in, text)) {
    ++line;
    if (blank(text)) continue;
    json j = parse_line(text, path, line);
    Keyed k;
    k.line = line;
    k.rec.step = get_int(j, "step", 0, std::numeric_limits<int64_t>::max(), path, line);
    k.rec.layer = static_cast<int32_t>(get_int(j, "layer", 0, t.num_layers - 1, path, line));
    k.rec.seq = static_cast<int32_t>(get_int(j, "seq", 0, std::numeric_limits<int32_t>::max(), path, line));
    k.rec.pos = static_cast<int32_t>(get_int(j, "pos", 0, std::numeric_limits<int32_t>::max(), path, line));
    get_row(j, "experts", "weights", t.num_experts, path, line, k.rec);
    if (static_cast<int32_t>(k.rec.experts.size()) != t.top_k)
      bad(path, line, std::to_string(k.rec.experts.size()) + " experts in a row, the header says top_k " +
                          std::to_string(t.top_k));
    rows.push_back(std::move(k));
  }
  if (in.bad()) throw Error(Status::Io, "error reading '" + path + "': " + std::strerror(errno));

  auto key = [](const Keyed& k) { return std::tie(k.rec.step, k.rec.layer, k.rec.seq, k.rec.pos); };
  auto less = [&](const Keyed& a, const Keyed& b) { return key(a) < key(b); };
  if (!std::is_sorted(rows.begin(), rows.end(), less)) std::stable_sort(rows.begin(), rows.end(), less);
  for (size_t i = 1; i < rows.size(); ++i)
    if (key(rows[i]) == key(rows[i - 1]))
      bad(path, rows[i].line, "repeats the (step, layer, seq, pos) of line " + std::to_string(rows[i - 1].line));
  t.records.reserve(rows.size());
  for (auto& k : rows) t.records.push_back(std::move(k.rec));
}

// The Mixtral import format: the first row is already parsed (`first`).
void read_mixtral(std::ifstream& in, json first, const std::string& path, int64_t line, RoutingTrace& t) {
  t.format = "mixtral-jsonl";
  const bool timed = first.contains("token_pos");
  const char* pos_key = timed ? "token_pos" : "token_idx";
  const char* other_key = timed ? "token_idx" : "token_pos";

  struct Raw {
    int32_t problem, layer, pos;
    int64_t line;
    RoutingRecord rec;
  };
  std::vector<Raw> rows;
  int32_t max_layer = -1, max_expert = -1, max_k = 0;
  std::string text;
  json j = std::move(first);
  std::string dataset;
  for (bool have = true; have;) {
    if (j.contains(other_key) || !j.contains(pos_key))
      bad(path, line, std::string("expected \"") + pos_key + "\" like the first row (one file holds one kind of row)");
    if (auto d = j.find("dataset"); d != j.end()) {
      if (!d->is_string()) bad(path, line, "\"dataset\" is not a string");
      if (dataset.empty()) dataset = d->get<std::string>();
    }
    Raw r;
    r.line = line;
    r.problem = static_cast<int32_t>(get_int(j, "problem_id", 0, std::numeric_limits<int32_t>::max(), path, line));
    r.layer = static_cast<int32_t>(get_int(j, "layer", 0, kMaxLayers - 1, path, line));
    r.pos = static_cast<int32_t>(get_int(j, pos_key, 0, std::numeric_limits<int32_t>::max(), path, line));
    get_row(j, "experts", "gating_probs", kMaxExperts, path, line, r.rec);
    max_layer = std::max(max_layer, r.layer);
    max_k = std::max(max_k, static_cast<int32_t>(r.rec.experts.size()));
    for (int32_t e : r.rec.experts) max_expert = std::max(max_expert, e);
    rows.push_back(std::move(r));

    have = false;
    while (std::getline(in, text)) {
      ++line;
      if (blank(text)) continue;
      j = parse_line(text, path, line);
      have = true;
      break;
    }
  }
  if (in.bad()) throw Error(Status::Io, "error reading '" + path + "': " + std::strerror(errno));

  if (timed) {
    // File order is time order. A new step starts when the layer goes back down,
    // or stays with a row not after the previous one; positions restart at 0 in
    // every pass, so offset them by what each sequence had before.
    std::map<int32_t, int32_t> base, width;  // problem -> positions before this step / in this step
    int64_t step = 0;
    for (size_t i = 0; i < rows.size(); ++i) {
      auto& r = rows[i];
      if (i > 0) {
        const auto& p = rows[i - 1];
        bool next = r.layer < p.layer || (r.layer == p.layer && std::tie(r.problem, r.pos) <= std::tie(p.problem, p.pos));
        if (next) {
          ++step;
          for (auto& [prob, w] : width) base[prob] += w;
          width.clear();
        }
      }
      width[r.problem] = std::max(width[r.problem], r.pos + 1);
      r.rec.step = step;
      r.rec.pos = base[r.problem] + r.pos;
    }
  } else {
    // Grouped by problem then layer: sort into (problem, token, layer) order;
    // each (problem, token) is one step.
    std::stable_sort(rows.begin(), rows.end(), [](const Raw& a, const Raw& b) {
      return std::tie(a.problem, a.pos, a.layer) < std::tie(b.problem, b.pos, b.layer);
    });
    int64_t step = -1;
    for (size_t i = 0; i < rows.size(); ++i) {
      auto& r = rows[i];
      if (i > 0) {
        const auto& p = rows[i - 1];
        if (r.problem == p.problem && r.pos == p.pos && r.layer == p.layer)
          bad(path, r.line, "repeats problem_id " + std::to_string(r.problem) + ", token_idx " + std::to_string(r.pos) +
                                ", layer " + std::to_string(r.layer) + " of line " + std::to_string(p.line));
      }
      if (i == 0 || r.problem != rows[i - 1].problem || r.pos != rows[i - 1].pos) ++step;
      r.rec.step = step;
      r.rec.pos = r.pos;
    }
  }
  t.num_layers = max_layer + 1;
  t.num_experts = max_expert + 1;
  t.top_k = max_k;
  t.records.reserve(rows.size());
  for (auto& r : rows) {
    r.rec.layer = r.layer;
    r.rec.seq = r.problem;
    t.records.push_back(std::move(r.rec));
  }
  if (!dataset.empty()) spdlog::debug("{}: Mixtral trace of dataset '{}'", path, dataset);
}

}  // namespace

// ---- writer -----------------------------------------------------------------

struct RoutingTraceWriter::Impl {
  std::string path, tmp;
  std::unique_ptr<AtomicOutput> out;  // PATH.tmp.XXXXXX until close()
  std::FILE* f = nullptr;             // out's stream
  int layers = 0, experts = 0, top_k = 0;
  uint64_t rows = 0;
  int uncaught = 0;  // std::uncaught_exceptions() at construction
  std::string line;

  void check_io(bool ok) {
    if (!ok) throw Error(Status::Io, "cannot write routing trace '" + tmp + "': " + std::strerror(errno));
  }
};

RoutingTraceWriter::RoutingTraceWriter(const std::string& path, int num_layers, int num_experts, int top_k)
    : impl_(std::make_unique<Impl>()) {
  if (num_layers < 1 || num_experts < 1 || top_k < 1 || top_k > num_experts)
    throw Error(Status::InvalidArgument, "routing trace '" + path + "': bad dimensions (" + std::to_string(num_layers) +
                                             " layers, " + std::to_string(num_experts) + " experts, top-" +
                                             std::to_string(top_k) + ")");
  auto& m = *impl_;
  m.path = path;
  m.layers = num_layers;
  m.experts = num_experts;
  m.top_k = top_k;
  m.uncaught = std::uncaught_exceptions();
  m.out = std::make_unique<AtomicOutput>(path);
  m.tmp = m.out->temp_path();
  m.f = m.out->stream();
  nlohmann::ordered_json h = {{"format", "colibri-routing"},
                              {"version", 1},
                              {"num_layers", num_layers},
                              {"num_experts", num_experts},
                              {"top_k", top_k}};
  std::string s = h.dump() + "\n";
  m.check_io(std::fwrite(s.data(), 1, s.size(), m.f) == s.size());
}

RoutingTraceWriter::~RoutingTraceWriter() {
  auto& m = *impl_;
  if (!m.f) return;
  if (std::uncaught_exceptions() > m.uncaught) {
    m.f = nullptr;
    m.out->discard();
    spdlog::warn("routing trace '{}' not written: the run failed", m.path);
    return;
  }
  try {
    close();
  } catch (const std::exception& e) {
    spdlog::error("{}", e.what());
  }
}

void RoutingTraceWriter::write(int64_t step, int layer, int seq, int pos, const int32_t* experts,
                               const float* weights, int k) {
  auto& m = *impl_;
  if (!m.f) throw Error(Status::InvalidArgument, "routing trace '" + m.path + "' is already closed");
  auto fail = [&](const std::string& what) {
    throw Error(Status::InvalidArgument, "routing trace '" + m.path + "': step " + std::to_string(step) + ", layer " +
                                             std::to_string(layer) + ", seq " + std::to_string(seq) + ", pos " +
                                             std::to_string(pos) + ": " + what);
  };
  if (step < 0 || seq < 0 || pos < 0) fail("negative step, seq or pos");
  if (layer < 0 || layer >= m.layers) fail("layer out of range [0, " + std::to_string(m.layers) + ")");
  if (k != m.top_k) fail(std::to_string(k) + " experts, expected top_k " + std::to_string(m.top_k));
  for (int i = 0; i < k; ++i) {
    if (experts[i] < 0 || experts[i] >= m.experts) fail("expert " + std::to_string(experts[i]) + " out of range");
    for (int j = 0; j < i; ++j)
      if (experts[j] == experts[i]) fail("expert " + std::to_string(experts[i]) + " twice");
    if (!std::isfinite(weights[i])) fail("non-finite weight");
  }
  // NOTE: std::to_chars gives the shortest text that reads back as the same
  // float, independent of the locale.
  auto& s = m.line;
  s.clear();
  char buf[64];
  auto num = [&](auto v) {
    auto r = std::to_chars(buf, buf + sizeof buf, v);
    s.append(buf, r.ptr);
  };
  s += "{\"step\":";
  num(step);
  s += ",\"layer\":";
  num(layer);
  s += ",\"seq\":";
  num(seq);
  s += ",\"pos\":";
  num(pos);
  s += ",\"experts\":[";
  for (int i = 0; i < k; ++i) {
    if (i) s += ',';
    num(experts[i]);
  }
  s += "],\"weights\":[";
  for (int i = 0; i < k; ++i) {
    if (i) s += ',';
    num(weights[i]);
  }
  s += "]}\n";
  m.check_io(std::fwrite(s.data(), 1, s.size(), m.f) == s.size());
  ++m.rows;
}

void RoutingTraceWriter::flush() {
  auto& m = *impl_;
  if (m.f) m.check_io(std::fflush(m.f) == 0);
}

void RoutingTraceWriter::close() {
  auto& m = *impl_;
  if (!m.f) return;
  m.f = nullptr;
  m.out->commit();  // flushes, fsyncs, renames; removes the temporary on failure
}

const std::string& RoutingTraceWriter::path() const { return impl_->path; }
uint64_t RoutingTraceWriter::rows_written() const { return impl_->rows; }

// ---- reader -----------------------------------------------------------------

RoutingTrace read_routing_trace(const std::string& path) {
  check_input(path, "routing trace");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(Status::Io, "cannot open routing trace '" + path + "': " + std::strerror(errno));
  RoutingTrace t;
  t.source = path;
  std::string text;
  int64_t line = 0;
  while (std::getline(in, text)) {
    ++line;
    if (!blank(text)) break;
  }
  if (blank(text)) throw Error(Status::Format, "routing trace '" + path + "' is empty");
  json first = parse_line(text, path, line);
  if (auto f = first.find("format"); f != first.end()) {
    if (!f->is_string() || f->get<std::string>() != "colibri-routing")
      bad(path, line, "unknown trace format " + json_show(*f) + " (expected \"colibri-routing\")");
    read_colibri(in, first, path, line, t);
  } else if (first.contains("problem_id") && first.contains("layer") && first.contains("experts")) {
    read_mixtral(in, std::move(first), path, line, t);
  } else {
    bad(path, line,
        "neither a colibri-routing header nor a Mixtral routing row "
        "(problem_id, layer, token_pos|token_idx, experts, gating_probs)");
  }
  return t;
}

// ---- statistics ---------------------------------------------------------------

ExpertStats aggregate_stats(const RoutingTrace& trace) {
  int32_t L = trace.num_layers, E = trace.num_experts;
  if (L <= 0 || E <= 0) {
    int32_t ml = -1, me = -1;
    for (const auto& r : trace.records) {
      ml = std::max(ml, r.layer);
      for (int32_t e : r.experts) me = std::max(me, e);
    }
    if (L <= 0) L = ml + 1;
    if (E <= 0) E = me + 1;
  }
  if (L <= 0 || E <= 0 || L > kMaxLayers || E > kMaxExperts || static_cast<int64_t>(L) * E > (int64_t(1) << 24))
    throw Error(Status::InvalidArgument, "routing trace '" + trace.source + "' holds no routing (or absurd dimensions)");
  ExpertStats s;
  s.source = trace.source;
  s.num_layers = L;
  s.num_experts = E;
  s.load.assign(L, std::vector<uint64_t>(E, 0));
  std::set<std::tuple<int64_t, int32_t, int32_t>> tokens;
  for (size_t i = 0; i < trace.records.size(); ++i) {
    const auto& r = trace.records[i];
    if (r.layer < 0 || r.layer >= L)
      throw Error(Status::InvalidArgument, "routing trace '" + trace.source + "': record " + std::to_string(i) +
                                               " has layer " + std::to_string(r.layer) + ", outside [0, " +
                                               std::to_string(L) + ")");
    for (int32_t e : r.experts) {
      if (e < 0 || e >= E)
        throw Error(Status::InvalidArgument, "routing trace '" + trace.source + "': record " + std::to_string(i) +
                                                 " has expert " + std::to_string(e) + ", outside [0, " +
                                                 std::to_string(E) + ")");
      ++s.load[r.layer][e];
    }
    if (r.layer == 0) tokens.emplace(r.step, r.seq, r.pos);
  }
  s.tokens = tokens.size();
  return s;
}

void save_expert_stats(const ExpertStats& s, const std::string& path) {
  if (s.num_layers <= 0 || s.num_experts <= 0 || s.load.size() != static_cast<size_t>(s.num_layers))
    throw Error(Status::InvalidArgument, "expert stats for '" + path + "': load matrix does not match " +
                                             std::to_string(s.num_layers) + " layers");
  for (const auto& row : s.load)
    if (row.size() != static_cast<size_t>(s.num_experts))
      throw Error(Status::InvalidArgument, "expert stats for '" + path + "': a load row does not have " +
                                               std::to_string(s.num_experts) + " experts");
  // One layer per line: readable, and diffs show which layer changed.
  std::ostringstream o;
  o << "{\"format\":\"colibri-expert-stats\",\"version\":1,\"source\":" << json(s.source).dump()
    << ",\"num_layers\":" << s.num_layers << ",\"num_experts\":" << s.num_experts << ",\"tokens\":" << s.tokens
    << ",\"load\":[\n";
  for (size_t l = 0; l < s.load.size(); ++l) {
    o << "  [";
    for (size_t e = 0; e < s.load[l].size(); ++e) o << (e ? "," : "") << s.load[l][e];
    o << "]" << (l + 1 < s.load.size() ? ",\n" : "\n");
  }
  o << "]}\n";
  write_output(path, o.str());
}

ExpertStats load_expert_stats(const std::string& path) {
  const std::string text = read_input(path, "expert stats");
  const std::string what = "expert stats '" + path + "': ";
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw Error(Status::Format, what + "malformed JSON: " + e.what());
  }
  auto fail = [&](const std::string& m) -> void { throw Error(Status::Format, what + m); };
  if (!j.is_object()) fail("not a JSON object");
  auto f = j.find("format");
  if (f == j.end() || !f->is_string() || f->get<std::string>() != "colibri-expert-stats")
    fail("\"format\" is not \"colibri-expert-stats\"" + (f == j.end() ? std::string() : " (found " + json_show(*f) + ")"));
  auto v = j.find("version");
  if (v == j.end() || !v->is_number_integer() || v->get<int64_t>() != 1)
    fail("unsupported version " + (v == j.end() ? std::string("(missing)") : json_show(*v)) + " (this build reads 1)");
  auto dim = [&](const char* key, int64_t hi) -> int32_t {
    auto it = j.find(key);
    if (it == j.end()) fail(std::string("missing \"") + key + "\"");
    if (!it->is_number_integer() || it->get<int64_t>() <= 0 || it->get<int64_t>() > hi)
      fail(std::string("\"") + key + "\" must be an integer in [1, " + std::to_string(hi) + "], found " + json_show(*it));
    return static_cast<int32_t>(it->get<int64_t>());
  };
  ExpertStats s;
  s.num_layers = dim("num_layers", kMaxLayers);
  s.num_experts = dim("num_experts", kMaxExperts);
  if (auto src = j.find("source"); src != j.end()) {
    if (!src->is_string()) fail("\"source\" is not a string");
    s.source = src->get<std::string>();
  }
  auto t = j.find("tokens");
  if (t == j.end() || !t->is_number_unsigned())
    fail("\"tokens\" must be a non-negative integer" + (t == j.end() ? std::string(" (missing)") : ", found " + json_show(*t)));
  s.tokens = t->get<uint64_t>();
  auto load = j.find("load");
  if (load == j.end() || !load->is_array()) fail("\"load\" must be an array of num_layers arrays");
  if (load->size() != static_cast<size_t>(s.num_layers))
    fail("\"load\" has " + std::to_string(load->size()) + " layers, num_layers is " + std::to_string(s.num_layers));
  for (int32_t l = 0; l < s.num_layers; ++l) {
    const auto& row = (*load)[l];
    if (!row.is_array() || row.size() != static_cast<size_t>(s.num_experts))
      fail("load of layer " + std::to_string(l) + " must be an array of " + std::to_string(s.num_experts) +
           " counts (num_experts)");
  }
  s.load.assign(s.num_layers, std::vector<uint64_t>(s.num_experts, 0));
  for (int32_t l = 0; l < s.num_layers; ++l) {
    const auto& row = (*load)[l];
    for (int32_t e = 0; e < s.num_experts; ++e) {
      // NOTE: nlohmann stores non-negative integers as unsigned; -1 and 2.5 are not.
      if (!row[e].is_number_unsigned())
        fail("load of layer " + std::to_string(l) + ", expert " + std::to_string(e) +
             " is not a non-negative integer: " + json_show(row[e]));
      s.load[l][e] = row[e].get<uint64_t>();
    }
  }
  return s;
}

RoutingReplay::RoutingReplay(const RoutingTrace& t) : source_(t.source) {
  if (t.records.empty()) throw Error(Status::InvalidArgument, "routing trace " + t.source + " holds no rows to replay");
  // NOTE: read_routing_trace already checked each row (ids in range and distinct,
  // weights finite, as many as experts, layers in range); a replay also needs
  // one width (an imported trace may mix them).
  k_ = static_cast<int>(t.records.front().experts.size());
  num_experts_ = t.num_experts;
  experts_.resize(static_cast<size_t>(t.num_layers));
  weights_.resize(static_cast<size_t>(t.num_layers));
  for (const RoutingRecord& r : t.records) {
    if (static_cast<int>(r.experts.size()) != k_)
      throw Error(Status::InvalidArgument, "routing trace " + t.source + ", step " + std::to_string(r.step) + " layer " +
                                               std::to_string(r.layer) + " token (" + std::to_string(r.seq) + ", " +
                                               std::to_string(r.pos) + "): " + std::to_string(r.experts.size()) +
                                               " experts, the first row has " + std::to_string(k_) +
                                               " (a replay needs one top-k)");
    auto& e = experts_[static_cast<size_t>(r.layer)];
    auto& w = weights_[static_cast<size_t>(r.layer)];
    e.insert(e.end(), r.experts.begin(), r.experts.end());
    w.insert(w.end(), r.weights.begin(), r.weights.end());
  }
  cursor_.assign(experts_.size(), 0);
}

void RoutingReplay::check(const ModelConfig& c) const {
  const std::string what = "--routing-replay " + source_ + ": ";
  if (num_experts_ > c.num_experts)
    throw Error(Status::InvalidArgument, what + "the trace routes to " + std::to_string(num_experts_) + " experts, the model has " +
                                             std::to_string(c.num_experts));
  if (k_ != c.experts_per_token)
    throw Error(Status::InvalidArgument, what + "the trace chooses " + std::to_string(k_) + " experts per token, the model " +
                                             std::to_string(c.experts_per_token));
  if (num_layers() < c.num_moe_layers())
    throw Error(Status::InvalidArgument, what + "the trace has " + std::to_string(num_layers()) + " MoE layers, the model " +
                                             std::to_string(c.num_moe_layers()));
  for (int l = 0; l < c.num_moe_layers(); ++l)
    if (experts_[static_cast<size_t>(l)].empty())
      throw Error(Status::InvalidArgument, what + "no rows for MoE layer " + std::to_string(l));
}

void RoutingReplay::next(int layer, int64_t n, int32_t* experts, float* weights) {
  const auto& e = experts_[static_cast<size_t>(layer)];
  const auto& w = weights_[static_cast<size_t>(layer)];
  const size_t rows = e.size() / static_cast<size_t>(k_);
  size_t& at = cursor_[static_cast<size_t>(layer)];
  for (int64_t i = 0; i < n; ++i) {
    std::copy_n(e.begin() + static_cast<ptrdiff_t>(at * k_), k_, experts + i * k_);
    std::copy_n(w.begin() + static_cast<ptrdiff_t>(at * k_), k_, weights + i * k_);
    at = (at + 1) % rows;
  }
}

void RoutingReplay::rewind() { std::fill(cursor_.begin(), cursor_.end(), 0); }

std::vector<uint64_t> hottest_experts(const ExpertStats& st, size_t limit) {
  std::vector<std::pair<uint64_t, uint64_t>> v;  // (load, key)
  for (int l = 0; l < st.num_layers; ++l)
    for (int e = 0; e < st.num_experts; ++e)
      v.push_back({st.load[static_cast<size_t>(l)][static_cast<size_t>(e)], static_cast<uint64_t>(l) * st.num_experts + e});
  std::stable_sort(v.begin(), v.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<uint64_t> k;
  for (size_t i = 0; i < v.size() && i < limit; ++i) k.push_back(v[i].second);
  return k;
}

}  // namespace colibri
