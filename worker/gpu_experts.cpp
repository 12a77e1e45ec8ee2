// gpu_experts.cpp: the GPU fast tier (see gpu_experts.h): the host-side slot
// planner, and the device side (CUDA builds only).
#include "worker/gpu_experts.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "model/error.h"

#ifdef COLIBRI_HAVE_CUDA
#include <spdlog/spdlog.h>

#include "kernels/cuda/device_info.h"
#include "kernels/cuda/ffn.h"
#include "kernels/cuda/ffn_pack.h"
#include "kernels/cuda/memory.h"
#include "model/mapped_file.h"
#endif

namespace colibri {

// ---- Host side ----

size_t gpu_tier_slots(const ExpertStoreOptions& o, uint64_t slot_bytes, size_t owned) {
  const size_t all = std::max<size_t>(owned, 1);
  if (o.budget_bytes == 0 && o.budget_experts == 0) return all;  // no budget: every owned expert resident
  if (slot_bytes == 0) throw Error(Status::Internal, "GPU fast tier: an expert of 0 bytes");
  const uint64_t slots =
      o.budget_experts > 0 ? static_cast<uint64_t>(o.budget_experts) : o.budget_bytes / slot_bytes;
  if (slots == 0)  // the CPU store's refusal (worker/expert_store.cpp), with the GPU's expert size
    throw Error(Status::InvalidArgument, "expert cache budget of " + std::to_string(o.budget_bytes) +
                                             " bytes is smaller than one expert (" + std::to_string(slot_bytes) +
                                             " bytes as packed for the GPU)");
  return static_cast<size_t>(std::min<uint64_t>(slots, all));  // a bigger budget holds them all
}

std::string gpu_host_tier_request(const ExpertStoreOptions& o) {
  std::string v = o.gpu_host_tier.empty() ? "auto" : o.gpu_host_tier;
  std::string where = "GPU host tier";
  if (v == "auto")
    if (const char* e = std::getenv("COLIBRI_GPU_HOST_TIER"); e && *e) {
      v = e;
      where = "COLIBRI_GPU_HOST_TIER";
    }
  if (v != "auto" && v != "pinned" && v != "staging")
    throw Error(Status::InvalidArgument, where + " '" + v + "' (auto, pinned or staging)");
  return v;
}

GpuTierPlanner::GpuTierPlanner(const ExpertStoreOptions& opts, uint64_t slot_bytes, const std::vector<uint64_t>& owned,
                               uint64_t max_keys, uint32_t num_experts)
    : budgeted_(opts.budget_bytes != 0 || opts.budget_experts != 0), slot_bytes_(slot_bytes) {
  capacity_ = gpu_tier_slots(opts, slot_bytes, owned.size());
  for (uint64_t k : owned)
    if (k >= max_keys)
      throw Error(Status::Internal, "GPU fast tier: expert key " + std::to_string(k) + " is out of range (" +
                                        std::to_string(max_keys) + " keys)");
  CacheOptions co;
  co.bytes_per_slot = slot_bytes;
  co.max_keys = max_keys;  // per-key tables allocated once, here
  co.num_experts = num_experts;
  co.decay = opts.decay;
  std::string policy = opts.policy;
  if (!budgeted_) {
    // Every owned expert resident and never evicted: the pinned policy over all of them.
    policy = "pinned";
    co.pinned = owned;
  } else {
    // As the CPU store: pin only what this rank serves, at most capacity (the
    // hottest first, in the order given); a key named twice is pinned once.
    std::vector<uint8_t> mine(max_keys, 0);
    for (uint64_t k : owned) mine[k] = 1;
    for (uint64_t k : opts.pinned)
      if (k < max_keys && mine[k] == 1 && co.pinned.size() < capacity_) {
        co.pinned.push_back(k);
        mine[k] = 2;
      }
  }
  cache_ = ExpertCache::create(policy, capacity_, co);
  const bool pins = policy == "pinned";
  // The pinned keys fill every slot while others remain: the policy serves those
  // others without caching them; they need a slot of their own to be computed from.
  if (budgeted_ && pins && co.pinned.size() == capacity_ && capacity_ < owned.size())
    bypass_ = static_cast<int32_t>(capacity_);
  const size_t dev = device_slots();
  slot_of_.assign(max_keys, -1);
  key_in_.assign(dev, -1);
  slot_epoch_.assign(dev, 0);
  slot_last_.assign(dev, -1);
  for (size_t s = capacity_; s-- > 0;) free_.push_back(static_cast<int32_t>(s));
  if (pins)
    for (uint64_t k : co.pinned) {  // resident from the start (the policy counts them so)
      const int32_t s = free_.back();
      free_.pop_back();
      slot_of_[k] = s;
      key_in_[static_cast<size_t>(s)] = static_cast<int64_t>(k);
      preload_.push_back({k, s});
    }
  const size_t per_layer = std::max<size_t>(num_experts, 1);
  items_.reserve(per_layer);
  ops_.reserve(2 * per_layer);
}

CacheStats GpuTierPlanner::stats() const {
  CacheStats s = cache_->stats();
  if (!budgeted_) {  // every owned expert loaded once, at start
    s.misses += preload_.size();
    s.bytes_loaded += preload_.size() * slot_bytes_;
  }
  return s;
}

void GpuTierPlanner::plan(const uint64_t* keys, size_t n, uint64_t now, bool loads_first) {
  items_.clear();
  ops_.clear();
  // Tell the policy what this layer needs before anything is loaded or evicted.
  cache_->hint_upcoming(keys, n);
  ++epoch_;
  for (size_t i = 0; i < n; ++i) {
    const uint64_t key = keys[i];
    if (key >= slot_of_.size())
      throw Error(Status::Internal, "GPU fast tier: expert key " + std::to_string(key) + " is out of range");
    int64_t evicted = -1;
    const bool hit = cache_->access(key, now, &evicted);
    Item it;
    it.key = key;
    it.load = !hit;
    if (hit) {
      it.slot = slot_of_[key];
      if (it.slot < 0)
        throw Error(Status::Internal, "GPU expert cache reports a hit for expert key " + std::to_string(key) +
                                          ", which no slot holds");
    } else if (!cache_->resident(key)) {
      // Every slot pinned: served without caching, through the bypass slot.
      if (bypass_ < 0) throw Error(Status::Internal, "GPU expert cache admitted nothing, and there is no bypass slot");
      it.slot = bypass_;
    } else {
      if (evicted >= 0) {
        const int32_t s = slot_of_[static_cast<size_t>(evicted)];
        if (s < 0) throw Error(Status::Internal, "GPU expert cache evicted an expert no slot holds");
        slot_of_[static_cast<size_t>(evicted)] = -1;
        key_in_[static_cast<size_t>(s)] = -1;
        free_.push_back(s);  // within the reserved capacity: no allocation
      }
      if (free_.empty()) throw Error(Status::Internal, "GPU expert cache is full but evicted nothing");
      it.slot = free_.back();
      free_.pop_back();
      slot_of_[key] = it.slot;
      key_in_[static_cast<size_t>(it.slot)] = static_cast<int64_t>(key);
    }
    const size_t s = static_cast<size_t>(it.slot);
    if (slot_epoch_[s] == epoch_) {  // this layer used the slot already: load after that computation
      it.prev = slot_last_[s];
      items_[static_cast<size_t>(it.prev)].next = static_cast<int32_t>(i);
    }
    slot_epoch_[s] = epoch_;
    slot_last_[s] = static_cast<int32_t>(i);
    items_.push_back(it);
  }
  const uint32_t m = static_cast<uint32_t>(items_.size());
  auto compute = [&](uint32_t i) {
    ops_.push_back({Op::Compute, i});
    if (items_[i].next >= 0) ops_.push_back({Op::Load, static_cast<uint32_t>(items_[i].next)});
  };
  auto first_loads = [&] {
    for (uint32_t i = 0; i < m; ++i)
      if (items_[i].load && items_[i].prev < 0) ops_.push_back({Op::Load, i});
  };
  if (loads_first) first_loads();
  for (uint32_t i = 0; i < m; ++i)
    if (!items_[i].load) compute(i);
  if (!loads_first) first_loads();
  for (uint32_t i = 0; i < m; ++i)
    if (items_[i].load) compute(i);
}

// ---- Device side ----

#ifdef COLIBRI_HAVE_CUDA
namespace {

constexpr int kStagingBuffers = 3;  // the staging ring: a buffer is repacked once its previous copy is done

class CudaExperts final : public GpuExperts {
 public:
  CudaExperts(std::shared_ptr<const ColibriFile> file, const FfnShape& spec, const ExpertStoreOptions& opts,
              const std::vector<uint64_t>& owned, int64_t max_rows, int rank)
      : file_(std::move(file)), spec_(spec), device_(opts.device), rank_(rank), experts_(file_->config().num_experts) {
    const std::string tier_request = gpu_host_tier_request(opts);
    bool biases = false;
    for (uint64_t k : owned) {
      const ExpertView& v = file_->expert(static_cast<int>(k / experts_), static_cast<int>(k % experts_));
      const FfnWeights w = FfnWeights::of(v);
      biases = biases || w.gate_bias || w.up_bias || w.down_bias;
    }
    layout_ = cuda::PackedFfnLayout::of(spec_, biases);
    const uint64_t keys = file_->experts().size();
    planner_ = std::make_unique<GpuTierPlanner>(opts, layout_.bytes, owned, keys, static_cast<uint32_t>(experts_));
    verified_.assign(keys, 0);
    keys_.reserve(static_cast<size_t>(experts_));

    cuda::set_device(device_);
    // Device memory: the slots, then per row: in/out/gather/scatter f32 (16 H),
    // x as bf16 (2 H), gate|up f32 (8 I), h bf16 (2 I); the GEMM workspace; 10% headroom.
    const size_t slots = planner_->device_slots();
    const size_t R = static_cast<size_t>(max_rows), H = static_cast<size_t>(spec_.hidden),
                 I = static_cast<size_t>(spec_.inter);
    const size_t need = (layout_.bytes * slots + R * (18 * H + 10 * I) + (size_t{32} << 20)) / 10 * 11;
    const size_t free_b = cuda::free_device_memory();
    if (need > free_b) {
      std::string what = planner_->budgeted()
                             ? "its GPU fast tier of " + std::to_string(slots) + " expert slots"
                             : "its " + std::to_string(owned.size()) + " experts";
      throw Error(Status::OutOfMemory,
                  "rank " + std::to_string(rank) + ": " + what + " (" + std::to_string((layout_.bytes * slots) >> 20) +
                      " MiB) and scratch need " + std::to_string(need >> 20) + " MiB on GPU " +
                      std::to_string(device_) + ", " + std::to_string(free_b >> 20) + " MiB are free (" +
                      (planner_->budgeted() ? "a smaller --expert-cache-bytes/--expert-cache-experts fits"
                                            : "a fast-tier budget, --expert-cache-bytes/--expert-cache-experts, keeps "
                                              "only part of them on the GPU; more ranks or another placement spread them") +
                      ")");
    }

    // The host tier. Pinned only when slots can be evicted and reloaded: with a
    // slot for every owned expert each is loaded once, through the staging ring.
    const uint64_t tier_bytes = layout_.bytes * owned.size();
    if (planner_->capacity() < owned.size() && tier_request != "staging") {
      const uint64_t phys = static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
      if (tier_request == "auto" && phys && tier_bytes > phys / 2) {
        spdlog::warn("rank {}: a pinned host tier of {} MiB would take more than half of this machine's {} MiB; "
                     "staging experts from the model file instead (COLIBRI_GPU_HOST_TIER=pinned insists)",
                     rank, tier_bytes >> 20, phys >> 20);
      } else {
        host_ = cuda::PinnedBuffer::try_allocate(tier_bytes);
        if (host_.empty()) {
          if (tier_request == "pinned")
            throw Error(Status::OutOfMemory, "rank " + std::to_string(rank) + ": cannot allocate the pinned host tier of " +
                                                 std::to_string(tier_bytes >> 20) +
                                                 " MiB (page-locked memory; COLIBRI_GPU_HOST_TIER=staging needs none)");
          spdlog::warn("rank {}: cannot allocate a pinned host tier of {} MiB; staging experts from the model file instead",
                       rank, tier_bytes >> 20);
        }
      }
    }
    pinned_tier_ = !host_.empty();

    // Created only now, on this GPU (cuda::set_device above).
    compute_ = std::make_unique<cuda::Stream>();
    copy_ = std::make_unique<cuda::Stream>();
    weights_ = cuda::DeviceBuffer(layout_.bytes * slots);
    in_ = cuda::DeviceBuffer(R * H * 4);
    out_ = cuda::DeviceBuffer(R * H * 4);
    xg_ = cuda::DeviceBuffer(R * H * 4);
    yg_ = cuda::DeviceBuffer(R * H * 4);
    runner_ = std::make_unique<cuda::FfnRunner>(spec_, max_rows, compute_->get());
    loaded_.resize(slots);
    used_.resize(slots);
    if (pinned_tier_) {
      // Every owned expert packed once (checksum verified first), in `owned` order.
      tier_index_.assign(keys, -1);
      for (size_t i = 0; i < owned.size(); ++i) {
        const ExpertView& v = expert_of(owned[i]);
        file_->prefetch(v.offset, v.size);
        file_->verify_expert(v);  // Error(Checksum) on a corrupt block, before it reaches the GPU
        verified_[owned[i]] = 1;
        cuda::pack_ffn(FfnWeights::of(v), spec_, layout_, host_.data() + layout_.bytes * i);
        release_mapped_pages(v.block, v.size);  // the pinned copy serves from now on
        tier_index_[owned[i]] = static_cast<int64_t>(i);
      }
    } else {
      staged_.resize(kStagingBuffers);
      staging_.reserve(kStagingBuffers);
      for (int i = 0; i < kStagingBuffers; ++i) staging_.emplace_back(layout_.bytes);
    }
    try {
      for (const auto& [key, slot] : planner_->preload()) load(key, slot);
      copy_->synchronize();
    } catch (...) {
      quiesce();  // nothing in flight reads the buffers freed by the unwinding
      throw;
    }
  }

  ~CudaExperts() override {
    quiesce();  // nothing may still read or write what is freed below
    runner_.reset();
  }

  void compute(int layer, uint64_t now, const float* in, float* out, int64_t rows,
               const std::vector<GpuExpertRows>& experts,
               const std::vector<std::pair<int64_t, int64_t>>& runs, bool device_io) override {
    if (!broken_.empty())
      throw Error(Status::Internal, "rank " + std::to_string(rank_) + ": the GPU expert tier is unusable after an earlier error (" +
                                        broken_ + ")");
    keys_.clear();
    for (const GpuExpertRows& x : experts) keys_.push_back(static_cast<uint64_t>(layer) * experts_ + x.expert);
    planner_->plan(keys_.data(), keys_.size(), now, pinned_tier_);
    if (experts.empty()) return;
    try {
      cuda::set_device(device_);
      const auto& items = planner_->items();
      bool uploaded = device_io;
      in_p_ = device_io ? in : in_.as<const float>();
      out_p_ = device_io ? out : out_.as<float>();
      for (const GpuTierPlanner::Op& op : planner_->ops()) {
        const GpuTierPlanner::Item& it = items[op.item];
        if (op.kind == GpuTierPlanner::Op::Load) {
          load(it.key, it.slot);
          continue;
        }
        if (!uploaded) {  // after the first loads are queued: their copies start first
          cuda::copy_async(in_.get(), in, static_cast<size_t>(rows * spec_.hidden) * 4, cuda::Copy::HostToDevice,
                           compute_->get());
          uploaded = true;
        }
        const GpuExpertRows& x = experts[op.item];
        run(it, runs.data() + x.first_run, x.num_runs);
      }
      if (!device_io)
        cuda::copy_async(out, out_.get(), static_cast<size_t>(rows * spec_.hidden) * 4, cuda::Copy::DeviceToHost,
                         compute_->get());
      compute_->synchronize();  // every load was waited for by its computation: the copy stream is idle too
    } catch (const std::exception& e) {
      // The policy counts the layer's experts resident, but their slots may not
      // hold them: refuse to compute from them again.
      broken_ = e.what();
      quiesce();
      throw;
    }
  }

  CacheStats stats() const override { return planner_->stats(); }
  const char* policy() const override { return planner_->policy(); }
  size_t slots() const override { return planner_->capacity(); }
  const char* host_tier() const override { return pinned_tier_ ? "pinned" : "staging"; }
  int device() const override { return device_; }

 private:
  // Waits for both streams, ignoring errors (teardown and error paths).
  void quiesce() noexcept {
    cuda::set_device_quietly(device_);
    if (copy_) copy_->drain();
    if (compute_) compute_->drain();
  }

  const ExpertView& expert_of(uint64_t key) const {
    return file_->expert(static_cast<int>(key / experts_), static_cast<int>(key % experts_));
  }
  char* slot_ptr(int32_t slot) const {
    return static_cast<char*>(weights_.get()) + layout_.bytes * static_cast<size_t>(slot);
  }

  // Queues the copy of `key` into `slot` on the copy stream, after the last
  // computation that read the slot.
  void load(uint64_t key, int32_t slot) {
    used_[static_cast<size_t>(slot)].wait_in(copy_->get());
    const void* src;
    int ring = -1;
    if (pinned_tier_) {
      const int64_t i = tier_index_[key];
      if (i < 0) throw Error(Status::Internal, "expert key " + std::to_string(key) + " is not in the pinned host tier");
      src = host_.data() + layout_.bytes * static_cast<size_t>(i);
    } else {
      ring = next_staging_;
      next_staging_ = (next_staging_ + 1) % kStagingBuffers;
      staged_[ring].synchronize();  // its previous copy has finished: the buffer may be rewritten
      const ExpertView& v = expert_of(key);
      if (!verified_[key]) {
        file_->prefetch(v.offset, v.size);
        file_->verify_expert(v);  // Error(Checksum), before it reaches the GPU
        verified_[key] = 1;
      }
      cuda::pack_ffn(FfnWeights::of(v), spec_, layout_, staging_[ring].get());
      src = staging_[ring].get();
    }
    cuda::copy_async(slot_ptr(slot), src, layout_.bytes, cuda::Copy::HostToDevice, copy_->get());
    if (ring >= 0) staged_[ring].record(copy_->get());
    loaded_[static_cast<size_t>(slot)].record(copy_->get());
  }

  // Computes one expert from its slot on the compute stream (after its load when
  // it was loaded in this layer), then marks the slot's last use.
  void run(const GpuTierPlanner::Item& it, const std::pair<int64_t, int64_t>* runs, uint32_t nruns) {
    const size_t s = static_cast<size_t>(it.slot);
    if (it.load) loaded_[s].wait_in(compute_->get());
    const cuda::DeviceFfn w = cuda::DeviceFfn::at(slot_ptr(it.slot), layout_);
    const int64_t H = spec_.hidden;
    const size_t row = static_cast<size_t>(H) * 4;
    if (nruns == 1) {  // contiguous: in place
      const int64_t at = runs[0].first;
      runner_->run(w, in_p_ + at * H, runs[0].second, out_p_ + at * H);
    } else {
      int64_t g = 0;
      for (uint32_t r = 0; r < nruns; ++r) {
        cuda::copy_async(xg_.as<float>() + g * H, in_p_ + runs[r].first * H,
                         static_cast<size_t>(runs[r].second) * row, cuda::Copy::DeviceToDevice, compute_->get());
        g += runs[r].second;
      }
      runner_->run(w, xg_.as<float>(), g, yg_.as<float>());
      g = 0;
      for (uint32_t r = 0; r < nruns; ++r) {
        cuda::copy_async(out_p_ + runs[r].first * H, yg_.as<float>() + g * H,
                         static_cast<size_t>(runs[r].second) * row, cuda::Copy::DeviceToDevice, compute_->get());
        g += runs[r].second;
      }
    }
    used_[s].record(compute_->get());
  }

  std::shared_ptr<const ColibriFile> file_;
  FfnShape spec_;
  int device_, rank_;
  int64_t experts_;
  cuda::PackedFfnLayout layout_;
  std::unique_ptr<GpuTierPlanner> planner_;
  std::vector<uint8_t> verified_;  // [key] checksum checked
  std::vector<uint64_t> keys_;     // the current layer's keys
  // Declared before everything that uses them: destroyed last.
  std::unique_ptr<cuda::Stream> compute_, copy_;
  cuda::PinnedBuffer host_;                // the pinned host tier: [owned][layout_.bytes], or empty
  bool pinned_tier_ = false;
  std::vector<int64_t> tier_index_;        // [key] -> block in host_ or -1
  std::vector<cuda::PinnedBuffer> staging_;  // the staging ring (staging mode)
  std::vector<cuda::Event> staged_;        // [buffer] its last copy to the device
  int next_staging_ = 0;
  cuda::DeviceBuffer weights_, in_, out_, xg_, yg_;  // weights_: [device slots][layout_.bytes]
  const float* in_p_ = nullptr;  // this layer's rows: in_, or the caller's device rows
  float* out_p_ = nullptr;       // and results: out_, or the caller's device buffer
  std::vector<cuda::Event> loaded_;        // [slot] its last load (copy stream)
  std::vector<cuda::Event> used_;          // [slot] its last computation (compute stream)
  std::unique_ptr<cuda::FfnRunner> runner_;
  std::string broken_;                     // why the tier is unusable, or empty
};

}  // namespace
#endif

void require_gpu(int device, int rank) {
  const std::string who = "rank " + std::to_string(rank) + ": --device cuda, but ";
#ifdef COLIBRI_HAVE_CUDA
  const int n = cuda::device_count();
  if (n == 0) throw Error(Status::Unsupported, who + "no CUDA device is visible");
  if (device < 0 || device >= n)
    throw Error(Status::InvalidArgument,
                who + "GPU " + std::to_string(device) + " does not exist (" + std::to_string(n) + " visible)");
#else
  (void)device;
  throw Error(Status::Unsupported, who + "this build has no CUDA (nvcc was not found at configure time)");
#endif
}

std::unique_ptr<GpuExperts> make_gpu_experts(std::shared_ptr<const ColibriFile> file, const FfnShape& spec,
                                             const ExpertStoreOptions& opts, const std::vector<uint64_t>& owned,
                                             int64_t max_rows, int rank) {
  require_gpu(opts.device, rank);
#ifdef COLIBRI_HAVE_CUDA
  return std::make_unique<CudaExperts>(std::move(file), spec, opts, owned, max_rows, rank);
#else
  (void)file, (void)spec, (void)owned, (void)max_rows;
  return nullptr;
#endif
}

}  // namespace colibri
