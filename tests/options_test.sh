#!/usr/bin/env bash
# options_test.sh: every numeric option has a checked range (launcher/options.h).
# Run by ctest as
#   bash tests/options_test.sh <path-to-colibri>
# For each subcommand, values out of range (0, negative, huge) exit 11 before
# any work, with a message naming the option, the value and the accepted range;
# a value that is no number of the option's type (nan) is a usage error (2).
# --threads 100000 used to crash (SIGSEGV inside OpenMP). Under mpirun, a worker
# that stops answering (--inject-fault RANK:stall:N) ends the job within
# --comm-timeout with a message naming that rank (--comm-timeout 0 used to
# disable the deadline: such a job hung for ever). Stops at the first failure.
set -euo pipefail

# shellcheck source=tests/cli_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/cli_lib.sh"
cli_setup options "$@"
echo "colibri: $BIN"

step "a tiny model"
"$BIN" synth --preset tiny --seed 5 --out "$T/hf" --log-level warn
"$BIN" convert "$T/hf" "$T/m.colibri" --log-level warn
M=$T/m.colibri
printf '{"step": 0, "layer": 0, "token": 0, "experts": [0, 1], "weights": [0.5, 0.5]}\n' >"$T/trace.jsonl"
C=$(dirname "${BASH_SOURCE[0]}")/../configs/cluster/cpu_2core.json

# refuse CMD... -- OPT VALUE: `colibri CMD... --OPT=VALUE` exits 11 and says
# "--OPT VALUE is out of range: accepted [LO, HI]" (VALUE as printed: NUMBER).
refuse() {
  local args=() opt value shown
  while [ "$1" != "--" ]; do args+=("$1"); shift; done
  opt=$2 value=$3 shown=${4:-$3}
  expect_rc 11 "${args[0]} --$opt $value" "$BIN" "${args[@]}" "--$opt=$value" --log-level warn
  err_has "--$opt $shown is out of range: accepted "
}

step "generate: every numeric option"
G=(generate --model "$M" --prompt-ids 1,2,3)
refuse "${G[@]}" -- threads 100000
refuse "${G[@]}" -- threads -1
refuse "${G[@]}" -- threads 1025
err_has "[0, 1024]"
refuse "${G[@]}" -- max-new-tokens -1
refuse "${G[@]}" -- max-new-tokens 2000000000
refuse "${G[@]}" -- temperature -0.5
refuse "${G[@]}" -- temperature 1e9 1e+09
refuse "${G[@]}" -- top-k -1
refuse "${G[@]}" -- top-p 0
err_has "accepted (0, 1]"
refuse "${G[@]}" -- top-p 1.5
refuse "${G[@]}" -- prefill-chunk 0
refuse "${G[@]}" -- prefill-chunk 1000000
refuse "${G[@]}" -- max-context -1
refuse "${G[@]}" -- comm-timeout 0
err_has "[0.1, 86400] seconds"
refuse "${G[@]}" -- comm-timeout -5
refuse "${G[@]}" -- comm-timeout 1e9 1e+09
refuse "${G[@]}" -- redundant -1
refuse "${G[@]}" -- expert-cache-experts -1
refuse "${G[@]}" -- cache-decay 0
refuse "${G[@]}" -- cache-decay 1.5
refuse "${G[@]}" -- gpu -2
expect_rc 2 "generate --temperature nan (not a number: usage)" "$BIN" "${G[@]}" --temperature nan
err_has "nan"
expect_rc 11 "generate --inject-fault 5:stall:1 (no rank 5)" "$BIN" "${G[@]}" --inject-fault 5:stall:1
err_has "--inject-fault '5:stall:1'"
expect_rc 11 "generate --inject-fault 0:kill:x" "$BIN" "${G[@]}" --inject-fault 0:kill:x
# The limits themselves are accepted.
expect_rc 0 "generate at the limits" "$BIN" "${G[@]}" --threads 1 --max-new-tokens 0 --temperature 100 --top-p 1 \
  --prefill-chunk 65536 --comm-timeout 0.1 --cache-decay 1 --log-level warn

step "run: the same options"
refuse run --model "$M" --prompt-ids 1,2,3 -- threads 100000
refuse run --model "$M" --prompt-ids 1,2,3 -- comm-timeout 0

step "bench"
refuse bench --model "$M" -- threads 100000
refuse bench --model "$M" -- batch 0
refuse bench --model "$M" -- batch 65537
refuse bench --model "$M" -- prompt-len 0
refuse bench --model "$M" -- new-tokens 1
refuse bench --model "$M" -- reps 0
refuse bench --model "$M" -- warmup -1
refuse bench --model "$M" -- prefill-chunk 0
refuse bench --model "$M" -- comm-timeout 0
refuse bench --memory-bandwidth -- size-mb 0
refuse bench --memory-bandwidth -- reps 101
refuse bench --memory-bandwidth -- threads 5000
refuse bench --peak-flops -- reps 0
refuse bench --peak-flops -- threads 100000
refuse bench --tokenizer --model "$M" -- reps 0

step "cache-sim"
CS=(cache-sim --trace "$T/trace.jsonl")
refuse "${CS[@]}" -- capacity 0
refuse "${CS[@]}" -- capacity -3
refuse "${CS[@]}" --capacity 4 -- decay 0
refuse "${CS[@]}" --capacity 4 -- decay 2
refuse "${CS[@]}" --capacity 4 -- pin -1
refuse "${CS[@]}" --capacity 4 -- bytes-per-slot 2000000000000000

step "place"
refuse place --layers 2 --experts 4 --policy contiguous -- ranks 0
refuse place --layers 2 --experts 4 --policy contiguous -- ranks 100000
refuse place --experts 4 --ranks 2 --policy contiguous -- layers 0
refuse place --layers 2 --ranks 2 --policy contiguous -- experts -1
refuse place --layers 2 --experts 4 --ranks 3 --policy replicated -- redundant -1

step "simulate"
S=(simulate --cluster "$C" --hidden 64 --intermediate 96 --experts 4 --top-k 2)
refuse "${S[@]}" -- batch 0
refuse "${S[@]}" --batch 1 -- context -1
refuse "${S[@]}" --batch 1 -- steps 0
refuse "${S[@]}" --batch 1 -- nodes 0
refuse "${S[@]}" --batch 1 -- layers 0
refuse simulate --cluster "$C" --batch 1 --intermediate 96 --experts 4 --top-k 2 -- hidden 0
refuse simulate --cluster "$C" --batch 1 --hidden 64 --intermediate 96 --experts 4 -- top-k 5
err_has "[1, 4] (at most --experts)"

step "stats, synth, launch"
refuse stats "$T/trace.jsonl" -- top -1
refuse synth --out "$T/never" -- shard-mb 0
refuse synth --out "$T/never" -- vocab 0
refuse synth --out "$T/never" -- vocab 99999999
[ ! -e "$T/never" ] || fail "synth wrote its output before refusing"
for n in 0 100000; do
  expect_rc 11 "launch -n $n" "$BIN" launch --dry-run -n $n -- run --model "$M" --prompt-ids 1
  err_has "--np $n is out of range: accepted [1, 65536]"
done

# ---------------------------------------------------------------------------
step "a worker that stops answering: named within --comm-timeout"
if ! command -v mpirun >/dev/null 2>&1; then
  echo "   (no mpirun: skipped)"
else
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_WAIT_POLICY=passive
  start=$(date +%s)
  set +e
  timeout 60 mpirun --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 -np 3 "$BIN" run --model "$M" \
    --prompt-ids 1,2,3,4 --max-new-tokens 8 --ignore-eos --threads 1 --comm-timeout 2 --inject-fault 2:stall:3 \
    --log-level warn >"$T/out" 2>"$T/err"
  RC=$?
  set -e
  took=$(($(date +%s) - start))
  [ "$RC" -ne 124 ] || fail "the job hung (killed by timeout after 60 s)"
  [ "$RC" -ne 0 ] || fail "the job exited 0 with a stuck worker"
  err_has "timed out after 2 s"
  err_has "no answer from rank(s) 2 (lost or stuck)"
  if grep -qF "rank(s) ?" "$T/err"; then fail "the lost rank is not named"; fi
  [ "$took" -lt 40 ] || fail "the job took $took s to end"
  pass "stuck worker named: exit $RC after $took s: $(grep -o 'rank 0: timed out[^(]*' "$T/err" | head -1)"
  sleep 1
  if pgrep -f "$T/m.colibri" >/dev/null; then
    pgrep -af "$T/m.colibri" >&2
    fail "processes left behind"
  fi
fi

echo "options_test: all $CHECKS checks passed"
