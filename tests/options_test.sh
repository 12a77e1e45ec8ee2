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
# disable the deadline: such a job hung for ever). generate refuses the options
# only a cluster reads (it would ignore them), and runs with the one-process ones.
# Stops at the first failure.
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
refuse "${G[@]}" -- kv-block 0
refuse "${G[@]}" -- kv-block 4097
refuse "${G[@]}" -- kv-cache-mb -1
expect_rc 11 "generate --kv-dtype q4" "$BIN" "${G[@]}" --kv-dtype q4 --log-level warn
err_has "--kv-dtype 'q4' is not f32, bf16 or f16"
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
  --prefill-chunk 65536 --cache-decay 1 --log-level warn

step "run: the same options, and the cluster ones"
R=(run --model "$M" --prompt-ids 1,2,3)
refuse "${R[@]}" -- threads 100000
refuse "${R[@]}" -- comm-timeout 0
err_has "[0.1, 86400] seconds"
refuse "${R[@]}" -- comm-timeout -5
refuse "${R[@]}" -- comm-timeout 1e9 1e+09
refuse "${R[@]}" -- redundant -1
expect_rc 0 "run at the limits" "$BIN" "${R[@]}" --threads 1 --max-new-tokens 0 --comm-timeout 0.1 --log-level warn

# ---------------------------------------------------------------------------
step "generate: cluster options are refused"
# generate runs in one process (the in-process communicator, every expert on rank
# 0): an option that only shapes a cluster would be ignored there, so it is refused
# before any work (exit 11, invalid argument), named, pointing to colibri run.
# run (one rank here, no mpirun) takes the same options.
"$BIN" generate --model "$M" --prompt-ids 1,2,3,4,5 --max-new-tokens 4 --record-routing "$T/gen.jsonl" --log-level warn >"$T/gen.out"
"$BIN" stats "$T/gen.jsonl" --out "$T/stats.json" --log-level warn >"$T/stats.out"
"$BIN" place --model "$M" --ranks 1 --policy contiguous --out "$T/p1.json" --log-level warn >"$T/place.out"
[ -s "$T/stats.json" ] && [ -s "$T/p1.json" ] || fail "stats or placement not written"
# cluster_refused WHAT ARGS...: generate ARGS exits 11 naming WHAT, writes nothing;
# run ARGS (one rank) exits 0.
cluster_refused() {
  local what=$1
  shift
  rm -f "$T/never.npy"
  expect_rc 11 "generate $*" "$BIN" "${G[@]}" "$@" --dump-logits "$T/never.npy" --log-level warn
  err_has "$what is a cluster option"
  err_has "colibri generate runs in one process"
  err_has "use colibri run"
  [ ! -e "$T/never.npy" ] || fail "generate $*: wrote --dump-logits before refusing"
  [ ! -s "$T/out" ] || fail "generate $*: printed tokens before refusing"
  expect_rc 0 "run $* (one rank)" "$BIN" "${R[@]}" "$@" --log-level warn
}
cluster_refused --placement --placement "$T/p1.json"
cluster_refused --policy --policy round_robin
cluster_refused --policy --policy contiguous
cluster_refused --redundant --redundant 0
cluster_refused --coordinator-experts --coordinator-experts
cluster_refused --stats --stats "$T/stats.json"
cluster_refused --stats --stats "$T/stats.json" --cache-policy lru --expert-cache-experts 2
cluster_refused "--comm auto" --comm auto
cluster_refused --comm-timeout --comm-timeout 30
# A value out of range is still refused as a cluster option, not a range.
expect_rc 11 "generate --comm-timeout 0" "$BIN" "${G[@]}" --comm-timeout 0 --log-level warn
err_has "--comm-timeout is a cluster option"
# --comm mpi/nccl: also refused by generate (run would start MPI: not tried here).
for c in mpi nccl; do
  expect_rc 11 "generate --comm $c" "$BIN" "${G[@]}" --comm $c --log-level warn
  err_has "--comm $c is a cluster option"
done
# Started as one of several ranks by mpirun/srun (their environment, no MPI needed):
# every rank would generate alone.
for v in OMPI_COMM_WORLD_SIZE=3 PMI_SIZE=2 SLURM_STEP_NUM_TASKS=4; do
  expect_rc 11 "$v generate" env "$v" "$BIN" "${G[@]}" --log-level warn
  err_has "colibri generate was started as one of ${v#*=} ranks (${v%%=*})"
  err_has "use colibri run"
done
expect_rc 0 "OMPI_COMM_WORLD_SIZE=1 generate (one rank)" env OMPI_COMM_WORLD_SIZE=1 "$BIN" "${G[@]}" --log-level warn
# What acts in one process keeps working with generate: the expert cache (its
# budget and policy show in the report), --stats for the pinned cache, --comm local.
expect_rc 0 "generate --expert-cache-experts 2 --cache-policy lfu" "$BIN" "${G[@]}" --expert-cache-experts 2 \
  --cache-policy lfu --log-level warn
awk '$1 == "0" && $2 == "lfu" && $4 == "2" { ok = 1 } END { exit !ok }' "$T/out" ||
  fail "generate's report lacks rank 0 with policy lfu and 2 cache slots"
pass "generate: the expert cache is honoured in one process"
expect_rc 0 "generate --cache-policy pinned --stats" "$BIN" "${G[@]}" --expert-cache-experts 2 --cache-policy pinned \
  --stats "$T/stats.json" --log-level warn
awk '$1 == "0" && $2 == "pinned" { ok = 1 } END { exit !ok }' "$T/out" || fail "generate's report lacks the pinned policy"
expect_rc 0 "generate --comm local" "$BIN" "${G[@]}" --comm local --log-level warn
expect_rc 0 "generate --cache-decay 0.5 --cache-policy hybrid --expert-cache-bytes 1M" "$BIN" "${G[@]}" \
  --cache-policy hybrid --cache-decay 0.5 --expert-cache-bytes 1M --log-level warn
# --help says which options generate refuses.
expect_rc 0 "generate --help" "$BIN" generate --help
for o in placement policy redundant coordinator-experts comm-timeout; do
  grep -qE -- "--$o( arg)? +\[colibri run only: generate refuses it\]" "$T/out" ||
    fail "generate --help does not mark --$o as refused"
done
out_has "[generate: with --cache-policy pinned only]"
out_has "[generate: local only]"
expect_rc 0 "run --help" "$BIN" run --help
if grep -qF "generate refuses" "$T/out"; then fail "run --help marks options as refused"; fi
pass "generate --help marks the refused options, run --help does not"

step "bench"
refuse bench --model "$M" -- threads 100000
refuse bench --model "$M" -- batch 0
refuse bench --model "$M" -- batch 65537
refuse bench --model "$M" -- prompt-len 0
refuse bench --model "$M" -- new-tokens 1
refuse bench --model "$M" -- reps 0
refuse bench --model "$M" -- warmup -1
refuse bench --model "$M" -- prefill-chunk 0
expect_rc 11 "bench --kv-dtype int8" "$BIN" bench --model "$M" --kv-dtype int8 --log-level warn
err_has "--kv-dtype 'int8'"
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
