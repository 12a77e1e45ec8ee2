#!/usr/bin/env bash
# sweep_test.sh: scripts/sweep and scripts/plot (docs/scaling.md, "Sweeps and plots").
# Run by ctest as
#   bash tests/sweep_test.sh <path-to-colibri> sweep|plot
# sweep: a 6-point matrix (ranks 1,2 x contiguous,round_robin x budgets 0,2; world 1
#   once per budget) on Mixtral's tiny model appends 6 rows under one header; the same
#   command again runs nothing and leaves the CSV as it was; with the last row removed
#   (an interrupted sweep) it runs exactly that point again; --dry-run prints the
#   commands without running them; a failing run (bad bench option) is reported,
#   recorded in CSV.failures, and the sweep exits 1 after finishing the others.
# plot: the four figures from a sweep's CSV are PNG files; a missing column is an
#   error naming it. Skipped (77) when no python3 has matplotlib.
set -euo pipefail

# shellcheck source=tests/cli_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/cli_lib.sh"
MODE=${2:-sweep}
cli_setup "sweep-$MODE" "$1"
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
command -v mpirun >/dev/null || { echo "SKIP: no mpirun"; exit 77; }
command -v python3 >/dev/null || { echo "SKIP: no python3"; exit 77; }

step "tiny model"
expect_rc 0 "synth tiny" "$BIN" synth --arch mixtral --preset tiny --out "$T/hf"
expect_rc 0 "convert" "$BIN" convert "$T/hf" "$T/m.colibri"
SWEEP=(python3 "$ROOT/scripts/sweep" --colibri "$BIN" --model "$T/m.colibri" --out "$T/r.csv" --ranks 1,2
  --policies contiguous,round_robin --batches 2 --cache-budgets 0,2 --prompt-len 4 --new-tokens 3 --reps 1 --warmup 0)
rows() { tail -n +2 "$1" | grep -c . || true; }

if [ "$MODE" = plot ]; then
  PY=""
  for p in python3 /usr/bin/python3; do
    if command -v "$p" >/dev/null && "$p" -c "import matplotlib" 2>/dev/null; then PY=$p; break; fi
  done
  [ -n "$PY" ] || { echo "SKIP: no python3 with matplotlib (apt-get install python3-matplotlib)"; exit 77; }
  expect_rc 0 "sweep for the plots" "${SWEEP[@]}"
  expect_rc 0 "plot" "$PY" "$ROOT/scripts/plot" "$T/r.csv" --out-dir "$T/fig" --prefix t_
  for f in throughput_vs_ranks stage_breakdown balancedness_heatmap hit_rate_vs_budget; do
    [ -s "$T/fig/t_$f.png" ] || fail "no figure t_$f.png"
    [ "$(head -c 8 "$T/fig/t_$f.png" | od -An -tx1 | tr -d ' \n')" = 89504e470d0a1a0a ] || fail "t_$f.png is not a PNG"
    out_has "$T/fig/t_$f.png"
  done
  pass "four PNG figures written and named"
  cut -d, -f1-20 "$T/r.csv" >"$T/cut.csv"
  expect_rc 1 "plot of a CSV without the result columns" "$PY" "$ROOT/scripts/plot" "$T/cut.csv" --out-dir "$T/fig2"
  err_has "decode_tok_s"
  pass "a missing column is named"
  echo "all $CHECKS checks passed"
  exit 0
fi

step "sweep"
expect_rc 0 "sweep --dry-run" "${SWEEP[@]}" --dry-run
[ ! -e "$T/r.csv" ] || fail "--dry-run wrote the CSV"
[ "$(grep -c -- ' bench ' "$T/out")" = 6 ] || fail "--dry-run does not list 6 runs"
pass "--dry-run lists 6 runs and runs none"
expect_rc 0 "sweep" "${SWEEP[@]}"
[ "$(rows "$T/r.csv")" = 6 ] || fail "the CSV holds $(rows "$T/r.csv") rows, not 6"
python3 - "$T/r.csv" <<'PYEOF' || fail "the CSV does not hold the matrix"
import csv, sys
d = list(csv.DictReader(open(sys.argv[1])))
got = sorted((r["world"], r["policy"] if r["world"] != "1" else "-", r["cache_budget_experts"]) for r in d)
want = sorted([("1", "-", "0"), ("1", "-", "2")] + [("2", p, b) for p in ("contiguous", "round_robin") for b in ("0", "2")])
assert got == want, got
assert all(float(r["decode_tok_s"]) > 0 and r["batch"] == "2" for r in d)
PYEOF
pass "6 rows, one per point of the matrix"
cp "$T/r.csv" "$T/full.csv"
expect_rc 0 "the same sweep again" "${SWEEP[@]}"
out_has "ran 0, skipped 6, failed 0"
cmp -s "$T/r.csv" "$T/full.csv" || fail "the CSV changed"
pass "a finished sweep resumes to nothing"
expect_rc 0 "one point again with another cache policy" "${SWEEP[@]}" --ranks 2 --policies contiguous --cache-budgets 2 \
  --cache-policy lfu
out_has "ran 1, skipped 0, failed 0"
expect_rc 0 "one point again with extra bench options" "${SWEEP[@]}" --ranks 2 --policies contiguous --cache-budgets 2 \
  -- --no-stage-sync
out_has "ran 1, skipped 0, failed 0"
cp "$T/full.csv" "$T/r.csv"
pass "another cache policy or other extra options are other points"
head -n 6 "$T/full.csv" >"$T/r.csv"
expect_rc 0 "the sweep after losing its last row" "${SWEEP[@]}"
out_has "ran 1, skipped 5, failed 0"
[ "$(rows "$T/r.csv")" = 6 ] || fail "the resumed CSV holds $(rows "$T/r.csv") rows"
pass "an interrupted sweep runs only what is missing"
expect_rc 1 "a sweep whose runs fail" python3 "$ROOT/scripts/sweep" --colibri "$BIN" --model "$T/m.colibri" \
  --out "$T/bad.csv" --ranks 1,2 --policies contiguous --batches 1 --prompt-len 2 --new-tokens 2 --reps 1 --warmup 0 \
  -- --kernels nosuch
out_has "ran 0, skipped 0, failed 2"
[ "$(grep -c nosuch "$T/bad.csv.failures")" = 2 ] || fail "the failures are not recorded"
grep -q ",11," "$T/bad.csv.failures" || fail "the exit code 11 is not recorded"
pass "failing runs are reported, recorded with exit code 11, and the sweep exits 1"
echo "all $CHECKS checks passed"
