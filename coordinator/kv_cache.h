// kv_cache.h: the key/value cache of the coordinator's attention, allocated
// once for the maximum batch and context.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace colibri {

class KVCache {
 public:
  KVCache(int64_t layers, int64_t max_seqs, int64_t max_ctx, int64_t kv_heads, int64_t head_dim);
  // rows: [layer][seq][pos][kv_heads * head_dim] f32
  float* k(int64_t layer, int64_t seq, int64_t pos) { return k_.get() + index(layer, seq, pos); }
  float* v(int64_t layer, int64_t seq, int64_t pos) { return v_.get() + index(layer, seq, pos); }
  int64_t max_seqs() const { return seqs_; }
  int64_t max_ctx() const { return ctx_; }
  uint64_t bytes() const { return 2 * n_ * sizeof(float); }

 private:
  size_t index(int64_t layer, int64_t seq, int64_t pos) const {
    return static_cast<size_t>(((layer * seqs_ + seq) * ctx_ + pos) * width_);
  }
  int64_t seqs_, ctx_, width_;
  size_t n_ = 0;
  // NOTE: left uninitialised: pages are only touched (committed) as positions fill.
  std::unique_ptr<float[]> k_, v_;
};

}  // namespace colibri
