// kv_cache.h: the key/value cache of the coordinator's attention, allocated
// once for the maximum batch and context. Rows are [k_width] and [v_width]
// floats: K and V of every kv head (kv_heads * head_dim each), or for
// multi-head latent attention the normalised latent plus the rotated shared
// key part in K (kv_lora_rank + qk_rope_head_dim) and nothing in V.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace colibri {

class KVCache {
 public:
  KVCache(int64_t layers, int64_t max_seqs, int64_t max_ctx, int64_t k_width, int64_t v_width);
  float* k(int64_t layer, int64_t seq, int64_t pos) { return k_.get() + index(layer, seq, pos, kw_); }
  float* v(int64_t layer, int64_t seq, int64_t pos) { return v_.get() + index(layer, seq, pos, vw_); }
  int64_t max_seqs() const { return seqs_; }
  int64_t max_ctx() const { return ctx_; }
  uint64_t bytes() const { return bytes_; }

 private:
  size_t index(int64_t layer, int64_t seq, int64_t pos, int64_t w) const {
    return static_cast<size_t>(((layer * seqs_ + seq) * ctx_ + pos) * w);
  }
  int64_t seqs_, ctx_, kw_, vw_;
  uint64_t bytes_ = 0;
  // NOTE: left uninitialised: pages are only touched (committed) as positions fill.
  std::unique_ptr<float[]> k_, v_;
};

}  // namespace colibri
