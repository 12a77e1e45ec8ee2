#!/usr/bin/env bash
# A lost worker: rank 1 is killed (SIGKILL) during prefill and again during
# decode; the job must end non-zero within a bounded time, name the lost rank,
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

expect_lost() {  # name, forward pass at which rank 1 dies
  local name="$1" pass="$2" start end rc
  start=$(date +%s)
  timeout 120 "${mpirun_base[@]}" -np 3 "$colibri" run --model "$work/m.colibri" --prompt-ids 1,2,3,4,5,6 \
    --prompt-ids 7,8 --max-new-tokens 16 --ignore-eos --prefill-chunk 4 --inject-fault "1:kill:$pass" \
    --log-level warn > "$work/out.txt" 2>&1
  rc=$?
  end=$(date +%s)
  if [ "$rc" -eq 0 ]; then echo "FAIL $name: the job exited 0"; fail=1; return; fi
  if [ "$rc" -eq 124 ]; then echo "FAIL $name: the job hung (killed by timeout after 120 s)"; fail=1; return; fi
  if ! grep -Eq "rank 1|process rank 1" "$work/out.txt"; then
    echo "FAIL $name: no message names rank 1:"; tail -20 "$work/out.txt"; fail=1; return
  fi
  sleep 1
  if pgrep -f "$work/m.colibri" > /dev/null; then
    echo "FAIL $name: processes left behind:"; pgrep -af "$work/m.colibri"; pkill -9 -f "$work/m.colibri"; fail=1; return
  fi
  echo "ok   $name: exit $rc after $((end - start)) s; $(grep -Eo '(process )?rank 1[^.]*' "$work/out.txt" | head -1)"
}

expect_lost "worker killed during prefill" 0
expect_lost "worker killed during decode" 5

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
