#!/usr/bin/env bash
# The main job end to end on a fresh machine: installs what is missing, builds,
# synthesises a small Mixtral-style model (Hugging Face layout), converts it to
# .colibri, and generates tokens in one process and then as a cluster (a
# coordinator and two expert workers under mpirun), printing the tokens, the
# tokens/s and every worker's expert-cache statistics, then measures the cluster
# (colibri bench under mpirun: per-rank stage breakdown, exchange, balancedness).
# usage: scripts/demo.sh [preset: tiny|small|medium] (default small)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
preset="${1:-small}"
bash "$root/scripts/setup.sh"
bash "$root/scripts/build.sh"
colibri="${COLIBRI_BUILD_DIR:-$root/build}/bin/colibri"
work="$root/.demo"
mkdir -p "$work"
hf="$work/${preset}_hf"
model="$work/${preset}.colibri"
if [ ! -f "$hf/config.json" ]; then
  echo "== synthesising the '$preset' model (seeded random weights) into $hf"
  "$colibri" synth --arch mixtral --preset "$preset" --seed 42 --out "$hf"
fi
if [ ! -f "$model" ]; then
  echo "== converting to $model (bf16)"
  "$colibri" convert "$hf" "$model" --dtype bf16
fi
"$colibri" inspect "$model" | head -5
prompts=(--prompt-ids 1,415,29,90,102,338 --prompt-ids 1,450,99,173,17,291,7,44)
echo "== one process: 2 prompts, 32 new tokens each, greedy"
"$colibri" generate --model "$model" "${prompts[@]}" --max-new-tokens 32 --ignore-eos --log-level warn
echo
echo "== a cluster: coordinator (rank 0) + 2 expert workers, experts placed round-robin,"
echo "   each worker with a fast tier of 12 experts (LRU) in front of the mmapped file"
"$colibri" launch -n 3 -- run --model "$model" "${prompts[@]}" --max-new-tokens 32 --ignore-eos \
  --policy round_robin --expert-cache-experts 12 --cache-policy lru --log-level warn
echo
echo "== the same cluster measured: where a decode step's time goes on each rank, the bytes"
echo "   exchanged against the routing's minimum, balancedness per layer (docs/scaling.md)"
"$colibri" launch -n 3 -- bench --model "$model" --batch 8 --prompt-len 32 --new-tokens 16 --reps 2 \
  --policy round_robin --log-level warn | sed -n '/^decode step latency/,$p'
