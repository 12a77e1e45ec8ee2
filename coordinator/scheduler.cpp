// scheduler.cpp: continuous batching over one Engine (scheduler.h).
#include "coordinator/scheduler.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "coordinator/kv_cache.h"
#include "model/error.h"

namespace colibri {

struct Scheduler::Seq {
  int64_t id = 0;
  Request req;
  RequestCallbacks cb;
  std::vector<int32_t> tokens;  // the prompt, then what was generated
  int64_t prompt_len = 0;
  int64_t computed = 0;  // tokens whose keys and values are in its slot's blocks
  int slot = -1;         // running: its KV slot
  Rng rng;
  SequenceOutput out;
  int64_t logits_rows = 0;  // rows of out.logits (record_logits)
  bool cancel = false, done = false;
  int64_t pending() const { return static_cast<int64_t>(tokens.size()) - computed; }
  int32_t generated() const { return static_cast<int32_t>(static_cast<int64_t>(tokens.size()) - prompt_len); }
};

Scheduler::Scheduler(Engine& engine, const SchedulerOptions& o) : engine_(engine) {
  const int64_t slots = engine_.kv_pool().max_slots();
  max_running_ = o.max_running > 0 ? o.max_running : slots;
  budget_ = o.max_step_tokens > 0 ? o.max_step_tokens : engine_.chunk_;
  if (max_running_ > slots)
    throw Error(Status::InvalidArgument, "--max-running " + std::to_string(max_running_) + " exceeds the engine's " +
                                             std::to_string(slots) + " sequence slots (--max-batch)");
  if (budget_ > engine_.rows_cap_)
    throw Error(Status::InvalidArgument, "--max-step-tokens " + std::to_string(budget_) + " exceeds the engine's " +
                                             std::to_string(engine_.rows_cap_) + " rows per pass");
  prefill_first_ = o.prefill_first;
  record_logits_ = o.record_logits;
  // Lowest slot first (pop_back): request i of a batch admitted at once gets slot i.
  for (int s = static_cast<int>(max_running_) - 1; s >= 0; --s) free_slots_.push_back(s);
  const size_t rows = static_cast<size_t>(engine_.rows_cap_);
  tok_.resize(rows), slot_.resize(rows), pos_.resize(rows), want_.resize(rows), row_seq_.resize(rows);
  running_.reserve(static_cast<size_t>(max_running_));
}

Scheduler::~Scheduler() {
  for (Seq* s : running_) engine_.kv_pool().release(s->slot);
}

int64_t Scheduler::submit(Request r, RequestCallbacks cb) {
  engine_.validate_request(r, "request " + std::to_string(next_id_));
  const KvBlockPool& pool = engine_.kv_pool();
  const int64_t need = pool.blocks_for(static_cast<int64_t>(r.prompt.size()) + r.max_new_tokens);
  if (need > pool.num_blocks())
    throw Error(Status::InvalidArgument,
                "request " + std::to_string(next_id_) + ": " + std::to_string(r.prompt.size()) + " prompt tokens + " +
                    std::to_string(r.max_new_tokens) + " new tokens need " + std::to_string(need) +
                    " KV cache blocks of " + std::to_string(pool.block_tokens()) + " positions; the cache has " +
                    std::to_string(pool.num_blocks()) + " (raise --kv-cache-mb)");
  auto s = std::make_unique<Seq>();
  s->id = next_id_++;
  s->prompt_len = static_cast<int64_t>(r.prompt.size());
  s->tokens.reserve(r.prompt.size() + static_cast<size_t>(r.max_new_tokens));
  s->tokens = r.prompt;
  s->out.tokens.reserve(static_cast<size_t>(r.max_new_tokens));
  if (record_logits_)
    s->out.logits.reserve((r.prompt.size() + static_cast<size_t>(r.max_new_tokens)) *
                          static_cast<size_t>(engine_.config().vocab_size));
  s->rng = Rng(r.sampling.seed);
  s->req = std::move(r);
  s->cb = std::move(cb);
  Seq* p = s.get();
  seqs_.emplace(p->id, std::move(s));
  waiting_.push_back(p);
  return p->id;
}

void Scheduler::cancel(int64_t id) {
  auto it = seqs_.find(id);
  if (it == seqs_.end() || it->second->done) return;
  it->second->cancel = true;
  ++cancels_;
}

bool Scheduler::finished(int64_t id) const {
  auto it = seqs_.find(id);
  return it != seqs_.end() && it->second->done;
}

SequenceOutput Scheduler::take(int64_t id) {
  auto it = seqs_.find(id);
  if (it == seqs_.end() || !it->second->done)
    throw Error(Status::InvalidArgument, "request " + std::to_string(id) + " is not finished");
  SequenceOutput o = std::move(it->second->out);
  seqs_.erase(it);
  return o;
}

void Scheduler::finish(Seq& s, const char* reason) {
  if (s.done) return;
  if (s.out.finish_reason.empty()) s.out.finish_reason = reason;
  s.done = true;
  if (s.slot >= 0) {
    leave_running(s);
  } else {
    auto w = std::find(waiting_.begin(), waiting_.end(), &s);
    if (w != waiting_.end()) waiting_.erase(w);
  }
  if (s.cb.on_finish) s.cb.on_finish(s.id, s.out);
}

void Scheduler::finish_all(const std::string& reason) {
  while (!running_.empty()) {
    Seq& s = *running_.back();
    s.out.finish_reason = reason;
    finish(s, "");
  }
  while (!waiting_.empty()) {
    Seq& s = *waiting_.front();
    s.out.finish_reason = reason;
    finish(s, "");
  }
}

void Scheduler::leave_running(Seq& s) {
  engine_.kv_pool().release(s.slot);
  free_slots_.push_back(s.slot);
  std::sort(free_slots_.begin(), free_slots_.end(), std::greater<int>());  // the lowest slot on top again
  s.slot = -1;
  running_.erase(std::find(running_.begin(), running_.end(), &s));
}

void Scheduler::preempt(Seq& s) {
  leave_running(s);
  s.computed = 0;
  waiting_.push_front(&s);
  ++stats_.preemptions;
}

void Scheduler::admit() {
  KvBlockPool& pool = engine_.kv_pool();
  // FCFS: the head waits while it does not fit; nobody overtakes it.
  while (!waiting_.empty() && static_cast<int64_t>(running_.size()) < max_running_) {
    Seq& s = *waiting_.front();
    const int slot = free_slots_.back();
    if (!pool.reserve(slot, static_cast<int64_t>(s.tokens.size()))) break;
    free_slots_.pop_back();
    waiting_.pop_front();
    s.slot = slot;
    s.computed = 0;
    running_.push_back(&s);  // admission order: preemption takes the back
  }
}

void Scheduler::accept(Seq& s, const float* lg) {
  const Request& r = s.req;
  const ModelConfig& c = engine_.config();
  const int32_t t = engine_.sampler_.sample(lg, r.sampling, s.rng);
  s.tokens.push_back(t);
  s.out.tokens.push_back(t);
  const int pos = static_cast<int>(s.tokens.size()) - 1;
  const char* ending = "";
  if (!r.ignore_eos && (t == c.eos_token_id || std::find(r.stop_ids.begin(), r.stop_ids.end(), t) != r.stop_ids.end()))
    ending = "eos";
  else if (s.generated() >= r.max_new_tokens)
    ending = "length";
  bool end = *ending != 0;
  if (s.cb.stop && s.cb.stop(t, end ? std::string(ending) : std::string()) && std::strcmp(ending, "eos") != 0) {
    ending = "stop";
    end = true;
  }
  bool cancelled = false;
  if (s.cb.on_token && !s.cb.on_token(pos, t)) cancelled = true;
  if (end)
    finish(s, ending);
  else if (cancelled)
    finish(s, "cancelled");
}

bool Scheduler::step() {
  if (cancels_ > 0) {
    cancels_ = 0;
    for (size_t i = running_.size(); i-- > 0;)
      if (running_[i]->cancel) finish(*running_[i], "cancelled");
    for (size_t i = waiting_.size(); i-- > 0;)
      if (waiting_[i]->cancel) finish(*waiting_[i], "cancelled");
  }
  admit();
  if (running_.empty()) return false;

  // Rows: each running sequence feeds its pending tokens (one when decoding).
  int64_t n = 0, budget = budget_, prefill_rows = 0;
  auto take = [&](Seq& s, int64_t count) {
    for (int64_t j = 0; j < count; ++j, ++n) {
      const int64_t p = s.computed + j;
      const bool last = p + 1 == static_cast<int64_t>(s.tokens.size());
      tok_[static_cast<size_t>(n)] = s.tokens[static_cast<size_t>(p)];
      slot_[static_cast<size_t>(n)] = s.slot;
      pos_[static_cast<size_t>(n)] = static_cast<int32_t>(p);
      want_[static_cast<size_t>(n)] = last || (record_logits_ && p >= s.logits_rows);
      row_seq_[static_cast<size_t>(n)] = &s;
      if (p < s.prompt_len || !last) ++prefill_rows;  // a prompt token, or one recomputed after a preemption
    }
    budget -= count;
  };
  auto in_prefill = [](const Seq* s) { return s->computed < s->prompt_len || s->pending() > 1; };
  if (prefill_first_ && std::any_of(running_.begin(), running_.end(), in_prefill)) {
    // Prefill only, in admission order (chunks may span sequences).
    for (Seq* s : running_) {
      if (budget <= 0) break;
      if (in_prefill(s)) take(*s, std::min(s->pending(), budget));
    }
  } else {
    // Decode rows first, in admission order. A sequence that needs a block
    // when none is free preempts the sequence admitted last: running_.back(),
    // never one already in this pass (perhaps itself, which then waits).
    for (size_t i = 0; i < running_.size() && budget > 0;) {
      Seq& s = *running_[i];
      if (s.pending() != 1) {
        ++i;
        continue;
      }
      bool self = false;
      while (!engine_.kv_pool().reserve(s.slot, s.computed + 1)) {
        Seq* victim = running_.back();
        preempt(*victim);
        if ((self = victim == &s)) break;
      }
      if (self) break;  // s was the last: nothing after it
      take(s, 1);
      ++i;
    }
    // Then prefill chunks, in admission order.
    for (Seq* s : running_) {
      if (budget <= 0) break;
      if (s->pending() > 1) take(*s, std::min(s->pending(), budget));
    }
  }
  // NOTE: cannot happen: the budget is >= 1, and a sequence preempts itself
  // only when sequences admitted before it hold blocks (alone, it fits: submit()).
  if (n == 0) throw Error(Status::Internal, "scheduler: a step with running sequences scheduled no row");
  stats_.peak_blocks = std::max(stats_.peak_blocks, engine_.kv_pool().num_blocks() - engine_.kv_pool().free_blocks());

  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  const bool prefill_pass = prefill_rows > 0;
  engine_.clock_.set_phase(prefill_pass ? Phase::Prefill : Phase::Decode);
  try {
    engine_.forward(n, tok_.data(), slot_.data(), pos_.data(), want_.data());
    engine_.check_pass(prefill_pass ? "prefill pass" : "decode step",
                       prefill_pass ? stats_.prefill_passes : stats_.decode_steps, n, slot_.data(), pos_.data(),
                       want_.data());
  } catch (const Error&) {
    finish_all("error");
    throw;
  }
  const int64_t V = engine_.config().vocab_size;
  int64_t m = 0;
  halted_ = false;
  for (int64_t i = 0; i < n && !halted_; ++i) {
    Seq& s = *row_seq_[static_cast<size_t>(i)];
    ++s.computed;
    if (!want_[static_cast<size_t>(i)]) continue;
    const float* lg = engine_.logits_.data() + (m++) * V;
    const int64_t p = pos_[static_cast<size_t>(i)];
    if (record_logits_ && p == s.logits_rows) {
      s.out.logits.insert(s.out.logits.end(), lg, lg + V);
      ++s.logits_rows;
    }
    if (p + 1 != static_cast<int64_t>(s.tokens.size())) continue;
    if (s.generated() >= s.req.max_new_tokens)
      finish(s, "length");  // max_new_tokens 0: the prompt alone
    else
      accept(s, lg);
  }
  stats_.prefill_tokens += prefill_rows;
  stats_.decode_tokens += n - prefill_rows;
  engine_.clock_.lap(Stage::Sampling);
  const double dt = std::chrono::duration<double>(clock::now() - t0).count();
  if (prefill_pass) {
    ++stats_.prefill_passes;
    stats_.prefill_seconds += dt;
    if (prefill_times_) prefill_times_->push_back(dt);
  } else {
    ++stats_.decode_steps;
    stats_.decode_seconds += dt;
    if (decode_times_) decode_times_->push_back(dt);
  }
  engine_.clock_.set_phase(Phase::Prefill);
  return true;
}

}  // namespace colibri
