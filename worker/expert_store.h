// expert_store.h: a worker's view of its experts. Experts are materialised
// lazily, on first use: the block's checksum is verified then, and the pages
// are asked for ahead. The host tier is the mmapped model file.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "model/colibri_file.h"

namespace colibri {

struct ExpertStoreStats {
  uint64_t hits = 0;
  uint64_t misses = 0;        // first uses (materialisations)
  uint64_t bytes_loaded = 0;  // bytes materialised
  uint64_t evictions = 0;
};

class ExpertStore {
 public:
  explicit ExpertStore(std::shared_ptr<const ColibriFile> file);
  // The expert's weights, materialised on first use. Throws Error(Checksum).
  const ExpertView& get(int layer, int expert);
  bool resident(int layer, int expert) const;
  const ExpertStoreStats& stats() const { return stats_; }

 private:
  std::shared_ptr<const ColibriFile> file_;
  std::vector<uint8_t> resident_;  // [layer * experts + expert]
  ExpertStoreStats stats_;
};

}  // namespace colibri
