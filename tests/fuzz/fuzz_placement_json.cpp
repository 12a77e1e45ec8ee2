// fuzz_placement_json.cpp: libFuzzer target for the placement file parser
// (Placement::from_json). An accepted placement must validate, answer its
// queries, and survive to_json() -> from_json() unchanged.
#include <string>

#include "fuzz_support.h"
#include "model/placement.h"

using namespace colibri;
using fuzz::expect_only_colibri_errors;

namespace {

bool same(const Placement& a, const Placement& b) {
  if (a.world_size() != b.world_size() || a.num_layers() != b.num_layers() || a.num_experts() != b.num_experts() ||
      a.coordinator_hosts_experts() != b.coordinator_hosts_experts() || a.policy() != b.policy())
    return false;
  for (int l = 0; l < a.num_layers(); ++l)
    for (int e = 0; e < a.num_experts(); ++e)
      if (a.owners(l, e) != b.owners(l, e)) return false;
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  Placement p;
  if (!expect_only_colibri_errors("Placement::from_json", [&] { p = Placement::from_json(text, "fuzz"); })) return 0;
  try {
    p.validate();
  } catch (const std::exception& e) {
    fuzz::finding("Placement::from_json", std::string("accepted a placement that validate() rejects: ") + e.what());
  }
  FUZZ_CHECK(p.world_size() >= 1 && p.num_layers() >= 1 && p.num_experts() >= 1, "accepted empty dimensions");
  for (int l = 0; l < p.num_layers(); ++l) {
    int total = 0;
    for (int r = 0; r < p.world_size() && r < 64; ++r) total += static_cast<int>(p.local_experts(r, l).size());
    (void)total;
    (void)p.redundant(l);
    for (int e = 0; e < p.num_experts(); ++e) {
      const int r = p.owner_for_row(l, e, 12345);
      FUZZ_CHECK(r >= 0 && r < p.world_size() && p.owns(r, l, e), "owner_for_row gave a rank that does not own the expert");
    }
  }
  Placement q;
  const std::string again = p.to_json();
  try {
    q = Placement::from_json(again, "round trip");
  } catch (const std::exception& e) {
    fuzz::finding("Placement::to_json", std::string("its output does not parse back: ") + e.what() + "\n" + again);
  }
  FUZZ_CHECK(same(p, q), "to_json() -> from_json() changed the placement:\n" + again);
  return 0;
}
