// kv_cache.cpp: KV cache storage.
#include "coordinator/kv_cache.h"

#include <new>

#include "model/error.h"

namespace colibri {

KVCache::KVCache(int64_t layers, int64_t max_seqs, int64_t max_ctx, int64_t k_width, int64_t v_width)
    : seqs_(max_seqs), ctx_(max_ctx), kw_(k_width), vw_(v_width) {
  uint64_t n = 1;
  for (int64_t f : {layers, max_seqs, max_ctx, k_width + v_width, int64_t{sizeof(float)}})
    if (f < 0 || __builtin_mul_overflow(n, static_cast<uint64_t>(f), &n) || n > (uint64_t(1) << 46))
      throw Error(Status::OutOfMemory, "a KV cache of " + std::to_string(layers) + " layers x " + std::to_string(max_seqs) +
                                           " sequences x " + std::to_string(max_ctx) + " positions is too large; lower the batch or context size");
  bytes_ = n;
  const size_t per = static_cast<size_t>(layers * max_seqs * max_ctx);
  try {
    k_.reset(new float[per * static_cast<size_t>(k_width) + 1]);
    v_.reset(new float[per * static_cast<size_t>(v_width) + 1]);
  } catch (const std::bad_alloc&) {
    throw Error(Status::OutOfMemory, "KV cache of " + std::to_string(n >> 20) + " MiB does not fit; lower the batch or context size");
  }
}

}  // namespace colibri
