#!/usr/bin/env bash
# Lost ranks: a worker killed (SIGKILL) at start-up, during prefill and during
# decode, and the coordinator killed during decode; the job must end non-zero within a bounded time, name the lost rank,
# and leave no process behind. A coordinator-side error (bad token id) must end
# every rank too.
# usage: mpi_fault_test.sh COLIBRI
set -uo pipefail
colibri="$1"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_WAIT_POLICY=passive
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$colibri" synth --preset tiny --seed 3 --out "$work/hf" --log-level warn || exit 1
"$colibri" convert "$work/hf" "$work/m.colibri" --log-level warn || exit 1
fail=0
mpirun_base=(mpirun --oversubscribe --bind-to none --mca mpi_yield_when_idle 1)

expect_lost() {  # name, fault ("RANK:kill:N" or "RANK:kill:start"), the rank that dies
  local name="$1" fault="$2" lost="$3" start end rc
  start=$(date +%s)
  timeout 120 "${mpirun_base[@]}" -np 3 "$colibri" run --model "$work/m.colibri" --prompt-ids 1,2,3,4,5,6 \
    --prompt-ids 7,8 --max-new-tokens 16 --ignore-eos --prefill-chunk 4 --inject-fault "$fault" \
    --log-level warn > "$work/out.txt" 2>&1
  rc=$?
  end=$(date +%s)
  if [ "$rc" -eq 0 ]; then echo "FAIL $name: the job exited 0"; fail=1; return; fi
  if [ "$rc" -eq 124 ]; then echo "FAIL $name: the job hung (killed by timeout after 120 s)"; fail=1; return; fi
  if ! grep -Eq "process rank $lost " "$work/out.txt"; then
    echo "FAIL $name: no message names rank $lost:"; tail -20 "$work/out.txt"; fail=1; return
  fi
  sleep 1
  if pgrep -f "$work/m.colibri" > /dev/null; then
    echo "FAIL $name: processes left behind:"; pgrep -af "$work/m.colibri"; pkill -9 -f "$work/m.colibri"; fail=1; return
  fi
  echo "ok   $name: exit $rc after $((end - start)) s; $(grep -Eo "process rank $lost [^.]*" "$work/out.txt" | head -1)"
}

expect_lost "worker killed at start-up" 1:kill:start 1
expect_lost "worker killed during prefill" 1:kill:0 1
expect_lost "worker killed during decode" 2:kill:5 2
expect_lost "coordinator killed during decode" 0:kill:6 0

# A bad request on the coordinator ends the workers as well.
timeout 120 "${mpirun_base[@]}" -np 3 "$colibri" run --model "$work/m.colibri" --prompt-ids 1,2,99999 \
  --log-level warn > "$work/out.txt" 2>&1
rc=$?
if [ "$rc" -eq 0 ] || [ "$rc" -eq 124 ] || ! grep -q "99999" "$work/out.txt"; then
  echo "FAIL bad token id under mpirun: exit $rc"; tail -10 "$work/out.txt"; fail=1
else
  echo "ok   bad token id under mpirun: exit $rc, $(grep -o 'token id 99999[^;]*' "$work/out.txt" | head -1)"
fi
sleep 1
if pgrep -f "$work/m.colibri" > /dev/null; then echo "FAIL processes left behind"; pkill -9 -f "$work/m.colibri"; fail=1; fi
exit $fail
