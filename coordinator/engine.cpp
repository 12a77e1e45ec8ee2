// engine.cpp: the coordinator's forward pass and generation loop.
#include "coordinator/engine.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>

#include "coordinator/backend.h"
#include "coordinator/kv_cache.h"
#include "coordinator/model.h"
#include "coordinator/scheduler.h"
#include "kernels/cpu/kernels.h"
#include "model/error.h"
#include "model/routing_trace.h"
#include "worker/protocol.h"

namespace colibri {

Engine::Engine(std::shared_ptr<const ColibriFile> file, const EngineOptions& opts, Communicator& comm)
    : file_(std::move(file)), comm_(comm), sampler_(file_->config().vocab_size) {
  const ModelConfig& c = file_->config();
  if (opts.max_batch < 1) throw Error(Status::InvalidArgument, "max batch must be >= 1");
  if (opts.prefill_chunk < 1) throw Error(Status::InvalidArgument, "prefill chunk must be >= 1");
  if (opts.max_context < 0) throw Error(Status::InvalidArgument, "max context must be >= 0");
  if (opts.max_context > c.max_position_embeddings)
    throw Error(Status::InvalidArgument, "max context " + std::to_string(opts.max_context) + " exceeds the model's " +
                                             std::to_string(c.max_position_embeddings) + " positions");
  max_batch_ = opts.max_batch;
  max_ctx_ = opts.max_context > 0 ? opts.max_context : c.max_position_embeddings;
  chunk_ = opts.prefill_chunk;
  rows_cap_ = std::max(chunk_, max_batch_);

  const int M = static_cast<int>(c.num_moe_layers()), NE = static_cast<int>(c.num_experts);
  if (opts.placement)
    placement_ = opts.placement;
  else if (comm_.size() == 1)
    placement_ = std::make_shared<const Placement>(Placement::single(M, NE));
  else
    placement_ = std::make_shared<const Placement>(make_placement("contiguous", M, NE, comm_.size(), false, nullptr, 0));
  cluster::check_placement(*placement_, c, comm_.size());
  trace_ = opts.trace;
  bool hosts = false;
  for (int l = 0; l < M && !hosts; ++l)
    for (int e = 0; e < NE && !hosts; ++e) hosts = placement_->owns(comm_.rank(), l, e);
  if (hosts)
    worker_ = std::make_unique<Worker>(file_, *placement_, comm_.rank(), comm_.size(), rows_cap_ * c.experts_per_token,
                                       opts.store);
  replay_ = opts.replay;
  if (replay_) replay_->check(c);
  stage_sync_ = opts.stage_sync;
  check_numerics_ = opts.check_numerics;
  if (check_numerics_ && opts.device >= 0)
    throw Error(Status::Unsupported, "--check-numerics checks the dense part on the CPU; with --device cuda only the "
                                     "logits are checked (leave --check-numerics out, or run the dense part on the CPU)");
  // With the dense part on a GPU the MoE rows stay there when nothing must
  // cross to the host: one rank, or NCCL moving device buffers.
  if (opts.device >= 0) require_gpu(opts.device, comm_.rank());  // the clear refusal, before any GPU is touched
  const bool device_moe = opts.device >= 0 && (comm_.size() == 1 || std::string(comm_.backend()) == "nccl");
  dispatch_ = std::make_unique<MoeDispatcher>(c, *placement_, comm_, worker_.get(), rows_cap_, clock_,
                                              device_moe ? opts.device : -1);
  dispatch_->set_stage_sync(stage_sync_);
  plan_ = ModelPlan::of(*file_);
  std::vector<LayerWeights> layers = load_layer_weights(*file_, plan_);
  try {
    logits_.resize(static_cast<size_t>(rows_cap_ * c.vocab_size));
  } catch (const std::bad_alloc&) {
    throw Error(Status::OutOfMemory, "the logits of " + std::to_string(rows_cap_) + " rows do not fit in memory");
  }

  // Rotary tables in f32 the way transformers computes them: angle = pos *
  // inv_freq (default or YaRN), cos/sin times YaRN's attention factor.
  const std::vector<float> inv = rope_inv_freq(c);
  const int64_t half = c.rope_dim / 2;
  if (c.rope_dim > 512) throw Error(Status::Unsupported, "rotary dimension above 512");
  const float af = static_cast<float>(c.rope_scaling.attention_factor);
  rope_cos_.resize(static_cast<size_t>(max_ctx_ * half));
  rope_sin_.resize(static_cast<size_t>(max_ctx_ * half));
  for (int64_t i = 0; i < half; ++i)
    for (int64_t p = 0; p < max_ctx_; ++p) {
      const float a = static_cast<float>(p) * inv[static_cast<size_t>(i)];
      float cs = std::cos(a), sn = std::sin(a);
      if (af != 1.0f) cs *= af, sn *= af;
      rope_cos_[static_cast<size_t>(p * half + i)] = cs;
      rope_sin_[static_cast<size_t>(p * half + i)] = sn;
    }
  for (size_t i = 0; i < rope_cos_.size(); ++i)
    if (!std::isfinite(rope_cos_[i]) || !std::isfinite(rope_sin_[i])) {
      char theta[32];
      std::snprintf(theta, sizeof theta, "%g", c.rope_theta);
      throw Error(Status::Numerical, file_->path() + ": the rotary tables are not finite (position " +
                                         std::to_string(static_cast<int64_t>(i) / std::max<int64_t>(half, 1)) +
                                         ", frequency " + std::to_string(static_cast<int64_t>(i) % std::max<int64_t>(half, 1)) +
                                         "): rope_theta " + theta + " or the rope scaling overflows");
    }
  // The paged KV cache's bookkeeping: blocks of kv_block_tokens positions, as
  // many as kv_cache_mb holds (default: max_batch whole contexts).
  {
    if (opts.kv_block_tokens < 1 || opts.kv_block_tokens > 4096)
      throw Error(Status::InvalidArgument, "--kv-block " + std::to_string(opts.kv_block_tokens) + " must be 1..4096 positions");
    if (opts.kv_cache_mb < 0) throw Error(Status::InvalidArgument, "--kv-cache-mb must be >= 0");
    const int64_t bt = opts.kv_block_tokens, per_slot = (max_ctx_ + bt - 1) / bt;
    if (!KVCache::storable(opts.kv_dtype))
      throw Error(Status::InvalidArgument, std::string("--kv-dtype ") + dtype_name(opts.kv_dtype) + ": f32, bf16 or f16");
    if (opts.kv_dtype != DType::F32 && plan_.kv_lora_rank == 0 && plan_.head_dim > kernels::kMaxAttendDim)
      throw Error(Status::Unsupported, "--kv-dtype " + std::string(dtype_name(opts.kv_dtype)) + " takes heads of at most " +
                                           std::to_string(kernels::kMaxAttendDim) + " dimensions");
    const uint64_t block_bytes = static_cast<uint64_t>(plan_.layers) * static_cast<uint64_t>(bt) *
                                 static_cast<uint64_t>(plan_.kv_width + plan_.v_width) *
                                 static_cast<uint64_t>(KVCache::element_bytes(opts.kv_dtype));
    int64_t blocks = max_batch_ * per_slot;
    if (opts.kv_cache_blocks < 0) throw Error(Status::InvalidArgument, "KV cache blocks must be >= 0");
    if (opts.kv_cache_blocks > 0) {
      blocks = opts.kv_cache_blocks;
    } else if (opts.kv_cache_mb > 0) {
      blocks = static_cast<int64_t>((static_cast<uint64_t>(opts.kv_cache_mb) << 20) / std::max<uint64_t>(block_bytes, 1));
      if (blocks < 1)
        throw Error(Status::InvalidArgument, "--kv-cache-mb " + std::to_string(opts.kv_cache_mb) + " holds no block of " +
                                                 std::to_string(bt) + " positions (" + std::to_string(block_bytes >> 10) +
                                                 " KiB each)");
    }
    kv_pool_ = std::make_unique<KvBlockPool>(blocks, bt, max_batch_, max_ctx_);
  }
  BackendOptions b;
  b.kv_pool = kv_pool_.get();
  b.kv_dtype = opts.kv_dtype;
  b.rank = comm_.rank();
  b.rows_cap = rows_cap_, b.max_batch = max_batch_, b.max_ctx = max_ctx_;
  b.rope_cos = rope_cos_.data(), b.rope_sin = rope_sin_.data();
  b.clock = &clock_;
  b.device = opts.device;
  b.sync_stages = stage_sync_;
  b.device_moe = device_moe;
  b.threads = omp_get_max_threads();
  // NOTE: with the dense part on a GPU, the KV cache and the activations live
  // there: the host keeps only the logits.
  backend_ = opts.device >= 0 ? make_cuda_backend(file_, plan_, layers, b)
                              : make_cpu_backend(file_, plan_, std::move(layers), b);
}

Engine::~Engine() = default;

uint64_t Engine::kv_cache_bytes() const { return backend_->kv_cache_bytes(); }

void Engine::start_workers() {
  if (comm_.size() == 1 || workers_started_) return;
  cluster::Setup s;
  s.rows_cap = rows_cap_;
  s.model_checksum = file_->header().meta_checksum;
  s.stage_sync = stage_sync_ ? 1 : 0;
  cluster::send_setup(comm_, s);
  // Wait (without a deadline) until every worker has built its expert store:
  // preloading pinned experts may take long, and the first exchange is timed.
  const double t = comm_.timeout();
  comm_.set_timeout(0);
  comm_.barrier();
  comm_.set_timeout(t);
  workers_started_ = true;
}

void Engine::stop_workers() {
  if (comm_.size() == 1 || workers_stopped_) return;
  cluster::send_op(comm_, cluster::Op::Stop);
  workers_stopped_ = true;
}

void Engine::routed(int moe, int64_t n, const MoeIo& io) {
  const int64_t K = plan_.top_k;
  if (replay_) replay_->next(moe, n, io.experts, io.weights);
  if (trace_)
    for (int64_t i = 0; i < n; ++i)
      trace_->write(step_, moe, pass_seqs_[i], pass_pos_[i], io.experts + i * K, io.weights + i * K,
                    static_cast<int>(K));
  clock_.lap(Stage::Router);
  if (io.stream)
    dispatch_->forward_device(moe, io.xn, n, io.experts, io.weights, io.out, io.stream);
  else
    dispatch_->forward(moe, io.xn, n, io.experts, io.weights, io.out);
}

void Engine::forward(int64_t n, const int32_t* tokens, const int32_t* seqs, const int32_t* pos,
                     const uint8_t* want_logits) {
  if (comm_.size() > 1 && !workers_started_) start_workers();
  // Stage times: every segment of the pass is charged to a stage (clock_.lap).
  clock_.mark();
  clock_.count_pass();
  if (comm_.size() > 1) {
    cluster::send_op(comm_, cluster::Op::Forward, clock_.phase());
    clock_.lap(Stage::Exchange);
  }
  pass_rows_ = n, pass_seqs_ = seqs, pass_pos_ = pos;
  backend_->begin(n, tokens, seqs, pos, want_logits);
  forward_pass(plan_, *backend_, *this, n, check_numerics_, logits_.data());
  if (comm_.size() > 1) {
    cluster::end_pass(comm_, *file_);
    clock_.lap(Stage::Exchange);
  }
  ++step_;
}

void Engine::check(const char* stage, int layer, const float* x, int64_t w, bool normed_next) {
  const int64_t n = pass_rows_;
  const int32_t *seqs = pass_seqs_, *pos = pass_pos_;
  auto where = [&](int64_t i) {
    return std::string(stage) + (layer >= 0 ? " of layer " + std::to_string(layer) : std::string()) +
           ", row of sequence " + std::to_string(seqs[i]) + " at position " + std::to_string(pos[i]);
  };
  for (int64_t i = 0; i < n; ++i) {
    double ss = 0;
    for (int64_t j = 0; j < w; ++j) {
      const float v = x[i * w + j];
      ss += static_cast<double>(v) * v;
      if (std::isfinite(v)) continue;
      throw Error(Status::Numerical, "forward pass " + std::to_string(step_) + ": the first non-finite value (" +
                                         std::to_string(v) + ") is in the " + where(i) + ", element " + std::to_string(j));
    }
    // NOTE: an RMSNorm of a row whose mean square overflows f32 gives zeros
    // (as transformers' f32 norm does): finite, but every later value is garbage.
    if (normed_next && ss / static_cast<double>(w) > static_cast<double>(std::numeric_limits<float>::max())) {
      char ms[32];
      std::snprintf(ms, sizeof ms, "%.3g", ss / static_cast<double>(w));
      throw Error(Status::Numerical, "forward pass " + std::to_string(step_) + ": the " + where(i) +
                                         " overflows the next RMSNorm (mean square " + ms +
                                         " beyond the f32 range): its output is all zeros");
    }
  }
}

void Engine::check_pass(const char* phase, int64_t index, int64_t n, const int32_t* seqs, const int32_t* pos,
                        const uint8_t* want_logits) const {
  // NOTE: first the file: a pass that read zeros from a truncated file has
  // garbage logits, and the file is the cause to report.
  file_->check_unchanged();
  const int64_t V = file_->config().vocab_size;
  int64_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!want_logits[i]) continue;
    const float* lg = logits_.data() + (m++) * V;
    bool all_equal = V > 1;
    for (int64_t v = 0; v < V; ++v) {
      all_equal = all_equal && lg[v] == lg[0];
      if (std::isfinite(lg[v])) continue;
      throw Error(Status::Numerical,
                  std::string(phase) + " " + std::to_string(index) + ": the logits of sequence " + std::to_string(seqs[i]) + " at position " + std::to_string(pos[i]) +
                      " are not finite (" + std::to_string(lg[v]) + " for token " + std::to_string(v) +
                      "): the model's weights or config overflow; " +
                      (check_numerics_ ? "no earlier stage was non-finite, so the LM head overflowed"
                                       : "--check-numerics names the first layer and stage that goes non-finite"));
    }
    // NOTE: every logit equal (all zeros, say) is what an overflowed final
    // norm gives: no token is more likely than another, so sampling is garbage.
    if (all_equal)
      throw Error(Status::Numerical,
                  std::string(phase) + " " + std::to_string(index) + ": the logits of sequence " + std::to_string(seqs[i]) +
                      " at position " + std::to_string(pos[i]) + " are all equal (" + std::to_string(lg[0]) +
                      "): the activations overflowed (the final norm's input is beyond the f32 range); " +
                      (check_numerics_ ? "the LM head's input was all zeros"
                                       : "--check-numerics names the first layer and stage that overflows"));
  }
}

void Engine::validate(const std::vector<Request>& reqs) const {
  if (reqs.empty()) throw Error(Status::InvalidArgument, "no prompts given");
  if (static_cast<int64_t>(reqs.size()) > max_batch_)
    throw Error(Status::InvalidArgument, std::to_string(reqs.size()) + " prompts exceed the maximum batch of " +
                                             std::to_string(max_batch_));
  for (size_t i = 0; i < reqs.size(); ++i) validate_request(reqs[i], "prompt " + std::to_string(i));
}

void Engine::validate_request(const Request& r, const std::string& who) const {
  const ModelConfig& c = file_->config();
  if (r.prompt.empty()) throw Error(Status::InvalidArgument, who + " is empty");
  for (size_t j = 0; j < r.prompt.size(); ++j)
    if (r.prompt[j] < 0 || r.prompt[j] >= c.vocab_size)
      throw Error(Status::InvalidArgument, who + ": token id " + std::to_string(r.prompt[j]) + " at position " +
                                               std::to_string(j) + " is outside the vocabulary [0, " +
                                               std::to_string(c.vocab_size) + ")");
  if (r.max_new_tokens < 0) throw Error(Status::InvalidArgument, who + ": max new tokens must be >= 0");
  const int64_t need = static_cast<int64_t>(r.prompt.size()) + r.max_new_tokens;
  if (need > max_ctx_)
    throw Error(Status::InvalidArgument, who + ": " + std::to_string(r.prompt.size()) + " prompt tokens + " +
                                             std::to_string(r.max_new_tokens) + " new tokens exceed the context of " +
                                             std::to_string(max_ctx_) + " positions");
  for (int32_t id : r.stop_ids)
    if (id < 0 || id >= c.vocab_size)
      throw Error(Status::InvalidArgument, who + ": stop token id " + std::to_string(id) + " is outside the vocabulary");
  validate_sampling(r.sampling, c.vocab_size);
}

// generate(): a thin client of the scheduler. Every request is admitted at
// once (they fit: at most max_batch, and the default cache holds max_batch
// whole contexts), prefilled in chunks that may span requests, then decoded
// together, as one batch; the scheduler makes each request's tokens and
// logits bitwise those of the request alone.
std::vector<SequenceOutput> Engine::generate(const std::vector<Request>& reqs, const GenerateOptions& opts,
                                             GenerateStats* stats) {
  validate(reqs);
  if (replay_) replay_->rewind();  // every call replays the same routing
  GenerateStats st;
  {
    // NOTE: the per-pass timings grow during the run: reserve, so a step allocates nothing.
    int64_t prompt = 0, steps = 0;
    for (const Request& r : reqs) {
      prompt += static_cast<int64_t>(r.prompt.size());
      steps = std::max<int64_t>(steps, r.max_new_tokens);
    }
    st.prefill_pass_seconds.reserve(static_cast<size_t>((prompt + chunk_ - 1) / chunk_ + reqs.size()));
    st.decode_step_seconds.reserve(static_cast<size_t>(steps));
  }
  SchedulerOptions so;
  so.max_running = max_batch_;
  so.max_step_tokens = chunk_;
  so.prefill_first = true;
  so.record_logits = opts.record_logits;
  Scheduler sched(*this, so);
  sched.keep_pass_times(&st.prefill_pass_seconds, &st.decode_step_seconds);
  const size_t B = reqs.size();
  std::vector<int64_t> ids(B);
  bool stop_all = false;
  for (size_t i = 0; i < B; ++i) {
    RequestCallbacks cb;
    const int seq = static_cast<int>(i);
    if (opts.stop)
      cb.stop = [&opts, seq](int32_t t, const std::string& ending) { return opts.stop(seq, t, ending); };
    if (opts.on_token)
      cb.on_token = [&opts, &stop_all, &sched, seq](int pos, int32_t t) {
        if (!opts.on_token(seq, pos, t)) {
          stop_all = true;  // the whole call stops here: no later row of this pass is sampled
          sched.halt();
        }
        return true;
      };
    ids[i] = sched.submit(reqs[i], std::move(cb));
  }
  auto outputs = [&] {
    std::vector<SequenceOutput> out(B);
    for (size_t i = 0; i < B; ++i) out[i] = sched.take(ids[i]);
    return out;
  };
  auto fill_stats = [&] {
    const SchedulerStats& s = sched.stats();
    st.prefill_tokens = s.prefill_tokens, st.decode_tokens = s.decode_tokens;
    st.prefill_seconds = s.prefill_seconds, st.decode_seconds = s.decode_seconds;
  };
  try {
    while (!sched.idle()) {
      if (opts.interrupt && opts.interrupt->load() != 0) {
        st.interrupted = opts.interrupt->load();
        st.cancelled = true;
        break;
      }
      sched.step();
      if (stop_all) {
        st.cancelled = true;
        break;
      }
    }
  } catch (const Error& e) {
    // The scheduler ended every unfinished request with "error".
    fill_stats();
    if (stats) *stats = st;
    throw GenerationError(e, outputs(), std::move(st));
  }
  if (st.cancelled) sched.finish_all(st.interrupted ? "interrupted" : "cancelled");
  fill_stats();
  if (stats) *stats = st;
  return outputs();
}

}  // namespace colibri
