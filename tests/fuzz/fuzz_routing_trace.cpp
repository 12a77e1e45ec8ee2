// fuzz_routing_trace.cpp: libFuzzer target for the routing-trace reader
// (read_routing_trace: our JSONL format and the Mixtral import format) and the
// expert-stats reader (load_expert_stats). Each input is given to both, as a
// file; what they accept goes on to what `colibri stats` and `colibri place`
// do with it (aggregate_stats, make_placement, predicted_balancedness).
#include <string>

#include "fuzz_support.h"
#include "model/placement.h"
#include "model/routing_trace.h"

using namespace colibri;
using fuzz::expect_only_colibri_errors;

namespace {

void check_trace(const RoutingTrace& t) {
  FUZZ_CHECK(t.num_layers >= 1 && t.num_experts >= 1 && t.top_k >= 1, "trace dimensions");
  for (size_t i = 0; i < t.records.size(); ++i) {
    const auto& r = t.records[i];
    FUZZ_CHECK(r.layer >= 0 && r.layer < t.num_layers, "record layer out of range");
    FUZZ_CHECK(r.step >= 0 && r.seq >= 0 && r.pos >= 0, "negative step, seq or pos");
    FUZZ_CHECK(!r.experts.empty() && r.experts.size() == r.weights.size(), "experts and weights differ in length");
    FUZZ_CHECK(static_cast<int32_t>(r.experts.size()) <= t.top_k, "row longer than top_k");
    for (int32_t e : r.experts) FUZZ_CHECK(e >= 0 && e < t.num_experts, "expert out of range");
    if (i > 0) FUZZ_CHECK(t.records[i - 1].step <= r.step, "records not in step order");
  }
}

void use_stats(const ExpertStats& s) {
  FUZZ_CHECK(s.num_layers >= 1 && s.num_experts >= 1, "stats dimensions");
  FUZZ_CHECK(s.load.size() == static_cast<size_t>(s.num_layers), "load rows");
  for (const auto& row : s.load) FUZZ_CHECK(row.size() == static_cast<size_t>(s.num_experts), "load row length");
  // `colibri place --stats`: only for small models, to keep each run fast.
  if (static_cast<int64_t>(s.num_layers) * s.num_experts > 4096) return;
  for (const char* policy : {"balanced", "replicated"}) {
    Placement p;
    if (!expect_only_colibri_errors("make_placement", [&] {
          p = make_placement(policy, s.num_layers, s.num_experts, 5, false, &s, policy[0] == 'r' ? 2 : 0);
        }))
      continue;
    expect_only_colibri_errors("predicted_balancedness", [&] {
      Balancedness b = predicted_balancedness(p, s);
      FUZZ_CHECK(b.worst >= 0 && b.worst <= 1 + 1e-9 && b.mean >= 0 && b.mean <= 1 + 1e-9,
                 "balancedness outside [0, 1]: mean " + std::to_string(b.mean) + ", worst " + std::to_string(b.worst));
    });
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto& in = fuzz::InputFile::get();
  const int fds = fuzz::lowest_free_fd();
  in.set(data, size);
  const std::string& path = in.path();

  RoutingTrace t;
  if (expect_only_colibri_errors("read_routing_trace", [&] { t = read_routing_trace(path); })) {
    check_trace(t);
    ExpertStats s;
    if (expect_only_colibri_errors("aggregate_stats", [&] { s = aggregate_stats(t); })) use_stats(s);
  }
  ExpertStats s;
  if (expect_only_colibri_errors("load_expert_stats", [&] { s = load_expert_stats(path); })) use_stats(s);
  fuzz::check_no_fd_leak(fds);
  return 0;
}
