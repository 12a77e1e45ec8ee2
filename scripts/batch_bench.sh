#!/usr/bin/env bash
# batch_bench.sh: continuous batching against one request at a time, on the load
# of the batching issue (docs/batch.md, "Speed"): N completion requests (default
# 1000) with random token-id prompts of 16..1024 tokens and 16..256 greedy new
# tokens (ignore_eos, so every request generates exactly its max_tokens), run
# through `colibri batch` at --max-running 1 and at --max-running R (default 64),
# in one process and with 2 expert workers (mpirun -np 3). Prints the wall time,
# the generated tokens/s of each run and the ratio, and checks that every run
# wrote the same tokens for every request (batch invariance). Needs python3.
#
# usage: scripts/batch_bench.sh COLIBRI MODEL OUT_DIR [N [R [SEED]]]
#   MODEL must take 1280 positions (the small and medium synth presets do; tiny does not)
#   env: COLIBRI_BENCH_WORLDS  the world sizes to run (default "1 3")
#        COLIBRI_BENCH_THREADS --threads of the coordinator (default: nproc)
set -euo pipefail
if [ $# -lt 3 ]; then sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 2; fi
BIN=$1 MODEL=$2 OUT=$3
N=${4:-1000} R=${5:-64} SEED=${6:-1}
WORLDS=${COLIBRI_BENCH_WORLDS:-"1 3"}
THREADS=${COLIBRI_BENCH_THREADS:-$(nproc)}
mkdir -p "$OUT"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_WAIT_POLICY=passive
command -v python3 >/dev/null || { echo "batch_bench: needs python3" >&2; exit 2; }
info=$("$BIN" inspect "$MODEL" --json) || { echo "batch_bench: cannot inspect $MODEL with $BIN" >&2; exit 1; }
vocab=$(python3 -c 'import json,sys; print(json.load(sys.stdin)["config"]["vocab_size"])' <<<"$info")
python3 - "$OUT/requests.jsonl" "$N" "$SEED" "$vocab" <<'EOF'
import json, random, sys
path, n, seed, vocab = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(seed)
with open(path, "w") as f:
    for i in range(n):
        p = rng.randint(16, 1024)
        body = {"prompt": [rng.randrange(vocab) for _ in range(p)], "max_tokens": rng.randint(16, 256),
                "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")
EOF
python3 - "$OUT/requests.jsonl" <<'EOF'
import json, sys
p = g = 0
for line in open(sys.argv[1]):
    b = json.loads(line)["body"]; p += len(b["prompt"]); g += b["max_tokens"]
print(f"load: {sum(1 for _ in open(sys.argv[1]))} requests, {p} prompt tokens, {g} tokens to generate")
EOF
lscpu | sed -n 's/^Model name: *//p' | sed 's/^/cpu: /'

run() {  # run WORLD MAX_RUNNING: prints "world W max-running M: S s, T tok/s"
  local w=$1 m=$2 res="$OUT/results-w$1-m$2.jsonl" t0 t1
  rm -f "$res"
  local cmd=("$BIN" batch --model "$MODEL" --input "$OUT/requests.jsonl" --output "$res" --max-running "$m"
    --max-step-tokens 512 --max-context 1280 --log-level warn)
  t0=$(date +%s.%N)
  local rc=0
  if [ "$w" -eq 1 ]; then
    "${cmd[@]}" --threads "$THREADS" >"$OUT/log-w$w-m$m.txt" 2>&1 || rc=$?
  else
    mpirun --oversubscribe --bind-to none -np "$w" "${cmd[@]}" >"$OUT/log-w$w-m$m.txt" 2>&1 || rc=$?
  fi
  t1=$(date +%s.%N)
  if [ "$rc" -ne 0 ]; then echo "world $w max-running $m: colibri batch failed (exit $rc, $OUT/log-w$w-m$m.txt)" >&2; return 1; fi
  python3 - "$res" "$t0" "$t1" "$w" "$m" <<'EOF'
import json, sys
res, t0, t1, w, m = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5]
toks = errors = 0
for line in open(res):
    r = json.loads(line)
    if r["error"]:
        errors += 1
        continue
    toks += r["response"]["body"]["usage"]["completion_tokens"]
s = t1 - t0
print(f"world {w} max-running {m}: {s:.1f} s, {toks} generated tokens, {toks / s:.1f} tok/s, {errors} errors")
EOF
}

for w in $WORLDS; do
  a=$(run "$w" 1) || exit 1
  echo "$a"
  b=$(run "$w" "$R") || exit 1
  echo "$b"
  python3 - "$a" "$b" <<'EOF'
import sys
ra = float(sys.argv[1].split(", ")[2].split()[0]); rb = float(sys.argv[2].split(", ")[2].split()[0])
print(f"   ratio: {rb / ra:.2f}x")
EOF
done
# Every run wrote the same tokens for every request (return_token_ids).
python3 - "$OUT" <<'EOF'
import glob, json, sys
runs = {}
for path in sorted(glob.glob(sys.argv[1] + "/results-*.jsonl")):
    runs[path] = {}
    for line in open(path):
        r = json.loads(line)
        runs[path][r["custom_id"]] = r["response"]["body"]["choices"][0]["token_ids"] if not r["error"] else None
ref = next(iter(runs.values()))
bad = [p for p, v in runs.items() if v != ref]
print(f"same text for every request in all {len(runs)} runs" if not bad else f"DIFFERENT: {bad}")
sys.exit(1 if bad else 0)
EOF
