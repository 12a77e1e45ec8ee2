// kv_cache.cpp: KV cache storage.
#include "coordinator/kv_cache.h"

#include <new>

#include "model/error.h"

namespace colibri {

KVCache::KVCache(int64_t layers, int64_t max_seqs, int64_t max_ctx, int64_t kv_heads, int64_t head_dim)
    : seqs_(max_seqs), ctx_(max_ctx), width_(kv_heads * head_dim) {
  const size_t n = static_cast<size_t>(layers * max_seqs * max_ctx * width_);
  try {
    k_.resize(n);
    v_.resize(n);
  } catch (const std::bad_alloc&) {
    throw Error(Status::OutOfMemory, "KV cache of " + std::to_string(2 * n * sizeof(float) >> 20) +
                                         " MiB does not fit; lower the batch or context size");
  }
}

}  // namespace colibri
