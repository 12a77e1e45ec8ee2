// routing_trace.h: routing traces (which experts each token chose at each
// layer) and the expert-load statistics aggregated from them. Our own JSONL
// format is written by `--record-routing`; the real Mixtral-8x7B traces in
// ../shared/traces/ are read by the same reader (auto-detected).
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
  std::vector<RoutingRecord> records;  // in time order (step, then layer, then seq, pos)
};

// Writes our JSONL format: a header line
//   {"format":"colibri-routing","version":1,"num_layers":L,"num_experts":E,"top_k":K}
// then one line per (step, layer, token):
//   {"step":S,"layer":L,"seq":I,"pos":P,"experts":[...],"weights":[...]}
class RoutingTraceWriter {
 public:
  RoutingTraceWriter(const std::string& path, int num_layers, int num_experts, int top_k);  // throws Error(Io)
  ~RoutingTraceWriter();
  void write(int64_t step, int layer, int seq, int pos, const int32_t* experts, const float* weights, int k);
  void flush();

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

// Expert load: how many tokens selected each expert of each layer.
// STATS.json: {"format":"colibri-expert-stats","version":1,"source":...,
//              "num_layers":L,"num_experts":E,"tokens":T,"load":[[...E...] x L]}
struct ExpertStats {
  std::string source;
  int32_t num_layers = 0, num_experts = 0;
  uint64_t tokens = 0;                       // distinct (step, seq, pos) rows of layer 0
  std::vector<std::vector<uint64_t>> load;   // [layer][expert]
};
ExpertStats aggregate_stats(const RoutingTrace& trace);
void save_expert_stats(const ExpertStats& s, const std::string& path);  // throws Error(Io)
ExpertStats load_expert_stats(const std::string& path);                 // throws Error(Io|Format)

}  // namespace colibri
