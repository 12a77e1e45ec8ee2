#!/usr/bin/env bash
# SIGINT/SIGTERM: `generate` stops between steps and prints what it has, marked
# partial (exit 128 + signal); a cluster under mpirun stops cleanly the same way
# and leaves no process; an interrupted `convert` leaves neither OUT nor OUT.tmp.
# usage: signal_test.sh COLIBRI
set -uo pipefail
colibri="$1"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_WAIT_POLICY=passive
work="$(mktemp -d)"
trap 'pkill -9 -f "$work/" 2>/dev/null; rm -rf "$work"' EXIT
"$colibri" synth --preset small --seed 5 --out "$work/hf" --log-level warn || exit 1
"$colibri" convert "$work/hf" "$work/m.colibri" --dtype bf16 --log-level warn || exit 1
fail=0
prompts=(--prompt-ids 1,2,3,4,5 --prompt-ids 6,7,8 --prompt-ids 9,10 --prompt-ids 11,12,13,14)

# Waits (at most 60 s) until FILE contains TEXT.
wait_for() {
  for _ in $(seq 1 6000); do grep -q -- "$2" "$1" 2>/dev/null && return 0; sleep 0.01; done
  return 1
}

one_process() {  # signal name, expected exit
  local sig="$1" want="$2" rc
  "$colibri" generate --model "$work/m.colibri" "${prompts[@]}" --max-new-tokens 2000 --ignore-eos \
    --dump-logits "$work/part.npy" --log-level info > "$work/out.txt" 2> "$work/err.txt" &
  local pid=$!
  wait_for "$work/err.txt" "model $work/m.colibri" || { echo "FAIL generate never started"; fail=1; kill -9 $pid; return; }
  sleep 0.3
  kill -"$sig" "$pid"
  wait "$pid"; rc=$?
  if [ "$rc" -ne "$want" ]; then echo "FAIL generate + SIG$sig: exit $rc, expected $want"; cat "$work/err.txt"; fail=1; return; fi
  local n; n=$(grep -c '^sequence [0-9] (partial): ' "$work/out.txt")
  if [ "$n" -ne 4 ] || ! grep -q "interrupted by SIG$sig: the sequences above are partial" "$work/out.txt"; then
    echo "FAIL generate + SIG$sig: partial output not marked"; cat "$work/out.txt"; fail=1; return
  fi
  if ! head -c 6 "$work/part.npy" | grep -q NUMPY || ! grep -q "wrote partial logits" "$work/err.txt"; then
    echo "FAIL generate + SIG$sig: partial logits not written"; fail=1; return
  fi
  echo "ok   generate + SIG$sig: exit $rc, 4 partial sequences, partial logits written"
}
one_process INT 130
one_process TERM 143

# A cluster: Ctrl-C on mpirun reaches every rank; the coordinator finishes its
# step, stops the workers and prints partial output; nothing is left running.
# NOTE: mpirun gives the ranks 1 s between its SIGTERM and its SIGKILL
# (docs/sanitizers.md); about one run in six here the coordinator was killed
# before printing. That timing case is retried (up to 3 attempts, each
# reported); a run that never prints, leaves processes or exits 0 still fails.
cluster_attempt() {
  timeout 120 mpirun --oversubscribe --bind-to none -np 3 "$colibri" run --model "$work/m.colibri" "${prompts[@]}" \
    --max-new-tokens 2000 --ignore-eos --log-level info > "$work/out.txt" 2> "$work/err.txt" &
  local pid=$!
  wait_for "$work/err.txt" "rank(s) over mpi" || echo "warning: cluster start not seen"
  sleep 0.5
  kill -INT "$pid"
  wait "$pid"; rc=$?
  sleep 1
}
for attempt in 1 2 3; do
  cluster_attempt
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && ! grep -q "the sequences above are partial" "$work/out.txt" && \
     ! pgrep -f "$work/m.colibri" > /dev/null && [ "$attempt" -lt 3 ]; then
    echo "note: cluster + SIGINT attempt $attempt: killed before printing (mpirun's 1 s window); retrying"
    continue
  fi
  break
done
if [ "$rc" -eq 0 ] || [ "$rc" -eq 124 ]; then echo "FAIL cluster + SIGINT: exit $rc"; fail=1
elif ! grep -q "(partial)" "$work/out.txt" || ! grep -q "the sequences above are partial" "$work/out.txt"; then
  echo "FAIL cluster + SIGINT: no partial output"; tail -n 5 "$work/out.txt" "$work/err.txt"; fail=1
elif pgrep -f "$work/m.colibri" > /dev/null; then
  echo "FAIL cluster + SIGINT: processes left"; pgrep -af "$work/m.colibri"; fail=1
else
  echo "ok   cluster + SIGINT: exit $rc, $(grep -c '(partial)' "$work/out.txt") partial sequences, no process left (attempt $attempt)"
fi

# An interrupted conversion: neither the final name nor the temporary file remains.
"$colibri" convert "$work/hf" "$work/c.colibri" --dtype f16 --log-level info > /dev/null 2> "$work/err.txt" &
pid=$!
wait_for "$work/err.txt" "convert: " || true
kill -INT "$pid"
wait "$pid"; rc=$?
if [ -e "$work/c.colibri" ] && [ "$rc" -eq 0 ]; then
  echo "note: the conversion finished before the signal arrived; not a failure of the contract, but retry"
  fail=1
elif [ -e "$work/c.colibri" ] || compgen -G "$work/c.colibri.tmp*" >/dev/null; then
  echo "FAIL convert + SIGINT: exit $rc but a file remains: $(ls "$work" | grep c.colibri)"; fail=1
elif [ "$rc" -ne 130 ]; then
  echo "FAIL convert + SIGINT: exit $rc, expected 130"; cat "$work/err.txt"; fail=1
else
  echo "ok   convert + SIGINT: exit 130, $(grep -o 'conversion interrupted[^;]*' "$work/err.txt"), no OUT and no OUT.tmp"
fi
exit $fail
