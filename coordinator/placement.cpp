// placement.cpp: expert-to-rank maps.
#include "coordinator/placement.h"

#include <algorithm>

namespace colibri {

Placement Placement::single(int num_layers, int num_experts, int rank) {
  Placement p;
  p.layers_ = num_layers;
  p.experts_ = num_experts;
  p.owners_.assign(static_cast<size_t>(num_layers) * num_experts, std::vector<int>{rank});
  return p;
}

bool Placement::owns(int rank, int layer, int expert) const {
  const auto& o = owners(layer, expert);
  return std::find(o.begin(), o.end(), rank) != o.end();
}

}  // namespace colibri
