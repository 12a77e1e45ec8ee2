// engine.h: the coordinator's forward pass and generation loop: embeddings,
// attention with a KV cache, router, MoE dispatch through the communicator,
// final norm, LM head and sampling, for a batch of sequences of any lengths.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "coordinator/model.h"
#include "coordinator/model_plan.h"
#include "coordinator/sampling.h"
#include "model/colibri_file.h"
#include "model/error.h"
#include "model/placement.h"
#include "model/stage_clock.h"
#include "worker/dispatch.h"
#include "worker/worker.h"

namespace colibri {

class RoutingTraceWriter;
class RoutingReplay;
class KvBlockPool;
class Scheduler;

struct EngineOptions {
  int64_t max_batch = 4;        // most sequences per generate() call (the KV cache's sequence slots)
  int64_t max_context = 0;      // most positions per sequence; 0: the model's maximum
  int64_t prefill_chunk = 256;  // most tokens per prefill forward pass (the scheduler's rows per step)
  // The paged KV cache (coordinator/kv_cache.h): blocks of kv_block_tokens
  // positions; kv_cache_mb bounds its size (0: room for max_batch sequences of
  // max_context positions, so that generate() never preempts).
  int64_t kv_block_tokens = 16;
  int64_t kv_cache_mb = 0;
  int64_t kv_cache_blocks = 0;  // exactly this many blocks (tests, tuning); 0: from kv_cache_mb
  // What the cache stores (--kv-dtype): F32 (exact), or BF16 / F16 (half the
  // memory, so twice the positions in a given --kv-cache-mb; keys and values
  // rounded to nearest even when stored, MLA's latents included). A request's
  // results stay bitwise independent of the batch for each type.
  DType kv_dtype = DType::F32;
  // Which rank owns which experts; null: every expert on this (the only) rank.
  std::shared_ptr<const Placement> placement;
  ExpertStoreOptions store;             // this rank's expert cache, if it hosts experts
  RoutingTraceWriter* trace = nullptr;  // --record-routing
  // Replaces the router's choices (experts and weights) with a recorded
  // trace's, e.g. real Mixtral routing on a model of the same shape; the
  // router still runs (its time is real). The trace records what was replayed.
  std::shared_ptr<RoutingReplay> replay;
  // A barrier before the MoE results return, so that the stage times separate
  // waiting for the slowest rank from the transfer (bench; see MoeDispatcher).
  bool stage_sync = false;
  // The dense part (embedding, attention, KV cache, router, dense FFNs, LM head)
  // on this CUDA GPU (coordinator/backend_cuda.cpp); -1: on the CPU.
  int device = -1;
  // Debugging aid (--check-numerics): check every row after each stage of every
  // layer (embedding, attention, feed-forward) and name the first layer and
  // stage where a NaN or infinity appears. The logits are always checked.
  bool check_numerics = false;
};

struct Request {
  std::vector<int32_t> prompt;
  int32_t max_new_tokens = 16;
  SamplingParams sampling;
  bool ignore_eos = false;
  // More ids that end this sequence as the config's eos_token_id does
  // (finish_reason "eos"), unless ignore_eos: e.g. generation_config.json's list.
  std::vector<int32_t> stop_ids;
};

struct SequenceOutput {
  std::vector<int32_t> tokens;  // generated tokens (not the prompt)
  // With record_logits: [prompt_len + tokens.size() - 1][vocab] row p holds the
  // logits after position p (the last prompt row predicts the first new token).
  std::vector<float> logits;
  std::string finish_reason;  // "length", "eos", "stop", "cancelled", "interrupted" or "error"
};

struct GenerateOptions {
  bool record_logits = false;
  // Called after each new token; return false to stop the whole call.
  std::function<bool(int seq, int pos, int32_t token)> on_token;
  // Called after each new token, before on_token, with `ending` the reason
  // this token already ends the sequence for ("eos", "length") or "" if it
  // does not; return true to end that sequence alone (finish_reason "stop",
  // unless the token was its EOS), e.g. when its text now holds a stop string.
  std::function<bool(int seq, int32_t token, const std::string& ending)> stop;
  // Polled before every forward pass; non-zero (e.g. a signal number) stops the
  // call, keeping what was generated (finish_reason "interrupted").
  const std::atomic<int>* interrupt = nullptr;
};

struct GenerateStats {
  int64_t prefill_tokens = 0, decode_tokens = 0;
  double prefill_seconds = 0, decode_seconds = 0;
  bool cancelled = false;
  int interrupted = 0;  // the interrupt flag's value when it stopped the call
  // Wall time of each forward pass of the prefill (sampling included) and of
  // each decode step (forward pass and sampling), in order.
  std::vector<double> prefill_pass_seconds, decode_step_seconds;
};

// Thrown by generate() when a run fails after it started: a communication
// error or lost rank, non-finite logits (Status::Numerical), the model file
// changed (Status::FileChanged), a corrupt expert block. The error's status and
// message, with every sequence's output so far (unfinished ones end with
// finish_reason "error"; the failed pass's tokens are not among them) and the stats.
class GenerationError : public Error {
 public:
  GenerationError(const Error& e, std::vector<SequenceOutput> partial, GenerateStats stats)
      : Error(e.status(), e.what()), partial_(std::move(partial)), stats_(std::move(stats)) {}
  const std::vector<SequenceOutput>& partial() const { return partial_; }
  const GenerateStats& stats() const { return stats_; }

 private:
  std::vector<SequenceOutput> partial_;
  GenerateStats stats_;
};

class Engine : private ForwardHost {
  friend class Scheduler;  // runs the passes and samples (coordinator/scheduler.h)

 public:
  // One rank's engine. With a world of one, this rank also serves every expert.
  Engine(std::shared_ptr<const ColibriFile> file, const EngineOptions& opts, Communicator& comm);
  ~Engine() override;

  const ModelConfig& config() const { return file_->config(); }
  int64_t max_context() const { return max_ctx_; }
  int64_t max_batch() const { return max_batch_; }

  // Checks every request before any work (ids in range, lengths, sampling);
  // throws Error(InvalidArgument) naming the request and the problem.
  void validate(const std::vector<Request>& reqs) const;
  // One request's checks; `who` names it in the message ("prompt 3").
  void validate_request(const Request& r, const std::string& who) const;
  std::vector<SequenceOutput> generate(const std::vector<Request>& reqs, const GenerateOptions& opts,
                                       GenerateStats* stats = nullptr);

  // Null when this rank hosts no experts.
  Worker* local_worker() { return worker_.get(); }
  DispatchStats dispatch_stats() const { return dispatch_->stats(); }
  const MoeDispatcher& dispatcher() const { return *dispatch_; }
  // This rank's time per stage and phase since the engine was made.
  const StageTimes& stage_times() const { return clock_.times(); }
  const Placement& placement() const { return *placement_; }
  int64_t rows_capacity() const { return rows_cap_; }
  // Bytes of the KV cache (for MLA: latents and rotary keys only).
  uint64_t kv_cache_bytes() const;
  // The KV cache's blocks and block tables (the scheduler's bookkeeping).
  KvBlockPool& kv_pool() { return *kv_pool_; }
  const KvBlockPool& kv_pool() const { return *kv_pool_; }
  // With workers: tells them how big a forward pass can be (once, first).
  void start_workers();
  // With workers: ends their serve loops (idempotent).
  void stop_workers();

 private:
  // Runs rows (token, sequence slot, position) through the model (the model
  // definition on this rank's backend); writes the logits of the rows with
  // want_logits[i] into logits_ rows in order.
  void forward(int64_t n, const int32_t* tokens, const int32_t* seqs, const int32_t* pos, const uint8_t* want_logits);
  // After a forward pass: the model file is unchanged (Error(FileChanged)) and
  // every logit row written is finite (Error(Numerical) naming the pass, the
  // sequence and the position). phase and index: "decode step", 7. Allocates nothing
  // unless it throws.
  void check_pass(const char* phase, int64_t index, int64_t n, const int32_t* seqs, const int32_t* pos,
                  const uint8_t* want_logits) const;
  // ForwardHost: the routed experts of MoE layer `moe` (the router's choices
  // replayed and traced as asked, the rows exchanged and combined), and the
  // --check-numerics checks, for the rows of the pass in progress.
  void routed(int moe, int64_t rows, const MoeIo& io) override;
  void check(const char* stage, int layer, const float* x, int64_t width, bool normed_next) override;

  std::shared_ptr<const ColibriFile> file_;
  Communicator& comm_;
  int64_t max_batch_, max_ctx_, chunk_, rows_cap_;
  std::shared_ptr<const Placement> placement_;
  RoutingTraceWriter* trace_ = nullptr;
  std::shared_ptr<RoutingReplay> replay_;
  bool stage_sync_ = false;
  bool check_numerics_ = false;
  StageClock clock_;
  int64_t step_ = 0;  // forward passes so far (the routing trace's step)
  bool workers_started_ = false, workers_stopped_ = false;
  std::unique_ptr<Worker> worker_;
  std::unique_ptr<MoeDispatcher> dispatch_;
  ModelPlan plan_;
  std::unique_ptr<KvBlockPool> kv_pool_;  // before backend_, which addresses the cache through it
  std::vector<float> rope_cos_, rope_sin_;  // [max_ctx][rope_dim / 2], times YaRN's attention factor
  std::unique_ptr<DenseBackend> backend_;   // after plan_ and the rope tables, which it uses
  std::vector<float> logits_;               // host, [rows_cap][vocab]
  // The pass in progress (for routed() and check()).
  int64_t pass_rows_ = 0;
  const int32_t *pass_seqs_ = nullptr, *pass_pos_ = nullptr;
  Sampler sampler_;
};

}  // namespace colibri
