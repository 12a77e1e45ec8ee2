#!/usr/bin/env bash
# hardening_test.sh: what a careless or hostile user can do to a run, and what
# Colibri must do instead of destroying data, printing garbage, crashing or
# hanging (docs/reliability.md, "Careless use"). Run by ctest as
#   bash tests/hardening_test.sh <path-to-colibri>
# 1. an output never destroys an input or a special file (every command that writes);
#    concurrent converts to one OUT never report success for the other's file;
# 2. non-finite weights are refused by convert, non-finite logits end the run
#    (exit 20) with the tokens so far, --check-numerics names layer and stage;
# 3. a model file truncated or rewritten during a run (one process and a cluster
#    worker) ends it with exit 21, the file named and the tokens so far;
# 4. a FIFO or a directory given as any input file is refused at once (exit 12);
# 7. a stuck worker (SIGSTOP) ends a cluster run after --comm-timeout with the
#    rank named and the tokens so far printed.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/cli_lib.sh"
cli_setup hardening "$@"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_WAIT_POLICY=passive
MPIRUN=(mpirun --oversubscribe --bind-to none --mca mpi_yield_when_idle 1)

sum() { md5sum "$1" | cut -d' ' -f1; }
# unchanged FILE SUM: FILE still has the checksum SUM.
unchanged() { [ "$(sum "$1")" = "$2" ] || fail "$1 was changed"; }
no_temp() { ! compgen -G "$1.tmp*" >/dev/null || fail "$(compgen -G "$1.tmp*" | head -1) was left behind"; }
# A special file to aim outputs at: a character device (/dev/null's numbers) when
# this runs as root, else a FIFO. It must survive every refusal.
SPECIAL="$T/special"
if [ "$(id -u)" -eq 0 ] && mknod "$SPECIAL" c 1 3 2>/dev/null; then is_special() { [ -c "$SPECIAL" ]; }
else mkfifo "$SPECIAL"; is_special() { [ -p "$SPECIAL" ]; }; fi
still_special() { is_special || fail "$SPECIAL was replaced by $(stat -c %F "$SPECIAL")"; }

"$BIN" synth --arch mixtral --preset tiny --seed 5 --out "$T/hf" --log-level warn
"$BIN" convert "$T/hf" "$T/m.colibri" --log-level warn
M="$T/m.colibri"
MSUM=$(sum "$M")
GEN=("$BIN" generate --model "$M" --prompt-ids 1,2,3 --max-new-tokens 4 --log-level warn)

# ---------------------------------------------------------------------------
step "1. outputs never destroy inputs or special files"
S0=$(sum "$T/hf/model.safetensors")
C0=$(sum "$T/hf/config.json")
expect_rc 11 "convert onto its own shard" "$BIN" convert "$T/hf" "$T/hf/model.safetensors"
err_has "is the input"; err_has "$T/hf/model.safetensors"; unchanged "$T/hf/model.safetensors" "$S0"
expect_rc 11 "convert onto its config.json" "$BIN" convert "$T/hf" "$T/hf/config.json"
unchanged "$T/hf/config.json" "$C0"
ln -s "$T/hf/model.safetensors" "$T/link"
expect_rc 11 "convert onto a symlink to its shard" "$BIN" convert "$T/hf" "$T/link"
err_has "$T/link"; unchanged "$T/hf/model.safetensors" "$S0"
ln "$T/hf/model.safetensors" "$T/hardlink"
expect_rc 11 "convert onto a hard link to its shard" "$BIN" convert "$T/hf" "$T/hardlink"
unchanged "$T/hf/model.safetensors" "$S0"
expect_rc 11 "convert onto a special file" "$BIN" convert "$T/hf" "$SPECIAL"
err_has "$SPECIAL"; still_special
for opt in dump-logits record-routing; do
  expect_rc 11 "--$opt onto the model" "${GEN[@]}" --"$opt" "$M"
  err_has "--$opt"; err_has "is the input"; unchanged "$M" "$MSUM"
  expect_rc 11 "--$opt onto a special file" "${GEN[@]}" --"$opt" "$SPECIAL"
  err_has "is a"; still_special
done
expect_rc 11 "--dump-logits and --record-routing onto one file" "${GEN[@]}" --dump-logits "$T/x" --record-routing "$T/x"
[ ! -e "$T/x" ] || fail "$T/x was written"
printf 'hello' > "$T/prompt.txt"
expect_rc 11 "--dump-logits onto the --prompt-file" "$BIN" generate --model "$M" --prompt-file "$T/prompt.txt" \
  --dump-logits "$T/prompt.txt" --log-level warn
[ "$(cat "$T/prompt.txt")" = hello ] || fail "the prompt file was changed"
expect_rc 0 "--record-routing to a new file" "${GEN[@]}" --record-routing "$T/trace.jsonl" --dump-logits "$T/l.npy"
no_temp "$T/trace.jsonl"; no_temp "$T/l.npy"
TSUM=$(sum "$T/trace.jsonl")
expect_rc 11 "stats --out onto its trace" "$BIN" stats "$T/trace.jsonl" --out "$T/trace.jsonl"
unchanged "$T/trace.jsonl" "$TSUM"
expect_rc 11 "stats --out onto a special file" "$BIN" stats "$T/trace.jsonl" --out "$SPECIAL"
still_special
expect_rc 0 "stats --out to a new file" "$BIN" stats "$T/trace.jsonl" --out "$T/stats.json"
SSUM=$(sum "$T/stats.json")
PLACE=("$BIN" place --model "$M" --ranks 3 --policy balanced --stats "$T/stats.json")
expect_rc 11 "place --out onto its --stats" "${PLACE[@]}" --out "$T/stats.json"
unchanged "$T/stats.json" "$SSUM"
expect_rc 11 "place --out onto the model" "${PLACE[@]}" --out "$M"
unchanged "$M" "$MSUM"
expect_rc 11 "place --out onto a special file" "${PLACE[@]}" --out "$SPECIAL"
still_special
BENCH=("$BIN" bench --model "$M" --batch 1 --prompt-len 4 --new-tokens 2 --reps 1 --log-level warn)
expect_rc 11 "bench --csv onto the model" "${BENCH[@]}" --csv "$M"
unchanged "$M" "$MSUM"
expect_rc 11 "bench --csv onto a special file" "${BENCH[@]}" --csv "$SPECIAL"
still_special
mkdir "$T/sdir"
ln -s "$SPECIAL" "$T/sdir/config.json"
expect_rc 11 "synth into a folder whose config.json is a special file" "$BIN" synth --preset tiny --out "$T/sdir"
still_special; [ ! -e "$T/sdir/model.safetensors" ] || fail "synth wrote a shard after refusing"
expect_rc 11 "synth --out a special file" "$BIN" synth --preset tiny --out "$SPECIAL"
still_special

# Two converts of one checkpoint to one OUT at once, in different dtypes: each
# writes its own temporary; OUT is always one of the two complete files.
"$BIN" convert "$T/hf" "$T/ref32.colibri" --log-level warn
"$BIN" convert "$T/hf" "$T/ref16.colibri" --dtype bf16 --log-level warn
R32=$(sum "$T/ref32.colibri")
R16=$(sum "$T/ref16.colibri")
for round in 1 2 3 4 5; do
  "$BIN" convert "$T/hf" "$T/race.colibri" --log-level warn & a=$!
  "$BIN" convert "$T/hf" "$T/race.colibri" --dtype bf16 --log-level warn & b=$!
  wait $a || fail "round $round: the f32 convert failed"
  wait $b || fail "round $round: the bf16 convert failed"
  got=$(sum "$T/race.colibri")
  [ "$got" = "$R32" ] || [ "$got" = "$R16" ] || fail "round $round: OUT is neither conversion (mixed writes)"
  no_temp "$T/race.colibri"
done
pass "5 rounds of two concurrent converts to one OUT: OUT is always one whole conversion, no temporary left"

# ---------------------------------------------------------------------------
step "2. non-finite numbers are an error, never tokens"
# data_offset NAME FILE: where tensor NAME's bytes start in a safetensors file.
data_offset() {
  local n begin
  n=$(od -An -tu8 -N8 "$2" | tr -d ' ')
  begin=$(head -c $((8 + n)) "$2" | tail -c "$n" | grep -o "\"$1\":{\"data_offsets\":\[[0-9]*" | grep -o '[0-9]*$')
  [ -n "$begin" ] || fail "no tensor $1 in $2"
  echo $((8 + n + begin))
}
# poke FILE OFFSET HEX4: overwrites 4 bytes (little-endian f32 bits given as 8 hex digits).
poke() {
  local h=$3
  printf "\\x${h:6:2}\\x${h:4:2}\\x${h:2:2}\\x${h:0:2}" | dd of="$1" bs=1 seek="$2" conv=notrunc status=none
}
cp -r "$T/hf" "$T/nan"
Q=$(data_offset model.layers.0.self_attn.q_proj.weight "$T/nan/model.safetensors")
poke "$T/nan/model.safetensors" $((Q + 4 * 130)) 7fc00000
expect_rc 20 "convert refuses a NaN weight" "$BIN" convert "$T/nan" "$T/nan.colibri"
err_has "attn_q"; err_has "element 130"; err_has "--allow-non-finite"
[ ! -e "$T/nan.colibri" ] || fail "a refused conversion wrote OUT"; no_temp "$T/nan.colibri"
cp -r "$T/hf" "$T/inf"
X=$(data_offset model.layers.1.block_sparse_moe.experts.2.w2.weight "$T/inf/model.safetensors")
poke "$T/inf/model.safetensors" $((X + 4 * 7)) ff800000
expect_rc 20 "convert refuses an infinite expert weight" "$BIN" convert "$T/inf" "$T/inf.colibri"
err_has "layer 1 expert 2 down"
cp -r "$T/hf" "$T/big"
poke "$T/big/model.safetensors" $((Q + 4 * 5)) 7149f2ca  # 1e30: finite in f32, infinite in f16
expect_rc 0 "a weight of 1e30 converts to f32" "$BIN" convert "$T/big" "$T/big32.colibri" --log-level warn
expect_rc 20 "the same weight overflows f16 storage" "$BIN" convert "$T/big" "$T/big16.colibri" --dtype f16
err_has "in f16 storage"
expect_rc 0 "--allow-non-finite converts it anyway" "$BIN" convert "$T/nan" "$T/nan.colibri" --allow-non-finite --log-level warn
expect_rc 20 "generate on NaN weights" "$BIN" generate --model "$T/nan.colibri" --prompt-ids 1,2,3 -n 4
out_has "(partial)"; out_has "numerical failure"; err_has "prefill pass 0"; err_has "not finite"
expect_rc 20 "--check-numerics names the first layer and stage" "$BIN" generate --model "$T/nan.colibri" \
  --prompt-ids 1,2,3 -n 4 --check-numerics
err_has "attention output of layer 0"
expect_rc 20 "the same under mpirun -np 2 (rank 0 reports, the job ends)" "${MPIRUN[@]}" -np 2 "$BIN" run \
  --model "$T/nan.colibri" --prompt-ids 1,2,3 -n 4 --log-level warn
out_has "(partial)"
# A config inside the accepted ranges that overflows: a tiny rope_theta.
cp -r "$T/hf" "$T/rope"
sed -i 's/"rope_theta": [0-9.e+]*/"rope_theta": 1e-300/' "$T/rope/config.json"
grep -q '"rope_theta": 1e-300' "$T/rope/config.json" || fail "could not set rope_theta"
"$BIN" convert "$T/rope" "$T/rope.colibri" --log-level warn
expect_rc 20 "a rope_theta of 1e-300" "$BIN" generate --model "$T/rope.colibri" --prompt-ids 1,2,3 -n 4
err_has "rotary tables are not finite"; err_has "rope_theta 1e-300"
# ... and a huge routed_scaling_factor (DeepSeek-V3).
"$BIN" synth --arch deepseek_v3 --preset tiny --seed 5 --out "$T/ds" --log-level warn
# The residual stream overflows the final RMSNorm's f32 sum of squares: its
# output (as in transformers) is zeros and so every logit is equal: an error too.
sed -i 's/"routed_scaling_factor": [0-9.e+]*/"routed_scaling_factor": 1e30/' "$T/ds/config.json"
grep -q '"routed_scaling_factor": 1e30' "$T/ds/config.json" || fail "could not set routed_scaling_factor"
"$BIN" convert "$T/ds" "$T/ds.colibri" --log-level warn
expect_rc 20 "a routed_scaling_factor of 1e30" "$BIN" generate --model "$T/ds.colibri" --prompt-ids 1,2,3 -n 4
err_has "are all equal"; out_has "(partial)"
expect_rc 20 "--check-numerics names the layer whose output overflows" "$BIN" generate --model "$T/ds.colibri" \
  --prompt-ids 1,2,3 -n 4 --check-numerics
err_has "residual stream after the feed-forward of layer 1"; err_has "overflows the next RMSNorm"

# ---------------------------------------------------------------------------
step "3. a model file changed while in use"
"$BIN" synth --arch mixtral --preset small --seed 5 --out "$T/hfs" --log-level warn
"$BIN" convert "$T/hfs" "$T/s.colibri" --log-level warn
rm -rf "$T/hfs"
LONG=(--prompt-ids 1,2,3 --max-new-tokens 1200 --ignore-eos)
"$BIN" generate --model "$T/s.colibri" "${LONG[@]}" --log-level warn > "$T/ref.txt"
REF=$(sed -n 's/^sequence 0: //p' "$T/ref.txt")
[ -n "$REF" ] || fail "no reference tokens"
# during_run ACTION CMD...: runs CMD in the background, does ACTION once it has
# started generating (its "model ..." line), and waits; RC, $T/out, $T/err as run.
during_run() {
  local action=$1
  shift
  rm -f "$T/out" "$T/err"
  : > "$T/err"
  ( set +e; "$@" > "$T/out" 2> "$T/err"; echo $? > "$T/rc" ) &
  local pid=$! i
  for i in $(seq 1 600); do grep -q 'model .*layers' "$T/err" && break; sleep 0.05; done
  sleep 0.2
  eval "$action"
  wait $pid
  RC=$(cat "$T/rc")
}
# is_prefix: the partial tokens printed are a prefix of the reference run's.
is_prefix() {
  local got
  got=$(sed -n 's/^sequence 0 (partial): //p' "$T/out")
  [ -n "$got" ] || fail "no partial tokens printed"
  case "$REF" in "$got"*) ;; *) fail "the partial tokens are not a prefix of the full run's" ;; esac
  [ "$got" != "$REF" ] || fail "the run finished before the file changed (make it longer)"
}
cp "$T/s.colibri" "$T/s1.colibri"
during_run 'truncate -s 100000000 "$T/s1.colibri"' "$BIN" generate --model "$T/s1.colibri" "${LONG[@]}" \
  --dump-logits "$T/part.npy"
[ "$RC" -eq 21 ] || fail "truncated during a run: exit $RC, expected 21"
err_has "s1.colibri"; err_has "changed while in use"; out_has "(partial)"; is_prefix
# The logits so far: [1, prompt + tokens - 1, vocab] (the tokens printed, the prompt of 3).
NTOK=$(sed -n 's/^sequence 0 (partial): //p' "$T/out" | tr ',' '\n' | wc -l)
head -c 128 "$T/part.npy" | grep -aq "'shape': (1, $((NTOK + 2)), " || fail "the partial logits were not written with $((NTOK + 2)) positions"
pass "truncated during a run: exit 21, the file named, the tokens so far printed (a prefix of the full run) and their logits written"
cp "$T/s.colibri" "$T/s2.colibri"
during_run 'dd if="$T/s.colibri" of="$T/s2.colibri" bs=4096 count=1 conv=notrunc status=none' \
  "$BIN" generate --model "$T/s2.colibri" "${LONG[@]}"
[ "$RC" -eq 21 ] || fail "rewritten in place during a run: exit $RC, expected 21"
err_has "written in place"; is_prefix
pass "rewritten in place (same bytes) during a run: exit 21, the tokens so far printed"
cp "$T/s.colibri" "$T/s3.colibri"
during_run 'truncate -s 100000000 "$T/s3.colibri"' timeout 120 "${MPIRUN[@]}" -np 2 "$BIN" run \
  --model "$T/s3.colibri" "${LONG[@]}"
[ "$RC" -eq 21 ] || fail "truncated during a cluster run: exit $RC, expected 21"
err_has "s3.colibri"; err_has "changed while in use"; out_has "(partial)"; is_prefix
sleep 1
! pgrep -f "$T/s3.colibri" >/dev/null || fail "processes left behind"
pass "truncated during a 2-rank run (the worker's experts read past the end): exit 21, the tokens so far printed"

# ---------------------------------------------------------------------------
step "4. inputs that are not regular files are refused at once"
mkfifo "$T/fifo"
mkdir "$T/adir"
for bad in fifo adir; do
  P="$T/$bad"
  what=$([ $bad = fifo ] && echo FIFO || echo directory)
  check() {  # WHAT CMD...
    local w=$1
    shift
    run timeout 20 "$@"
    [ "$RC" -ne 124 ] || fail "$w with a $what: hung"
    [ "$RC" -eq 12 ] || fail "$w with a $what: exit $RC, expected 12"
    err_has "$what"
    pass "$w: a $what is refused (exit 12)"
  }
  check "inspect" "$BIN" inspect "$P"
  check "generate --model" "$BIN" generate --model "$P" --prompt-ids 1
  check "bench --model" "$BIN" bench --model "$P"
  # (run: generate refuses these cluster options before reading them, exit 11)
  check "run --placement" "$BIN" run --model "$M" --prompt-ids 1,2,3 --max-new-tokens 4 --log-level warn --placement "$P"
  check "run --stats" "$BIN" run --model "$M" --prompt-ids 1,2,3 --max-new-tokens 4 --log-level warn --stats "$P"
  check "generate --stats (pinned cache)" "${GEN[@]}" --cache-policy pinned --stats "$P"
  check "generate --routing-replay" "${GEN[@]}" --routing-replay "$P"
  check "generate --prompt-file" "$BIN" generate --model "$M" --prompt-file "$P"
  check "stats TRACE" "$BIN" stats "$P"
  check "place --stats" "$BIN" place --model "$M" --ranks 2 --policy balanced --stats "$P"
  check "simulate --cluster" "$BIN" simulate --cluster "$P" --model "$M" --batch 1
  for f in config.json model.safetensors; do
    rm -rf "$T/hfx"
    cp -r "$T/hf" "$T/hfx"
    rm "$T/hfx/$f"
    if [ $bad = fifo ]; then mkfifo "$T/hfx/$f"; else mkdir "$T/hfx/$f"; fi
    check "convert with $f" "$BIN" convert "$T/hfx" "$T/x.colibri"
  done
done

# ---------------------------------------------------------------------------
step "7. a stuck worker: the coordinator names it and keeps what it generated"
cp "$T/s.colibri" "$T/s4.colibri"
# stop_worker: SIGSTOP the rank-1 process of the run on s4.colibri.
stop_worker() {
  local p
  for p in $(pgrep -f "run --model $T/s4.colibri"); do
    if tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx 'OMPI_COMM_WORLD_RANK=1'; then
      kill -STOP "$p"
      STOPPED=$p
    fi
  done
}
STOPPED=
during_run stop_worker timeout 120 "${MPIRUN[@]}" -np 2 "$BIN" run --model "$T/s4.colibri" "${LONG[@]}" --comm-timeout 3
[ -n "$STOPPED" ] || fail "found no worker process to stop"
kill -CONT "$STOPPED" 2>/dev/null || true
[ "$RC" -eq 17 ] || fail "stuck worker: exit $RC, expected 17"
err_has "rank(s) 1"; out_has "(partial)"; out_has "communication"; is_prefix
sleep 1
if pgrep -f "$T/s4.colibri" >/dev/null; then pkill -9 -f "$T/s4.colibri"; fail "processes left behind"; fi
pass "stuck worker: exit 17 after --comm-timeout, rank 1 named, the tokens so far printed"

echo "hardening: $CHECKS checks passed"
