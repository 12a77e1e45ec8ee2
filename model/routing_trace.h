// routing_trace.h: routing traces (which experts each token chose at each
// layer) and the expert-load statistics aggregated from them. Our own JSONL
// format is written by `--record-routing`; the real Mixtral-8x7B traces in
// ../shared/traces/ are read by the same reader (auto-detected).
//
// Steps of imported traces (so a cache replay in time order is possible):
// - a file in true time order (rows carry "token_pos", the position inside the
//   forward pass): a new step starts when the layer goes back down (or repeats
//   with a (problem_id, token_pos) not after the previous row's). So a prefill is
//   one step (all prompt tokens, layer by layer) and each decode token is one
//   step. token_pos restarts at 0 in every pass, so `pos` is made absolute:
//   pos = token_pos + the number of positions the sequence had in earlier steps
//   (humaneval0: prefill pos 0..134, then decode tokens 135, 136, ...).
// - a file grouped by problem then layer (rows carry "token_idx", the position in
//   the sequence): rows are sorted by (problem_id, token_idx, layer) and every
//   (problem_id, token_idx) is one step: a token-by-token replay, because the
//   file does not say which tokens shared a forward pass.
// In both, seq = problem_id. The recording dropped some rows (weights exactly
// [0.5, 0.5]), so a token may lack a layer; that is not an error.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace colibri {

// One token's routing at one layer.
struct RoutingRecord {
  int64_t step = 0;  // forward pass index: all tokens of one batch step share it
  int32_t layer = 0;
  int32_t seq = 0;   // sequence (or problem id in imported traces)
  int32_t pos = 0;   // position in the sequence
  std::vector<int32_t> experts;  // slot order (highest score first)
  std::vector<float> weights;
};

struct RoutingTrace {
  std::string source;          // file it was read from
  std::string format;          // "colibri" or "mixtral-jsonl"
  int32_t num_layers = 0;      // 1 + the largest layer seen (or from the header)
  int32_t num_experts = 0;     // 1 + the largest expert id seen (or from the header)
  int32_t top_k = 0;           // experts per row (header; the longest row when imported)
  std::vector<RoutingRecord> records;  // in time order (step, then layer, then seq, pos)
};

// Writes our JSONL format: a header line
//   {"format":"colibri-routing","version":1,"num_layers":L,"num_experts":E,"top_k":K}
// then one line per (step, layer, token):
//   {"step":S,"layer":L,"seq":I,"pos":P,"experts":[...],"weights":[...]}
// NOTE: lines go to PATH.tmp.XXXXXX, renamed to PATH by close() (or the destructor), so
// a complete trace never coexists with a half-written one. A writer destroyed
// while an exception unwinds removes PATH.tmp.XXXXXX instead (no half-written output).
class RoutingTraceWriter {
 public:
  RoutingTraceWriter(const std::string& path, int num_layers, int num_experts, int top_k);  // throws Error(Io|InvalidArgument)
  ~RoutingTraceWriter();  // closes (errors are logged, not thrown); see close()
  // Throws Error(InvalidArgument) for a layer or expert out of range, k != top_k,
  // a repeated expert or a non-finite weight; Error(Io) when the disk fails.
  void write(int64_t step, int layer, int seq, int pos, const int32_t* experts, const float* weights, int k);
  void flush();  // pushes buffered lines into PATH.tmp.XXXXXX; throws Error(Io)
  void close();  // flushes, closes and renames PATH.tmp.XXXXXX to PATH; throws Error(Io); idempotent
  const std::string& path() const;
  uint64_t rows_written() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Reads a trace in our format or the Mixtral import format (rows
// {"dataset","problem_id","layer","token_pos"|"token_idx","experts","gating_probs"}).
// Imported rows are put in time order: a file already in time order (token_pos)
// keeps its order; one grouped by problem then layer (token_idx) is sorted by
// (problem_id, token_idx, layer). Throws Error(Io|Format) naming the line.
RoutingTrace read_routing_trace(const std::string& path);

struct ModelConfig;

// Replays a trace's routing in place of the router's (EngineOptions::replay),
// so that a model of the same shape (experts, top-k) sees recorded routing, e.g.
// the real Mixtral-8x7B traces. MoE layer l takes the trace's layer-l rows in
// time order: each forward pass's n tokens take the next n rows of that layer,
// wrapping at its end; rewind() starts every layer over (the engine does so at
// each generate call, so repeated runs replay the same routing). Layers keep
// separate cursors, so a trace that dropped rows (the Mixtral recordings) drifts
// by those rows between layers after a wrap.
class RoutingReplay {
 public:
  // `trace` as read_routing_trace returns it (rows already checked). Throws
  // Error(InvalidArgument) for an empty trace or rows of differing width.
  explicit RoutingReplay(const RoutingTrace& trace);
  // Throws Error(InvalidArgument) naming what differs when the trace does not
  // fit the model: other expert count or top-k, fewer layers, a layer without rows.
  void check(const ModelConfig& c) const;
  void next(int layer, int64_t n, int32_t* experts, float* weights);
  void rewind();
  const std::string& source() const { return source_; }
  int num_layers() const { return static_cast<int>(experts_.size()); }
  int top_k() const { return k_; }
  int num_experts() const { return num_experts_; }
  size_t rows(int layer) const { return experts_[static_cast<size_t>(layer)].size() / static_cast<size_t>(k_); }

 private:
  std::string source_;
  int k_ = 0, num_experts_ = 0;
  std::vector<std::vector<int32_t>> experts_;  // [layer][row * k + j]
  std::vector<std::vector<float>> weights_;    // [layer][row * k + j]
  std::vector<size_t> cursor_;                 // [layer] next row
};

// Expert load: how many tokens selected each expert of each layer.
// STATS.json: {"format":"colibri-expert-stats","version":1,"source":...,
//              "num_layers":L,"num_experts":E,"tokens":T,"load":[[...E...] x L]}
struct ExpertStats {
  std::string source;
  int32_t num_layers = 0, num_experts = 0;
  uint64_t tokens = 0;                       // distinct (step, seq, pos) rows of layer 0
  std::vector<std::vector<uint64_t>> load;   // [layer][expert]
};
// Layers and experts come from the trace (or from its records when those are 0);
// throws Error(InvalidArgument) for an empty trace or a record out of range.
ExpertStats aggregate_stats(const RoutingTrace& trace);
// Writes PATH.tmp.XXXXXX, renamed to PATH when complete. Throws Error(Io|InvalidArgument).
void save_expert_stats(const ExpertStats& s, const std::string& path);
// Validates format/version, dimensions > 0, the load matrix shape and that every
// count is a non-negative integer. Throws Error(Io|Format).
ExpertStats load_expert_stats(const std::string& path);
// The keys (layer * num_experts + expert) of the `limit` most loaded experts,
// most loaded first, ties in key order: what the pinned cache policy keeps.
std::vector<uint64_t> hottest_experts(const ExpertStats& st, size_t limit);

}  // namespace colibri
