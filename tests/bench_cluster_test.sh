#!/usr/bin/env bash
# bench_cluster_test.sh: `colibri bench` as an expert-parallel cluster (docs/scaling.md,
# "Measuring a cluster"). Run by ctest as
#   bash tests/bench_cluster_test.sh <path-to-colibri>
# On Mixtral's tiny synthetic model (2 MoE layers, 4 experts, top-2) with 3 ranks
# (coordinator + 2 workers, contiguous: experts 0-1 on rank 1, 2-3 on rank 2):
# - --routing-replay makes every token choose known experts, so the figures that
#   follow from the routing are checked exactly: experts {0,3} -> one row to each
#   worker, balancedness 1, the routing minimum = the rows sent; experts {0,1} ->
#   both rows to rank 1, balancedness 0.5, the minimum half the rows sent; the
#   rows each worker served; `run --record-routing` records what was replayed.
# - --json: the configuration echoed, percentiles ordered, every rank's stages
#   present and non-negative (none of the coordinator's on a worker and no expert
#   time on a coordinator without experts), rank 0's stages adding up to its step.
# - --csv: appends one row per run under one header (also when its lines end in CRLF);
#   a file with other columns is refused (exit 11) and left as it was.
# - SIGINT stops a benchmark with exit 130 and writes nothing.
# - --device: an unknown one is refused (exit 11); --device cuda runs where a GPU is, also
#   with a fast-tier budget (the GPU fast tier: its cache figures reported as the CPU's
#   would be), and is refused with exit 15 on every rank where none is, budget or not.
# - a bad trace (other expert count) ends every rank with exit 11 and a message.
set -euo pipefail

# shellcheck source=tests/cli_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/cli_lib.sh"
cli_setup bench-cluster "$@"
command -v mpirun >/dev/null || { echo "SKIP: no mpirun"; exit 77; }
command -v python3 >/dev/null || { echo "SKIP: no python3 to read the JSON"; exit 77; }

# py FILE EXPR: evaluates a Python expression with d = the JSON in FILE; prints it.
py() { python3 -c 'import json,sys,math; d=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))' "$1" "$2"; }
# check FILE EXPR WHAT: fails unless the expression is true.
check() { [ "$(py "$1" "$2")" = True ] || fail "$3 ($2 is false in $1)"; }

step "tiny model"
expect_rc 0 "synth tiny" "$BIN" synth --arch mixtral --preset tiny --out "$T/hf"
expect_rc 0 "convert" "$BIN" convert "$T/hf" "$T/m.colibri"
M=$T/m.colibri

# trace FILE E1 E2: every token of both MoE layers chooses experts E1, E2.
trace() {
  {
    echo '{"format":"colibri-routing","version":1,"num_layers":2,"num_experts":4,"top_k":2}'
    echo "{\"step\":0,\"layer\":0,\"seq\":0,\"pos\":0,\"experts\":[$2,$3],\"weights\":[0.625,0.375]}"
    echo "{\"step\":0,\"layer\":1,\"seq\":0,\"pos\":0,\"experts\":[$3,$2],\"weights\":[0.75,0.25]}"
  } >"$1"
}
trace "$T/spread.jsonl" 0 3
trace "$T/skewed.jsonl" 0 1
B=4 P=5 N=6 R=2
bench3() {
  expect_rc 0 "$1" "$BIN" launch -n 3 -- bench --model "$M" --batch $B --prompt-len $P --new-tokens $N --reps $R \
    --warmup 1 --threads 1 "${@:2}"
}

step "replayed routing to both workers"
bench3 "bench, 3 ranks, experts {0,3}" --routing-replay "$T/spread.jsonl" --json --csv "$T/r.csv" --label spread
J=$T/spread.json
cp "$T/out" "$J"
check "$J" "d['config']['world'] == 3 and d['config']['comm'] == 'mpi' and d['config']['stage_sync'] is True" "config"
check "$J" "d['config']['routing_replay'].endswith('spread.jsonl') and d['label'] == 'spread'" "replay and label echoed"
check "$J" "d['command'].startswith('colibri bench ') and '--batch 4' in d['command']" "command echoed"
check "$J" "d['config']['batch'] == $B and d['config']['policy'] == 'contiguous' and d['config']['coordinator_experts'] is False" "config"
pass "the configuration and the command are echoed"
# Per decode token: 2 MoE layers x 2 rows of 128 f32 (512 bytes) there and back = 4096
# bytes, one row per worker per layer: the minimum is all of it.
check "$J" "d['exchange']['row_bytes'] == 512 and d['exchange']['routing_minimum_bytes_per_decode_token'] == 4096" "minimum 4096"
check "$J" "4096 <= d['exchange']['bytes_per_decode_token'] < 4096 + 512" "exchanged = rows + counts"
check "$J" "d['balancedness']['per_moe_layer'] == [1.0, 1.0] and d['balancedness']['mean'] == 1.0" "balancedness 1"
# Every timed token (prefill and decode) sends one row per layer to each worker.
rows=$((R * B * (P + N - 1) * 2))
check "$J" "[r['rows_served'] for r in d['ranks']] == [0, $rows, $rows]" "rows served per rank"
pass "routing {0,3}: minimum = rows sent = 4096 B/token, balancedness 1, $rows rows per worker"

check "$J" "d['decode_step_ms']['steps'] == $R * ($N - 1)" "decode steps"
check "$J" "0 < d['decode_step_ms']['p50'] <= d['decode_step_ms']['p90'] <= d['decode_step_ms']['p99']" "percentiles ordered"
pass "P50 <= P90 <= P99 over $((R * (N - 1))) decode steps"
stages="['attention','router','dispatch_plan','exchange','expert_ffn','combine','dense','lm_head','sampling','wait','other']"
check "$J" "all(sorted(r['decode_stage_ms_per_step']) == sorted($stages) for r in d['ranks'])" "every stage named"
check "$J" "all(v >= 0 and math.isfinite(v) for r in d['ranks'] for v in r['decode_stage_ms_per_step'].values())" "stages >= 0"
check "$J" "d['ranks'][0]['decode_stage_ms_per_step']['expert_ffn'] == 0" "no expert time on the coordinator"
check "$J" "all(r['decode_stage_ms_per_step'][s] == 0 for r in d['ranks'][1:] for s in ['attention','router','lm_head','sampling','dense'])" \
  "no coordinator stage on a worker"
check "$J" "all(r['decode_stage_ms_per_step']['expert_ffn'] > 0 for r in d['ranks'][1:])" "workers computed"
check "$J" "d['ranks'][0]['decode_stage_ms_per_step']['attention'] > 0 and d['ranks'][0]['decode_stage_ms_per_step']['exchange'] > 0" \
  "coordinator attention and exchange"
# Accounting, not speed: rank 0's stages cover its decode steps; 'other' (outside every
# stage: building the next step's rows) stays a sliver of the step.
check "$J" "d['ranks'][0]['decode_stage_ms_per_step']['other'] <= 0.1 * d['decode_step_ms']['mean'] + 0.05" \
  "rank 0's stages cover its step"
check "$J" "all(r['peak_rss_bytes'] > 0 for r in d['ranks']) and d['hit_rate'] == 1.0" "RSS and hit rate"
# Prefill: B x P = 20 tokens in one pass of up to 256 per rep; its stages where they belong too.
check "$J" "d['prefill_pass_ms']['passes'] == $R and 0 < d['prefill_pass_ms']['p50'] <= d['prefill_pass_ms']['p99']" "prefill passes"
check "$J" "d['ranks'][0]['prefill_stage_ms_per_pass']['attention'] > 0 and all(r['prefill_stage_ms_per_pass']['expert_ffn'] > 0 for r in d['ranks'][1:])" \
  "prefill stages"
pass "every rank's stages present, where they belong, adding up on rank 0"

step "replayed routing all to one worker, a one-expert cache"
bench3 "bench, 3 ranks, experts {0,1}" --routing-replay "$T/skewed.jsonl" --json --csv "$T/r.csv" --expert-cache-experts 1
J=$T/skewed.json
cp "$T/out" "$J"
check "$J" "d['exchange']['routing_minimum_bytes_per_decode_token'] == 2048" "minimum 2048 (one worker per layer)"
check "$J" "4096 <= d['exchange']['bytes_per_decode_token'] < 4096 + 512" "rows still sent per expert"
check "$J" "d['balancedness']['per_moe_layer'] == [0.5, 0.5]" "balancedness 0.5"
check "$J" "[r['rows_served'] for r in d['ranks']] == [0, 2 * $rows, 0]" "all rows on rank 1"
# One slot for two experts used alternately in every layer: every access a miss.
check "$J" "d['ranks'][1]['cache_slots'] == 1 and d['ranks'][1]['hits'] == 0 and d['ranks'][1]['misses'] > 0 and d['hit_rate'] == 0.0" \
  "cache misses"
check "$J" "d['ranks'][2]['hits'] + d['ranks'][2]['misses'] == 0 and d['ranks'][2]['hit_rate'] is None" "idle worker"
pass "routing {0,1}: minimum half the rows sent, balancedness 0.5, one-slot cache never hits"

step "csv"
python3 - "$T/r.csv" <<'PYEOF' || fail "the CSV is not one header and two rows of the same width"
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
assert len(rows) == 3, len(rows)
h = rows[0]
assert all(len(r) == len(h) for r in rows), [len(r) for r in rows]
d = [dict(zip(h, r)) for r in rows[1:]]
for k in ["world", "policy", "batch", "cache_budget_experts", "routing_replay", "decode_tok_s", "step_ms_p99",
          "balancedness_per_layer", "hit_rate_per_rank", "coord_wait_ms", "workers_expert_ffn_ms", "command"]:
    assert k in h, k
assert [x["world"] for x in d] == ["3", "3"]
assert [x["label"] for x in d] == ["spread", ""]
assert [x["cache_budget_experts"] for x in d] == ["0", "1"]
assert d[0]["balancedness_per_layer"] == "1;1" and d[1]["balancedness_per_layer"] == "0.5;0.5"
assert d[1]["hit_rate_per_rank"].split(";") == ["nan", "0", "nan"], d[1]["hit_rate_per_rank"]
assert float(d[0]["exchange_min_bytes_per_token"]) == 4096
assert float(d[0]["decode_tok_s"]) > 0 and float(d[0]["workers_expert_ffn_ms"]) > 0
PYEOF
pass "two runs appended under one header, values as in the JSON"
sed 's/$/\r/' "$T/r.csv" >"$T/crlf.csv"
expect_rc 0 "append to the same CSV with CRLF lines" "$BIN" bench --model "$M" --batch 1 --prompt-len 2 --new-tokens 2 \
  --reps 1 --warmup 0 --csv "$T/crlf.csv"
[ "$(wc -l <"$T/crlf.csv")" = 4 ] || fail "the CRLF CSV does not hold 4 lines"
pass "a CSV rewritten with CRLF line ends is the same header"
printf 'timestamp,version,something_else\n' >"$T/other.csv"
cp "$T/other.csv" "$T/other.orig"
expect_rc 11 "a CSV with other columns" "$BIN" bench --model "$M" --batch 1 --prompt-len 2 --new-tokens 2 --reps 1 \
  --warmup 0 --csv "$T/other.csv"
err_has "has other columns (column 3: 'something_else'"
cmp -s "$T/other.csv" "$T/other.orig" || fail "the refused CSV was changed"
pass "a CSV with other columns is refused and left as it was"

step "interrupt"
# SIGINT stops the benchmark after the current forward pass: exit 130, nothing written.
set +e
"$BIN" bench --model "$M" --batch 16 --prompt-len 8 --new-tokens 200 --reps 1000 --warmup 0 --csv "$T/int.csv" \
  >"$T/out" 2>"$T/err" &
pid=$!
sleep 1.5
kill -INT $pid
wait $pid
RC=$?
set -e
[ "$RC" -eq 130 ] || fail "bench after SIGINT: exit status $RC, expected 130"
err_has "interrupted by SIGINT"
[ ! -e "$T/int.csv" ] || fail "an interrupted bench wrote its CSV"
pass "SIGINT: exit 130, no CSV row"

step "record what is replayed"
expect_rc 0 "run, 3 ranks, replay + record" "$BIN" launch -n 3 -- run --model "$M" --prompt-ids 1,2,3 --prompt-ids 4 -n 3 \
  --routing-replay "$T/spread.jsonl" --record-routing "$T/rec.jsonl"
python3 - "$T/rec.jsonl" <<'PYEOF' || fail "the recorded routing is not the replayed one"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])][1:]
assert len(rows) == 2 * (4 + 2 * 2), len(rows)  # 2 layers x (4 prompt tokens + 2 decode steps x 2 sequences)
for r in rows:
    want = ([0, 3], [0.625, 0.375]) if r["layer"] == 0 else ([3, 0], [0.75, 0.25])
    assert (r["experts"], r["weights"]) == want, r
PYEOF
pass "run --record-routing holds exactly the replayed experts and weights"

step "device"
# --device cuda: the dense part and the experts on the GPU (--coordinator-device: rank 0's
# dense part elsewhere). Without a GPU (or CUDA in the build) a clear refusal by the ranks
# that need one (exit 15); with one, the run completes.
expect_rc 11 "--device tpu" "$BIN" generate --model "$M" --prompt-ids 1,2,3 -n 2 --device tpu
err_has "--device 'tpu' (cpu or cuda)"
# no_gpu WHAT: the last command was refused for want of a GPU (or of CUDA in the build).
no_gpu() {
  [ "$RC" -eq 15 ] || fail "$1 without a GPU: exit $RC, expected 15"
  grep -qE "no CUDA device is visible|this build has no CUDA" "$T/err" || fail "$1: no clear message"
  pass "$1 without a GPU: refused with exit 15"
}
expect_rc 11 "--coordinator-device tpu" "$BIN" generate --model "$M" --prompt-ids 1,2,3 -n 2 --coordinator-device tpu
err_has "--coordinator-device 'tpu' (cpu, cuda or same)"
# Every rank on its GPU; the coordinator on the CPU with GPU workers; the reverse. With a
# GPU each completes (the parity tests, CudaEngine.*, bound what it computes).
for devs in "--device cuda" "--device cuda --coordinator-device cpu" "--coordinator-device cuda"; do
  # shellcheck disable=SC2086
  run "$BIN" launch -n 3 -- run --model "$M" --prompt-ids 1,2,3 -n 2 $devs
  if [ "$RC" -eq 0 ]; then
    out_has "sequence 0:"
    pass "$devs ran on the GPU"
  else
    no_gpu "$devs"
  fi
done
# The GPU fast tier: one expert slot per worker, the routing of "a one-expert cache" above
# (experts 0 and 1 alternate on rank 1): accepted; on a GPU every access a miss, and the
# figures those of the same run on the CPU.
gpu_tier() {
  run "$BIN" launch -n 3 -- bench --model "$M" --batch $B --prompt-len $P --new-tokens $N --reps 1 --warmup 0 \
    --threads 1 --routing-replay "$T/skewed.jsonl" --json --expert-cache-experts 1 "$@"
}
gpu_tier --device cpu
[ "$RC" -eq 0 ] || fail "the one-slot bench on the CPU: exit $RC"
cp "$T/out" "$T/cpu-tier.json"
gpu_tier --device cuda
if [ "$RC" -eq 0 ]; then
  J=$T/gpu-tier.json
  cp "$T/out" "$J"
  check "$J" "d['ranks'][1]['cache_policy'] == 'lru' and d['ranks'][1]['cache_slots'] == 1" "the GPU cache: lru, one slot"
  check "$J" "d['ranks'][1]['hits'] == 0 and d['ranks'][1]['misses'] > 0 and d['hit_rate'] == 0.0" \
    "the GPU cache: every access a miss"
  python3 - "$T/cpu-tier.json" "$J" <<'PYEOF' || fail "the GPU cache's figures differ from the CPU store's"
import json, sys
c, g = (json.load(open(f))['ranks'] for f in sys.argv[1:])
for r in (1, 2):
    for k in ('hits', 'misses', 'evictions', 'cache_slots', 'cache_policy'):
        assert c[r][k] == g[r][k], (r, k, c[r][k], g[r][k])
PYEOF
  pass "--device cuda with --expert-cache-experts 1 ran on the GPU and reported the CPU store's figures"
else
  no_gpu "--device cuda with --expert-cache-experts 1"
fi

step "bad trace"
printf '{"format":"colibri-routing","version":1,"num_layers":2,"num_experts":8,"top_k":2}\n{"step":0,"layer":0,"seq":0,"pos":0,"experts":[0,7],"weights":[0.5,0.5]}\n{"step":0,"layer":1,"seq":0,"pos":0,"experts":[0,7],"weights":[0.5,0.5]}\n' >"$T/eight.jsonl"
expect_rc 11 "a trace of 8 experts on a 4-expert model" "$BIN" launch -n 3 -- bench --model "$M" --batch 1 --prompt-len 2 \
  --new-tokens 2 --reps 1 --routing-replay "$T/eight.jsonl"
err_has "the trace routes to 8 experts, the model has 4"
expect_rc 11 "the same with one rank" "$BIN" bench --model "$M" --batch 1 --prompt-len 2 --new-tokens 2 --reps 1 \
  --routing-replay "$T/eight.jsonl"
err_has "the trace routes to 8 experts, the model has 4"
pass "a trace that does not fit the model ends every rank with exit 11"

echo "all $CHECKS checks passed"
