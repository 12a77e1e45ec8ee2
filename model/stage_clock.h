// stage_clock.h: where a rank's time goes, stage by stage, split into prefill
// and decode. A StageClock charges the time since its previous mark to the
// stage named at each lap, so the stages of a rank add up to its wall time
// between the first mark and the last lap: nothing is counted twice and a gap
// is never silently dropped (the engine laps every segment of a step).
#pragma once
#include <chrono>
#include <cstdint>

namespace colibri {

enum class Stage : int {
  Attention = 0,  // attention block (projections, RoPE, KV cache, scores, output projection)
  Router,         // router matrix product and top-k
  DispatchPlan,   // choosing the rank of each (token, expert) pair and packing the rows
  Exchange,       // all-to-all transfers of rows there and back, control messages sent
  ExpertFfn,      // the experts this rank hosts
  Combine,        // weighted sum of the returned rows in slot order
  Dense,          // embedding, norms, residuals, dense and shared-expert FFNs
  LmHead,         // final norm and LM head
  Sampling,       // choosing the next tokens
  Wait,           // blocked on a peer: counts all-to-all, stage sync, a worker waiting for work
  Count
};
inline constexpr int kNumStages = static_cast<int>(Stage::Count);

// Stable lower-case names (CSV/JSON keys): attention, router, dispatch_plan, ...
inline const char* stage_name(Stage s) {
  static const char* const names[kNumStages] = {"attention", "router", "dispatch_plan", "exchange", "expert_ffn",
                                                "combine",   "dense",  "lm_head",       "sampling", "wait"};
  const int i = static_cast<int>(s);
  return i >= 0 && i < kNumStages ? names[i] : "?";
}

enum class Phase : int { Prefill = 0, Decode = 1 };
inline constexpr int kNumPhases = 2;

// Seconds per stage and forward passes per phase (plain data: gathered as bytes).
struct StageTimes {
  double seconds[kNumPhases][kNumStages] = {};
  uint64_t passes[kNumPhases] = {};

  double total(Phase p) const {
    double t = 0;
    for (double s : seconds[static_cast<int>(p)]) t += s;
    return t;
  }
  double at(Phase p, Stage s) const { return seconds[static_cast<int>(p)][static_cast<int>(s)]; }
  // this - before, stage by stage (for a window between two snapshots).
  StageTimes minus(const StageTimes& before) const {
    StageTimes d = *this;
    for (int p = 0; p < kNumPhases; ++p) {
      for (int s = 0; s < kNumStages; ++s) d.seconds[p][s] -= before.seconds[p][s];
      d.passes[p] -= before.passes[p];
    }
    return d;
  }
};

class StageClock {
 public:
  using clock = std::chrono::steady_clock;
  StageClock() : last_(clock::now()) {}

  // Starts a new segment without charging the time since the last mark.
  void mark() { last_ = clock::now(); }
  // Charges the time since the last mark (or lap) to `s` in the current phase.
  void lap(Stage s) {
    const auto now = clock::now();
    times_.seconds[static_cast<int>(phase_)][static_cast<int>(s)] += std::chrono::duration<double>(now - last_).count();
    last_ = now;
  }
  void set_phase(Phase p) { phase_ = p; }
  Phase phase() const { return phase_; }
  void count_pass() { ++times_.passes[static_cast<int>(phase_)]; }
  const StageTimes& times() const { return times_; }

 private:
  clock::time_point last_;
  Phase phase_ = Phase::Prefill;
  StageTimes times_;
};

}  // namespace colibri
