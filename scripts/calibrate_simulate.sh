#!/usr/bin/env bash
# Calibrate `colibri simulate` against `colibri run` on this machine (docs/scaling.md,
# "Calibration on this machine").
#
# 1. Synthesizes a model (mixtral preset small, f32: 4 layers, 8 experts of 6 MiB, top-2),
#    converts it, and records the routing trace of a fixed batch of BATCH prompts with
#    `colibri generate --record-routing` (world 1); `colibri stats` aggregates it.
# 2. For world sizes 1..4 (2..4 under mpirun, the engine's default threads per rank:
#    all cores for one rank, max(1, cores / ranks) otherwise) and the placements
#    contiguous, round_robin, balanced (from the stats), runs `colibri run` on the same
#    prompts REPS times and takes the decode time per step from "decode: N tokens in X s"
#    (N = BATCH x (NEW - 1): the first new token comes from the prefill), median over reps.
# 3. Runs `colibri simulate` for the same world, placement, decode-only trace and batch,
#    with tokens on the coordinator, sent once per (token, expert) as the engine does
#    (--source coordinator --send per_expert), f32 weights/activations/KV, the mean KV
#    context of the decode steps; once per cluster file in CLUSTERS.
# 4. Prints measured vs simulated step time and the relative error (sim / measured - 1).
#
# The cluster files describe one rank of one core; the world size of the simulation is
# the file's nodes x gpus_per_node, so for each world size W a copy with gpus_per_node = W
# is written, its device scaled by the engine's threads per rank (x2 for W = 1).
# With UNSHARED=1 an extra column (last cluster file) drops the file's node_shared object: the
# model without core and memory-bus sharing between the ranks of a node (what the simulator
# lacked before; expert ranks outnumbering the cores and streaming weights at once).
#
# usage: scripts/calibrate_simulate.sh [COLIBRI] [WORKDIR]
#   env: CLUSTERS="a.json b.json" (default configs/cluster/cpu_2core.json), REPS=3,
#        NEW=65 (new tokens per sequence), BATCH=8, WORLDS="1 2 3 4",
#        MEASURED=file.tsv (reuse measurements of an earlier run: only re-simulate),
#        UNSHARED=1 (add a column without the file's node_shared sharing model),
#        LINK=1 (also time an MPI ping-pong of 8 B..2 MiB between 2 ranks: the link's alpha/beta)
# Output: the table on stdout, WORKDIR/measured.tsv, WORKDIR/table.tsv.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
colibri="$(realpath "${1:-$repo/build/bin/colibri}")"
work="${2:-/tmp/colibri_calibrate}"
CLUSTERS="${CLUSTERS:-$repo/configs/cluster/cpu_2core.json}"
REPS="${REPS:-3}"
NEW="${NEW:-65}"
BATCH="${BATCH:-8}"
WORLDS="${WORLDS:-1 2 3 4}"
UNSHARED="${UNSHARED:-0}"
MEASURED="${MEASURED:-}"
cores="$(nproc)"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Under mpirun (one thread per rank here) OMP_WAIT_POLICY=passive, as in tests/mpi_parity_test.sh;
# the single process keeps the OpenMP default: passive costs it ~70% (9.5 vs 5.6 ms/step).
mpirun_base=(env OMP_WAIT_POLICY=passive mpirun -x OMP_WAIT_POLICY --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 --mca btl self,vader,tcp)
mkdir -p "$work"
cd "$work"
log() { echo "[calibrate] $*" >&2; }

# --- 1. model, prompts, trace, stats ---------------------------------------------------
if [ ! -f m.colibri ]; then
  "$colibri" synth --arch mixtral --preset small --out hf --log-level warn
  "$colibri" convert hf m.colibri --log-level warn
fi
prompts=()
for i in $(seq 0 $((BATCH - 1))); do
  prompts+=(--prompt-ids "$((i * 7 + 3)),$((i * 5 + 11)),42,9,$((i + 100)),17,250,31")
done
prompt_len=8
common=(--model m.colibri "${prompts[@]}" --max-new-tokens "$NEW" --ignore-eos --log-level warn)
"$colibri" generate "${common[@]}" --record-routing trace.jsonl > ref.txt
"$colibri" stats trace.jsonl --out stats.json --log-level warn > /dev/null
# The simulator takes BATCH rows per step in file order: keep the decode steps only
# (step 0 is the prefill of all prompt positions).
python3 - <<'EOF'
import json
lines = open('trace.jsonl').read().splitlines()
keep = [lines[0]] + [l for l in lines[1:] if json.loads(l)['step'] >= 1]
open('trace_decode.jsonl', 'w').write('\n'.join(keep) + '\n')
EOF
steps=$((NEW - 1))
context=$((prompt_len + (NEW - 2) / 2))  # mean KV positions read by a decode step

threads_for() { if [ "$1" = 1 ]; then echo "$cores"; else local t=$((cores / $1)); [ "$t" -lt 1 ] && t=1; echo "$t"; fi; }
policies_for() { if [ "$1" = 1 ]; then echo contiguous; else echo "contiguous round_robin balanced"; fi; }

for w in $WORLDS; do
  for pol in $(policies_for "$w"); do
    "$colibri" place --model m.colibri --ranks "$w" --policy "$pol" --stats stats.json \
      --out "place_${w}_${pol}.json" --log-level warn > /dev/null
  done
done

# --- 2. measurements --------------------------------------------------------------------
wait_quiet() {
  local i
  for i in $(seq 1 30); do
    awk '{exit !($1 < 0.5)}' /proc/loadavg && return 0
    sleep 2
  done
  log "WARNING: load average $(cut -d' ' -f1 /proc/loadavg) >= 0.5; measuring anyway"
}
if [ -z "$MEASURED" ]; then
  MEASURED="$work/measured.tsv"
  : > "$MEASURED"
  wait_quiet
  log "load $(cut -d' ' -f1-3 /proc/loadavg); $REPS reps, batch $BATCH, $steps decode steps"
  for rep in $(seq 1 "$REPS"); do  # reps outermost: drift spreads over all cases
    for w in $WORLDS; do
      for pol in $(policies_for "$w"); do
        cmd=("$colibri" run "${common[@]}" --placement "place_${w}_${pol}.json")
        [ "$w" -gt 1 ] && cmd=("${mpirun_base[@]}" -np "$w" "${cmd[@]}")
        out="$("${cmd[@]}")"
        line="$(grep '^decode:' <<< "$out")"
        tok="$(awk '{print $2}' <<< "$line")"; sec="$(awk '{print $5}' <<< "$line")"
        xb="$(grep '^exchange:' <<< "$out" | sed -E 's/.* ([0-9]+) bytes sent in all.*/\1/' || true)"
        ms="$(python3 -c "print($sec / ($tok / $BATCH) * 1e3)")"
        printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$w" "$pol" "$rep" "$ms" "$tok" "${xb:-0}" >> "$MEASURED"
        log "world $w $pol rep $rep: $line -> $ms ms/step"
      done
    done
  done
fi

# --- 2b. the shared-memory link, measured directly (LINK=1; needs mpicc) -----------------
if [ "${LINK:-0}" = 1 ]; then
  cat > pingpong.c <<'PP'
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
int main(int c, char** v) {
  MPI_Init(&c, &v); int r; MPI_Comm_rank(MPI_COMM_WORLD, &r);
  size_t sizes[] = {8, 2048, 8192, 32768, 131072, 524288, 2097152}; char* b = calloc(2097152, 1);
  for (int s = 0; s < 7; s++) { int n = sizes[s] > 100000 ? 200 : 2000;
    for (int w = 0; w < 2; w++) { MPI_Barrier(MPI_COMM_WORLD); double t = MPI_Wtime();
      for (int i = 0; i < n; i++) {
        if (r == 0) { MPI_Send(b, sizes[s], MPI_BYTE, 1, 0, MPI_COMM_WORLD); MPI_Recv(b, sizes[s], MPI_BYTE, 1, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE); }
        else { MPI_Recv(b, sizes[s], MPI_BYTE, 0, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE); MPI_Send(b, sizes[s], MPI_BYTE, 0, 0, MPI_COMM_WORLD); } }
      t = MPI_Wtime() - t;
      if (r == 0 && w == 1) printf("link: %zu bytes one way %.2f us (%.2f GB/s)\n", sizes[s], t / n / 2 * 1e6, sizes[s] / (t / n / 2) / 1e9); } }
  MPI_Finalize(); }
PP
  mpicc -O2 pingpong.c -o pingpong && "${mpirun_base[@]}" -np 2 ./pingpong | tee link.txt >&2
fi

# --- 3. simulations ---------------------------------------------------------------------
simulate() {  # cluster world policy unshared(0/1) -> step ms
  local cl="$1" w="$2" pol="$3" unshared="$4" tmp
  tmp="cluster_w${w}.json"
  python3 - "$cl" "$w" "$(threads_for "$w")" "$unshared" > "$tmp" <<'EOF'
import json, sys
c = json.load(open(sys.argv[1])); w = int(sys.argv[2]); t = int(sys.argv[3])
unshared = sys.argv[4] == '1'
c['nodes'] = 1; c['gpus_per_node'] = w
dev = c['device']
dev['tflops'] *= t; dev['mem_gbytes_per_s'] *= t   # the file: one rank of one core
if unshared:
    c.pop('node_shared', None)
json.dump(c, sys.stdout)
EOF
  "$colibri" simulate --cluster "$tmp" --model m.colibri --placement "place_${w}_${pol}.json" \
    --trace trace_decode.jsonl --batch "$BATCH" --steps "$steps" --context "$context" \
    --source coordinator --send per_expert --weight-dtype f32 --dispatch-dtype f32 \
    --combine-dtype f32 --kv-dtype f32 --json --log-level warn |
    python3 -c "import json,sys; print(json.load(sys.stdin)['totals']['step_ms'])"
}
names=()
for cl in $CLUSTERS; do names+=("$(basename "$cl" .json)"); done
: > table.tsv
for w in $WORLDS; do
  for pol in $(policies_for "$w"); do
    row="$w\t$pol"
    for cl in $CLUSTERS; do row="$row\t$(simulate "$cl" "$w" "$pol" 0)"; done
    if [ "$UNSHARED" = 1 ]; then last="${CLUSTERS##* }"; row="$row\t$(simulate "$last" "$w" "$pol" 1)"; fi
    printf "$row\n" >> table.tsv
  done
done

# --- 4. table -----------------------------------------------------------------------------
python3 - "$MEASURED" table.tsv "$UNSHARED" "${names[@]}" <<'EOF'
import statistics, sys
meas, table, unshared, names = sys.argv[1], sys.argv[2], sys.argv[3] == '1', sys.argv[4:]
if unshared: names = names + [names[-1] + '-unshared']
m = {}
for l in open(meas):
    w, pol, rep, ms, tok, xb = l.split('\t')
    m.setdefault((w, pol), []).append(float(ms))
hdr = f"{'world':>5} {'placement':<12} {'measured ms (reps)':<28}"
for n in names: hdr += f" {n[:22]:>22} {'err':>7}"
print(hdr)
errs = {n: [] for n in names}
for l in open(table):
    f = l.rstrip('\n').split('\t'); w, pol, sims = f[0], f[1], [float(x) for x in f[2:]]
    v = m.get((w, pol))
    if not v: continue
    med = statistics.median(v)
    s = f"{w:>5} {pol:<12} {med:7.3f} ({', '.join(f'{x:.2f}' for x in v)})"
    s = f"{s:<47}"
    for n, x in zip(names, sims):
        e = x / med - 1; errs[n].append(abs(e))
        s += f" {x:22.3f} {e:+7.1%}"
    print(s)
for n in names:
    print(f"{n}: mean |error| {statistics.mean(errs[n]):.1%}, max {max(errs[n]):.1%}")
EOF
