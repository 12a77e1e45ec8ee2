// expert_store.cpp: lazy, checksum-verified materialisation and the budgeted
// fast tier driven by an ExpertCache policy.
#include "worker/expert_store.h"

#include <cstdlib>
#include <cstring>

#include "model/error.h"
#include "model/mapped_file.h"

namespace colibri {

ExpertStore::ExpertStore(std::shared_ptr<const ColibriFile> file, const ExpertStoreOptions& opts,
                         const std::vector<uint64_t>& owned)
    : file_(std::move(file)), experts_(file_->config().num_experts), block_(file_->experts().front().size) {
  const size_t keys = file_->experts().size();
  verified_.assign(keys, 0);
  if (opts.budget_bytes == 0 && opts.budget_experts == 0) return;  // no fast tier

  uint64_t slots = opts.budget_experts > 0 ? static_cast<uint64_t>(opts.budget_experts) : opts.budget_bytes / block_;
  if (slots == 0)
    throw Error(Status::InvalidArgument, "expert cache budget of " + std::to_string(opts.budget_bytes) +
                                             " bytes is smaller than one expert (" + std::to_string(block_) + " bytes)");
  // NOTE: never more slots than experts owned: a bigger budget holds them all.
  slots = std::min<uint64_t>(slots, std::max<size_t>(owned.size(), 1));
  CacheOptions co;
  co.bytes_per_slot = block_;
  co.max_keys = keys;  // per-key tables allocated once, here
  co.num_experts = static_cast<uint32_t>(experts_);
  co.decay = opts.decay;
  for (uint64_t k : opts.pinned)
    for (uint64_t o : owned)
      if (o == k) co.pinned.push_back(k);  // pin only what this rank serves
  if (co.pinned.size() > slots) co.pinned.resize(slots);
  cache_ = ExpertCache::create(opts.policy, slots, co);
  slots_ = static_cast<size_t>(slots);
  const size_t bytes = slots_ * block_;
  arena_ = static_cast<uint8_t*>(std::aligned_alloc(kBlockAlign, (bytes + kBlockAlign - 1) / kBlockAlign * kBlockAlign));
  if (!arena_)
    throw Error(Status::OutOfMemory, "cannot allocate the expert cache of " + std::to_string(bytes >> 20) + " MiB");
  slot_of_.assign(keys, -1);
  key_in_.assign(slots_, -1);
  views_.resize(slots_);
  for (size_t s = slots_; s-- > 0;) free_.push_back(static_cast<int32_t>(s));
  // Pinned experts are loaded now and stay: the policy counts them resident.
  for (uint64_t k : co.pinned) load(k, file_->experts()[k]);
}

ExpertStore::~ExpertStore() { std::free(arena_); }

void ExpertStore::hint(const uint64_t* keys, size_t n) {
  if (cache_) cache_->hint_upcoming(keys, n);
}

CacheStats ExpertStore::stats() const { return cache_ ? cache_->stats() : direct_; }

bool ExpertStore::verify(const ExpertView& src) const {
  try {
    file_->verify_expert(src);
    return true;
  } catch (const Error& e) {
    // NOTE: a block read from a file truncated or rewritten under the run is
    // served as it is: the run ends at the end of this forward pass (the
    // engine's check, or the worker's report in cluster::end_pass) with every
    // token so far, instead of dying mid-exchange. A corrupt block throws.
    if (e.status() == Status::FileChanged) return false;
    throw;
  }
}

const ExpertView& ExpertStore::get(int layer, int expert, uint64_t now) {
  const ExpertView& src = file_->expert(layer, expert);
  const uint64_t key = static_cast<uint64_t>(layer) * experts_ + expert;
  if (!cache_) {
    if (verified_[key]) {
      ++direct_.hits;
      return src;
    }
    file_->prefetch(src.offset, src.size);
    verified_[key] = verify(src);  // reads the whole block: resident afterwards
    ++direct_.misses;
    direct_.bytes_loaded += src.size;
    return src;
  }
  int64_t evicted = -1;
  const bool hit = cache_->access(key, now, &evicted);
  if (hit) {
    const int32_t s = slot_of_[key];
    if (s < 0) throw Error(Status::Internal, "expert cache reports a hit for a block that is not resident");
    return views_[static_cast<size_t>(s)];
  }
  if (!cache_->resident(key)) {
    // The policy admitted nothing (every slot is pinned): served straight
    // from the host tier, verified once.
    if (!verified_[key]) verified_[key] = verify(src);
    return src;
  }
  if (evicted >= 0) {
    const int32_t s = slot_of_[static_cast<size_t>(evicted)];
    if (s < 0) throw Error(Status::Internal, "expert cache evicted a block that is not resident");
    slot_of_[static_cast<size_t>(evicted)] = -1;
    key_in_[static_cast<size_t>(s)] = -1;
    free_.push_back(s);
  }
  return load(key, src);
}

const ExpertView& ExpertStore::load(uint64_t key, const ExpertView& src) {
  if (free_.empty()) throw Error(Status::Internal, "expert cache is full but evicted nothing");
  const int32_t s = free_.back();
  free_.pop_back();
  uint8_t* dst = arena_ + static_cast<size_t>(s) * block_;
  std::memcpy(dst, src.block, src.size);
  // The copy is what gets used, so the checksum is checked on it (first load).
  if (!verified_[key]) {
    bool ok = true;
    if (checksum64(dst, src.size) != src.checksum) {
      free_.push_back(s);  // the slot stays usable; the error propagates
      ok = verify(src);    // throws with the full message (unless the file changed)
      free_.pop_back();
    }
    verified_[key] = ok;
  }
  release_mapped_pages(src.block, src.size);  // the host tier's pages are not needed now
  ExpertView& v = views_[static_cast<size_t>(s)];
  v = rebase(src, dst);
  slot_of_[key] = s;
  key_in_[static_cast<size_t>(s)] = static_cast<int64_t>(key);
  return v;
}

}  // namespace colibri
