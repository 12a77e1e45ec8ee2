// kv_cache.h: the paged key/value cache of the coordinator's attention.
//
// KvBlockPool is the bookkeeping (vLLM's block pool and block tables): the
// cache holds `num_blocks` blocks of `block_tokens` positions; a free list;
// and for each sequence slot (the scheduler's running sequences, at most
// `max_slots`) a block table mapping its positions to blocks, so that memory
// follows the tokens the sequences hold, not max_slots x max_context.
// A slot's position p lives in row table[p / block_tokens] * block_tokens +
// p % block_tokens of every layer's cache.
//
// KVCache is the CPU backend's storage of those rows (the CUDA backend keeps
// its own on the device, addressed by the same tables). Rows are [k_width] and
// [v_width] values (f32, bf16 or f16: EngineOptions::kv_dtype): K and V of every kv head (kv_heads * head_dim each), or for
// multi-head latent attention the normalised latent plus the rotated shared
// key part in K (kv_lora_rank + qk_rope_head_dim) and nothing in V.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "model/dtype.h"

namespace colibri {

class KvBlockPool {
 public:
  // Throws Error(InvalidArgument) for sizes < 1.
  KvBlockPool(int64_t num_blocks, int64_t block_tokens, int64_t max_slots, int64_t max_ctx);

  int64_t num_blocks() const { return blocks_; }
  int64_t block_tokens() const { return bt_; }
  int64_t max_slots() const { return slots_; }
  // Table entries per slot: enough blocks for max_ctx positions.
  int64_t blocks_per_slot() const { return per_slot_; }
  int64_t free_blocks() const { return static_cast<int64_t>(free_.size()); }
  // Blocks needed to hold n positions.
  int64_t blocks_for(int64_t n) const { return (n + bt_ - 1) / bt_; }
  // Positions slot s can hold with the blocks it has.
  int64_t capacity(int slot) const { return held_[static_cast<size_t>(slot)] * bt_; }

  // Grows slot s to hold positions [0, n) (n <= max_ctx); true on success.
  // When the free blocks do not suffice it takes none and returns false.
  bool reserve(int slot, int64_t n);
  // Returns every block of slot s to the free list.
  void release(int slot);
  // [max_slots][blocks_per_slot] block ids; -1 where a slot has no block.
  const int32_t* tables() const { return table_.data(); }
  const int32_t* table(int slot) const { return table_.data() + static_cast<size_t>(slot) * per_slot_; }
  // Incremented by every change of a table (the CUDA backend copies them then).
  uint64_t version() const { return version_; }

 private:
  int64_t blocks_, bt_, slots_, per_slot_;
  std::vector<int32_t> table_;
  std::vector<int64_t> held_;  // blocks per slot
  // Free block ids, a min-heap: the lowest is taken first, so that the blocks
  // in use (and the memory pages they touched) stay at the front of the buffer.
  std::vector<int32_t> free_;
  uint64_t version_ = 0;
};

class KVCache {
 public:
  // Storage for every block of `pool`, every layer, in `dtype` (F32, or BF16 /
  // F16: half the bytes, each value rounded to nearest even when stored and
  // widened exactly when read). Throws Error(OutOfMemory), Error(InvalidArgument)
  // for another dtype.
  KVCache(int64_t layers, const KvBlockPool& pool, int64_t k_width, int64_t v_width, DType dtype = DType::F32);
  DType dtype() const { return dtype_; }
  // Writes the rows of (slot, pos) in `layer`: k_width values of k, and v_width of
  // v unless v is null.
  void store(int64_t layer, int64_t slot, int64_t pos, const float* k, const float* v);
  // Position pos's key row as stored (k_width values of dtype()).
  const void* k_row(int64_t layer, int64_t slot, int64_t pos) const {
    return k_.get() + index(layer, row(slot, pos), kw_);
  }
  // Row 0 of a layer's keys / values (KernelTable::attend's base with a table):
  // floats for F32, uint16_t for BF16 / F16.
  const void* k_layer(int64_t layer) const { return k_.get() + index(layer, 0, kw_); }
  const void* v_layer(int64_t layer) const { return v_.get() + index(layer, 0, vw_); }
  uint64_t bytes() const { return bytes_; }
  // Bytes per stored value: 4 (F32) or 2.
  static int64_t element_bytes(DType t) { return t == DType::F32 ? 4 : 2; }
  // The types a cache can store: F32, BF16, F16.
  static bool storable(DType t) { return t == DType::F32 || t == DType::BF16 || t == DType::F16; }

 private:
  int64_t row(int64_t slot, int64_t pos) const {
    const int64_t bt = pool_.block_tokens();
    return static_cast<int64_t>(pool_.table(static_cast<int>(slot))[pos / bt]) * bt + pos % bt;
  }
  size_t index(int64_t layer, int64_t row, int64_t w) const {
    return static_cast<size_t>((layer * rows_ + row) * w * es_);
  }
  const KvBlockPool& pool_;
  int64_t rows_, kw_, vw_;
  DType dtype_;
  int64_t es_;  // element bytes
  uint64_t bytes_ = 0;
  // NOTE: left uninitialised: pages are only touched (committed) as blocks fill.
  std::unique_ptr<uint8_t[]> k_, v_;
};

}  // namespace colibri
