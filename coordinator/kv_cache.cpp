// kv_cache.cpp: the KV cache's block pool and its CPU storage.
#include "coordinator/kv_cache.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <new>
#include <string>

#include "model/error.h"

namespace colibri {

KvBlockPool::KvBlockPool(int64_t num_blocks, int64_t block_tokens, int64_t max_slots, int64_t max_ctx)
    : blocks_(num_blocks), bt_(block_tokens), slots_(max_slots) {
  if (num_blocks < 1 || block_tokens < 1 || max_slots < 1 || max_ctx < 1)
    throw Error(Status::InvalidArgument, "a KV cache needs at least one block, slot and position (blocks " +
                                             std::to_string(num_blocks) + ", block size " + std::to_string(block_tokens) + ")");
  if (num_blocks > (int64_t{1} << 30)) throw Error(Status::InvalidArgument, "more than 2^30 KV cache blocks");
  per_slot_ = (max_ctx + bt_ - 1) / bt_;
  table_.assign(static_cast<size_t>(slots_ * per_slot_), -1);
  held_.assign(static_cast<size_t>(slots_), 0);
  free_.resize(static_cast<size_t>(blocks_));
  // A min-heap (ascending is one): the lowest free id is taken first.
  for (int64_t i = 0; i < blocks_; ++i) free_[static_cast<size_t>(i)] = static_cast<int32_t>(i);
}

bool KvBlockPool::reserve(int slot, int64_t n) {
  const int64_t need = blocks_for(n), have = held_[static_cast<size_t>(slot)];
  if (need > per_slot_)
    throw Error(Status::InvalidArgument, "KV cache: " + std::to_string(n) + " positions exceed the context");
  if (need <= have) return true;
  if (need - have > free_blocks()) return false;
  int32_t* t = table_.data() + static_cast<size_t>(slot) * per_slot_;
  for (int64_t b = have; b < need; ++b) {
    std::pop_heap(free_.begin(), free_.end(), std::greater<int32_t>());
    t[b] = free_.back();
    free_.pop_back();
  }
  held_[static_cast<size_t>(slot)] = need;
  ++version_;
  return true;
}

void KvBlockPool::release(int slot) {
  int32_t* t = table_.data() + static_cast<size_t>(slot) * per_slot_;
  const int64_t have = held_[static_cast<size_t>(slot)];
  if (have == 0) return;
  for (int64_t b = 0; b < have; ++b) {
    free_.push_back(t[b]);
    std::push_heap(free_.begin(), free_.end(), std::greater<int32_t>());
    t[b] = -1;
  }
  held_[static_cast<size_t>(slot)] = 0;
  ++version_;
}

KVCache::KVCache(int64_t layers, const KvBlockPool& pool, int64_t k_width, int64_t v_width, DType dtype)
    : pool_(pool), rows_(pool.num_blocks() * pool.block_tokens()), kw_(k_width), vw_(v_width), dtype_(dtype),
      es_(element_bytes(dtype)) {
  if (!storable(dtype))
    throw Error(Status::InvalidArgument, std::string("KV cache dtype ") + dtype_name(dtype) + ": f32, bf16 or f16");
  uint64_t n = 1;
  for (int64_t f : {layers, rows_, k_width + v_width, es_})
    if (f < 0 || __builtin_mul_overflow(n, static_cast<uint64_t>(f), &n) || n > (uint64_t(1) << 46))
      throw Error(Status::OutOfMemory, "a KV cache of " + std::to_string(layers) + " layers x " + std::to_string(rows_) +
                                           " positions is too large; lower --kv-cache-mb, the batch or the context size");
  bytes_ = n;
  const size_t per = static_cast<size_t>(layers * rows_ * es_);
  try {
    k_.reset(new uint8_t[per * static_cast<size_t>(k_width) + 4]);
    v_.reset(new uint8_t[per * static_cast<size_t>(v_width) + 4]);
  } catch (const std::bad_alloc&) {
    throw Error(Status::OutOfMemory, "KV cache of " + std::to_string(n >> 20) +
                                         " MiB does not fit; lower --kv-cache-mb, the batch or the context size");
  }
}

void KVCache::store(int64_t layer, int64_t slot, int64_t pos, const float* k, const float* v) {
  const int64_t r = row(slot, pos);
  uint8_t* kd = k_.get() + index(layer, r, kw_);
  uint8_t* vd = v ? v_.get() + index(layer, r, vw_) : nullptr;
  if (dtype_ == DType::F32) {
    std::memcpy(kd, k, static_cast<size_t>(kw_) * sizeof(float));
    if (vd) std::memcpy(vd, v, static_cast<size_t>(vw_) * sizeof(float));
    return;
  }
  uint16_t (*cvt)(float) = dtype_ == DType::BF16 ? f32_to_bf16 : f32_to_f16;
  uint16_t* k16 = reinterpret_cast<uint16_t*>(kd);
  for (int64_t i = 0; i < kw_; ++i) k16[i] = cvt(k[i]);
  if (vd) {
    uint16_t* v16 = reinterpret_cast<uint16_t*>(vd);
    for (int64_t i = 0; i < vw_; ++i) v16[i] = cvt(v[i]);
  }
}

}  // namespace colibri
