#!/usr/bin/env bash
# The scaling experiment of docs/scaling.md ("Measured on this machine"), end to end:
#
# 1. Synthesizes and converts Mixtral's `small` preset (f32: 4 layers, hidden 512,
#    8 experts of 6 MiB, top-2: the expert count and top-k of Mixtral-8x7B).
# 2. Placement statistics from one real workload: the model generates with its
#    routing replaced by the GSM8K Mixtral-8x7B trace (../shared/traces, first 4
#    layers) and records it; `colibri stats` aggregates it (for --policy balanced).
# 3. `scripts/sweep`: ranks x policy x batch x cache budget, every run replaying
#    another real workload (the HumanEval trace, in time order), so the placements
#    are judged on routing with real skew, not on what they were built from.
# 4. `scripts/plot`: the figures under docs/figures/.
#
# usage: scripts/scaling_experiment.sh [WORKDIR]   (default /tmp/colibri-scaling)
#   env: COLIBRI (default build/bin/colibri), RANKS=1,2,3,4,
#        POLICIES=contiguous,round_robin,balanced, BATCHES=1,8,32, BUDGETS=0,4,8,16,
#        PROMPT=32, NEW=16, REPS=3, FIG_DIR=docs/figures, TRACES=../shared/traces/mixtral-8x7b
# Resumable: rerun the same command after an interruption (the sweep skips the runs
# already in WORKDIR/results.csv).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
W=${1:-/tmp/colibri-scaling}
C=${COLIBRI:-$ROOT/build/bin/colibri}
TRACES=$(realpath -m "${TRACES:-$ROOT/../shared/traces/mixtral-8x7b}")
FIG_DIR=${FIG_DIR:-$ROOT/docs/figures}
[ -x "$C" ] || { echo "no colibri at $C (build first: scripts/build.sh)" >&2; exit 2; }
for f in gsm8k_2_routing.jsonl humaneval0_routing_raw.jsonl; do
  [ -r "$TRACES/$f" ] || { echo "missing trace $TRACES/$f" >&2; exit 2; }
done
mkdir -p "$W"
# NOTE: no OMP_WAIT_POLICY=passive (the test suite's setting): with several ranks
# each has one thread, so the policy does not matter, and at world 1 (two threads)
# passive waits cost ~45% of a small model's decode step (2.50 vs 1.40 ms).

M=$W/small.colibri
if [ ! -f "$M" ]; then
  "$C" synth --arch mixtral --preset small --out "$W/small_hf"
  "$C" convert "$W/small_hf" "$M.tmp" && mv "$M.tmp" "$M"
fi
S=$W/gsm8k.stats.json
if [ ! -f "$S" ]; then
  # 16 sequences x (8 + 64) tokens = 1152 routed tokens per layer (the trace's ~250
  # rows per layer, replayed in order and wrapped).
  prompts=()
  for i in $(seq 0 15); do prompts+=(--prompt-ids "$((i + 1)),$((i + 7)),$((i + 13)),5,6,7,8,9"); done
  "$C" generate --model "$M" "${prompts[@]}" -n 64 --ignore-eos --routing-replay "$TRACES/gsm8k_2_routing.jsonl" \
    --record-routing "$W/gsm8k.replayed.jsonl" >/dev/null
  "$C" stats "$W/gsm8k.replayed.jsonl" --out "$S"
fi
"$ROOT/scripts/sweep" --colibri "$C" --model "$M" --out "$W/results.csv" --stats "$S" \
  --routing-replay "$TRACES/humaneval0_routing_raw.jsonl" \
  --ranks "${RANKS:-1,2,3,4}" --policies "${POLICIES:-contiguous,round_robin,balanced}" \
  --batches "${BATCHES:-1,8,32}" --cache-budgets "${BUDGETS:-0,4,8,16}" \
  --prompt-len "${PROMPT:-32}" --new-tokens "${NEW:-16}" --reps "${REPS:-3}" || echo "some runs failed (see $W/results.csv.failures)" >&2
mkdir -p "$FIG_DIR"
"$ROOT/scripts/plot" "$W/results.csv" --out-dir "$FIG_DIR" --prefix scaling_
