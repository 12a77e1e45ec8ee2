// placement.h: which rank(s) own each (layer, expert). Placement decides only
// speed, never results.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace colibri {

class Placement {
 public:
  // Every expert of every layer on `rank` (the one-process engine).
  static Placement single(int num_layers, int num_experts, int rank = 0);

  int num_layers() const { return layers_; }
  int num_experts() const { return experts_; }
  // The owning ranks of an expert (at least one; more when replicated).
  const std::vector<int>& owners(int layer, int expert) const {
    return owners_[static_cast<size_t>(layer) * experts_ + expert];
  }
  // The rank that serves (row, expert): replicas are chosen by row, so the
  // choice is deterministic and spreads rows over replicas.
  int owner_for_row(int layer, int expert, int64_t row) const {
    const auto& o = owners(layer, expert);
    return o[static_cast<size_t>(row) % o.size()];
  }
  // True when `rank` owns (layer, expert).
  bool owns(int rank, int layer, int expert) const;

 private:
  int layers_ = 0, experts_ = 0;
  std::vector<std::vector<int>> owners_;  // [layer * experts + expert]
};

}  // namespace colibri
