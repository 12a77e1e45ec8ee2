// expert_store.cpp: lazy, checksum-verified materialisation of experts.
#include "worker/expert_store.h"

namespace colibri {

ExpertStore::ExpertStore(std::shared_ptr<const ColibriFile> file) : file_(std::move(file)) {
  const auto& c = file_->config();
  resident_.assign(static_cast<size_t>(c.num_layers * c.num_experts), 0);
}

bool ExpertStore::resident(int layer, int expert) const {
  return resident_[static_cast<size_t>(layer) * file_->config().num_experts + expert] != 0;
}

const ExpertView& ExpertStore::get(int layer, int expert) {
  const ExpertView& e = file_->expert(layer, expert);
  uint8_t& r = resident_[static_cast<size_t>(layer) * file_->config().num_experts + expert];
  if (r) {
    ++stats_.hits;
    return e;
  }
  file_->prefetch(e.offset, e.size);
  file_->verify_expert(e);  // reads the whole block: it is resident afterwards
  r = 1;
  ++stats_.misses;
  stats_.bytes_loaded += e.size;
  return e;
}

}  // namespace colibri
