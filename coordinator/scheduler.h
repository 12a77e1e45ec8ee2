// scheduler.h: iteration-level scheduling (continuous batching, as in Orca,
// vLLM and SGLang) over one Engine. Requests join a FCFS queue at any time;
// every step() is one forward pass that runs the decode token of each running
// sequence first, then prefill chunks of the others, within a budget of rows
// (max_step_tokens) and of running sequences (max_running); finished,
// cancelled and preempted sequences leave at the step's end.
//
// The KV cache is paged (coordinator/kv_cache.h): a request is admitted when
// the free blocks hold its known tokens (prompt, and what it generated before a
// preemption); when a running sequence needs a block for its next token and
// none is free, the sequence admitted last is preempted: its blocks are freed
// and it goes back to the head of the queue, to be recomputed (prefilled over
// its prompt and the tokens it generated) when there is room again. A request
// is never dropped for want of memory; one that could not fit in the whole
// cache is refused at submit().
//
// Batch invariance: a request's tokens and logits are bitwise those of the
// request alone, whatever runs beside it, the step budget, preemptions, the
// world size and the placement (every row of a pass is computed as it would
// be alone: the kernels, the routing and the combine are row-independent).
//
// Not thread-safe: one thread calls submit/cancel/step (a server wraps it).
#pragma once
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "coordinator/engine.h"
#include "coordinator/sampling.h"

namespace colibri {

struct SchedulerOptions {
  int64_t max_running = 0;      // sequences in the running set; 0: the engine's max batch (its KV slots)
  int64_t max_step_tokens = 0;  // rows per forward pass; 0: the engine's prefill chunk
  // generate(): no decode while an admitted prompt is still being prefilled
  // (every prompt is prefilled first, then all decode together), so that a
  // benchmark's prefill and decode passes stay apart. Default: decode first.
  bool prefill_first = false;
  // Keep every position's logits in SequenceOutput::logits (as GenerateOptions).
  bool record_logits = false;
};

// Called on the thread that runs step(), after each new token of one request.
struct RequestCallbacks {
  // `ending`: the reason this token already ends the request ("eos", "length")
  // or ""; return true to end it ("stop", unless the token was its EOS), e.g.
  // when its text now holds a stop string.
  std::function<bool(int32_t token, const std::string& ending)> stop;
  // `pos`: the token's position in the sequence (prompt first). Return false to
  // cancel the request (finish_reason "cancelled").
  std::function<bool(int pos, int32_t token)> on_token;
  // The request ended (its output is also kept until take()).
  std::function<void(int64_t id, const SequenceOutput& out)> on_finish;
};

struct SchedulerStats {
  int64_t prefill_tokens = 0, decode_tokens = 0;  // rows run: prompt (and recomputed) tokens, decode tokens
  int64_t prefill_passes = 0, decode_steps = 0;   // passes with any prefill row, passes of decode rows only
  int64_t preemptions = 0;
  double prefill_seconds = 0, decode_seconds = 0;  // wall time of those passes (sampling included)
  int64_t peak_blocks = 0;                         // KV blocks in use at the fullest step
};

class Scheduler {
 public:
  Scheduler(Engine& engine, const SchedulerOptions& opts);
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Checks the request (Error(InvalidArgument) naming the problem; a request
  // the whole KV cache cannot hold is refused too) and queues it. Ids count
  // from 0 in submission order.
  int64_t submit(Request r, RequestCallbacks cb = {});
  // Ends a waiting or running request at the next step (finish_reason
  // "cancelled"); its KV blocks are freed then. Unknown or finished ids: no-op.
  void cancel(int64_t id);
  // One forward pass over the rows scheduled now (after admitting, preempting
  // and retiring cancelled requests), then sampling. False when there was
  // nothing to run. An Error from the engine ends every unfinished request
  // with finish_reason "error" (its output so far is kept) and is rethrown.
  bool step();
  // Ends every unfinished request with `reason` ("interrupted", "cancelled").
  void finish_all(const std::string& reason);
  // From a callback: the rows after this one in the current pass are not
  // sampled (generate() stops the whole call so, then calls finish_all).
  void halt() { halted_ = true; }

  bool idle() const { return waiting_.empty() && running_.empty(); }
  int64_t waiting() const { return static_cast<int64_t>(waiting_.size()); }
  int64_t running() const { return static_cast<int64_t>(running_.size()); }
  bool finished(int64_t id) const;
  // The output of a finished request (once; then the scheduler forgets it).
  SequenceOutput take(int64_t id);
  const SchedulerStats& stats() const { return stats_; }
  // Per-pass wall times (sampling included), in order, when asked to keep them
  // (reserved up front, so that keeping them allocates nothing per step).
  void keep_pass_times(std::vector<double>* prefill, std::vector<double>* decode) {
    prefill_times_ = prefill, decode_times_ = decode;
  }
  int64_t max_running() const { return max_running_; }
  int64_t max_step_tokens() const { return budget_; }

 private:
  struct Seq;
  void admit();
  void leave_running(Seq& s);  // frees its KV slot and blocks
  void preempt(Seq& s);
  void finish(Seq& s, const char* reason);
  void accept(Seq& s, const float* logits);

  Engine& engine_;
  int64_t max_running_, budget_;
  bool prefill_first_, record_logits_;
  int64_t next_id_ = 0;
  std::unordered_map<int64_t, std::unique_ptr<Seq>> seqs_;
  std::deque<Seq*> waiting_;
  std::vector<Seq*> running_;  // admission order
  std::vector<int> free_slots_;
  int64_t cancels_ = 0;        // cancel() calls not yet applied
  bool halted_ = false;
  // The pass being built.
  std::vector<int32_t> tok_, slot_, pos_;
  std::vector<uint8_t> want_;
  std::vector<Seq*> row_seq_;
  SchedulerStats stats_;
  std::vector<double>*prefill_times_ = nullptr, *decode_times_ = nullptr;
};

}  // namespace colibri
