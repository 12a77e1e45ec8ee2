#!/usr/bin/env bash
# slurm_test.sh: runs the scripts/slurm templates on a real SLURM made for this
# one machine. Run by ctest as
#   bash tests/slurm_test.sh <path-to-colibri>
# Installs Debian's slurm-wlm and munge when missing (apt-get, as root; their
# services are kept from starting), writes a slurm.conf and a munge key under a
# temporary directory, starts munged, slurmctld and slurmd as root on private
# ports and a private munge socket (no system configuration is used or changed),
# waits for the node to be idle, submits the jobs with sbatch (2 tasks each),
# waits for them, checks their output, and always stops the daemons and every
# process they started. The jobs: the one-node
# template plain, with LAUNCH_ARGS=--ucx and with LAUNCH_ARGS="--launcher mpirun",
# the multi-node template on this one node with STAGE_DIR (sbcast), and the
# requeueable colibri-batch.sbatch (colibri batch over two JSONL requests); each must
# give the tokens of a one-process `colibri generate` of the same prompts.
#
# Exit status: 0 pass, 1 fail, 77 skip (not root, or slurm cannot be installed).
# Environment:
#   COLIBRI_SLURM_TEST_CMD   the subcommand the job runs: run or generate (default:
#                            run when `colibri run --help` works, else generate)
#   COLIBRI_SLURM_KEEP=1     keep the temporary directory (logs, job output)
set -uo pipefail

SKIP=77
say() { echo "== $*"; }
skip() { echo "SKIP: $*"; exit "$SKIP"; }

if [ $# -ne 1 ]; then
  echo "usage: $0 <path-to-colibri>" >&2
  exit 2
fi
BIN=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
[ -x "$BIN" ] || { echo "FAIL: $1 is not an executable" >&2; exit 1; }
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TEMPLATE=${COLIBRI_SLURM_TEMPLATE:-$HERE/../scripts/slurm/colibri-1node.sbatch}
[ -f "$TEMPLATE" ] || { echo "FAIL: no template $TEMPLATE" >&2; exit 1; }
START=$SECONDS

[ "$(id -u)" -eq 0 ] || skip "needs root (starts slurmctld, slurmd and munged as root)"

# Nothing of an enclosing SLURM job (if ctest runs inside one) may leak into ours.
for v in $(compgen -e | grep '^SLURM_' || true); do unset "$v"; done

T=$(mktemp -d "${TMPDIR:-/tmp}/colibri-slurm.XXXXXX")
chmod 755 "$T"
JOBID=""
POLICY_RC_ADDED=0
declare -A PIDS=()

# Every process this test starts carries this marker in its environment (the
# daemons, the processes they fork, the job), so cleanup finds them all by id.
export COLIBRI_SLURM_TEST_MARK="$T"

print_logs() {
  local f n
  for n in munged slurmctld slurmd; do # a daemon's log file, else what it printed
    f=$T/log/$n.log
    [ "$n" = munged ] && f=$T/munge/munged.log
    [ -s "$f" ] || f=$T/log/$n.out
    [ -s "$f" ] && { echo "--- $f (last 25 lines)"; tail -n 25 "$f"; }
  done
  for f in "$T"/log/sbatch.err "$T"/job-*.out; do
    [ -s "$f" ] && { echo "--- $f (last 40 lines)"; tail -n 40 "$f"; }
  done
}

# ours PID: true when the process carries our marker or our SLURM_CONF in its
# environment (slurmstepd gets SLURM_CONF from slurmd, not the marker) and is not
# this shell or one of its subshells. Pure bash: no process per look.
ours() {
  local p=$1 env e stat i found=0
  { mapfile -d '' env <"/proc/$p/environ"; } 2>/dev/null || return 1
  for e in "${env[@]}"; do
    [[ "$e" == "COLIBRI_SLURM_TEST_MARK=$T" || "$e" == "SLURM_CONF=$T/slurm.conf" ]] && found=1 && break
  done
  [ "$found" = 1 ] || return 1
  for ((i = 0; i < 8 && p > 1; i++)); do # skip this shell and its own subshells
    [ "$p" = "$$" ] && return 1
    { read -r stat <"/proc/$p/stat"; } 2>/dev/null || return 1
    stat=${stat##*) }
    read -r _ p _ <<<"$stat"
  done
  return 0
}
# our_processes: the ids of our processes.
our_processes() {
  local d
  for d in /proc/[0-9]*; do ours "${d#/proc/}" && echo "${d#/proc/}"; done
}
# our_stepds: the ids of the slurmstepd processes of our slurmd.
our_stepds() {
  local p cmd
  for p in $(our_processes); do
    { mapfile -d '' cmd <"/proc/$p/cmdline"; } 2>/dev/null || continue
    [[ "${cmd[0]:-}" == slurmstepd* ]] && echo "$p"
  done
}

cleanup() {
  local rc=$? p n i
  set +e
  trap - EXIT INT TERM
  if [ -n "$JOBID" ] && [ -n "${PIDS[slurmctld]:-}" ]; then
    # shellcheck disable=SC2086  # JOBID: the ids, space-separated
    scancel $JOBID 2>/dev/null
    for ((i = 0; i < 20; i++)); do
      [ -z "$(squeue -h 2>/dev/null)" ] && break
      sleep 0.5
    done
  fi
  # A finished job's slurmstepd lingers a second or two to report to slurmd:
  # let it end before slurmd goes.
  if [ -n "${PIDS[slurmd]:-}" ]; then
    for ((i = 0; i < 40; i++)); do
      [ -z "$(our_stepds)" ] && break
      sleep 0.25
    done
  fi
  for n in slurmd slurmctld munged; do
    p=${PIDS[$n]:-}
    [ -n "$p" ] && kill -TERM "$p" 2>/dev/null
  done
  for n in slurmd slurmctld munged; do
    p=${PIDS[$n]:-}
    [ -z "$p" ] && continue
    for ((i = 0; i < 50; i++)); do
      kill -0 "$p" 2>/dev/null || break
      sleep 0.2
    done
    kill -KILL "$p" 2>/dev/null
    wait "$p" 2>/dev/null
  done
  # Whatever is left of ours (slurmstepd, job steps, slurmscriptd): by id.
  local left
  left=$(our_processes)
  left=${left//$'\n'/ }
  if [ -n "${left// /}" ]; then
    echo "cleanup: killing leftover processes $left"
    # shellcheck disable=SC2086
    kill -KILL $left 2>/dev/null
  fi
  [ "$POLICY_RC_ADDED" = 1 ] && rm -f /usr/sbin/policy-rc.d
  if [ "$rc" -ne 0 ] && [ "$rc" -ne "$SKIP" ]; then print_logs; fi
  if [ "${COLIBRI_SLURM_KEEP:-0}" = 1 ]; then echo "kept $T"; else rm -rf "$T"; fi
  echo "slurm test: $((SECONDS - START)) s"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

# --- 1. slurm and munge, installed if missing ---------------------------------
need_install=0
for c in slurmctld slurmd sbatch sinfo squeue scontrol scancel munged mungekey; do
  command -v "$c" >/dev/null 2>&1 || need_install=1
done
if [ "$need_install" = 1 ]; then
  command -v apt-get >/dev/null 2>&1 || skip "slurm-wlm/munge missing and no apt-get to install them"
  say "installing slurm-wlm and munge (apt-get)"
  t0=$SECONDS
  # Keep the packages from starting their system services (munged, slurmctld) on
  # install: the test runs its own daemons and must leave nothing behind.
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && POLICY_RC_ADDED=1
  fi
  export DEBIAN_FRONTEND=noninteractive
  inst() { apt-get install -y -q --no-install-recommends slurm-wlm munge >>"$T/apt.log" 2>&1; }
  if ! inst; then
    if ! { apt-get update -q >>"$T/apt.log" 2>&1 && inst; }; then
      tail -n 15 "$T/apt.log"
      skip "apt-get install slurm-wlm munge failed (see above)"
    fi
  fi
  if [ "$POLICY_RC_ADDED" = 1 ]; then rm -f /usr/sbin/policy-rc.d; POLICY_RC_ADDED=0; fi
  echo "   installed in $((SECONDS - t0)) s"
  for c in slurmctld slurmd sbatch munged mungekey; do
    command -v "$c" >/dev/null 2>&1 || skip "$c still missing after installing slurm-wlm and munge"
  done
fi
echo "   $(slurmd -V 2>&1 | head -n 1), $(munged --version 2>&1 | head -n 1 | awk '{print $1}')"

# --- 2. the model --------------------------------------------------------------
say "model: colibri synth --preset tiny + convert"
"$BIN" synth --preset tiny --out "$T/hf" >"$T/synth.log" 2>&1 || { cat "$T/synth.log"; fail "colibri synth failed"; }
"$BIN" convert "$T/hf" "$T/tiny.colibri" >>"$T/synth.log" 2>&1 || { cat "$T/synth.log"; fail "colibri convert failed"; }

if [ -n "${COLIBRI_SLURM_TEST_CMD:-}" ]; then
  CMD=$COLIBRI_SLURM_TEST_CMD
  echo "   subcommand: $CMD (COLIBRI_SLURM_TEST_CMD)"
elif "$BIN" run --help >/dev/null 2>&1; then
  CMD=run
  echo "   subcommand: run"
else
  CMD=generate
  echo "   subcommand: generate (colibri run is not available in this build)"
fi

# --- 3. munge ------------------------------------------------------------------
say "munged on a private socket"
mkdir -m 700 "$T/munge"
mkdir -m 755 "$T/run" # munged wants the socket's directory readable by all
mkdir -p "$T/log" "$T/state" "$T/spool"
mungekey -c -b 1024 -k "$T/munge/munge.key" || fail "mungekey could not create a key"
SOCK=$T/run/munge.socket
munged -F --socket="$SOCK" --key-file="$T/munge/munge.key" --pid-file="$T/run/munged.pid" \
  --log-file="$T/munge/munged.log" --seed-file="$T/munge/munged.seed" >"$T/log/munged.out" 2>&1 &
PIDS[munged]=$!
for ((i = 0; i < 50; i++)); do
  [ -S "$SOCK" ] && break
  kill -0 "${PIDS[munged]}" 2>/dev/null || fail "munged exited: $(cat "$T/log/munged.out")"
  sleep 0.1
done
munge -S "$SOCK" -n </dev/null | unmunge -S "$SOCK" >/dev/null 2>&1 || fail "munge round trip through $SOCK failed"

# --- 4. slurm.conf for this machine ------------------------------------------------
H=$(hostname -s 2>/dev/null || hostname)
free_port() { # a TCP port nothing listens on, from a random start
  local p=$1
  while (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; do p=$((p + 2)); done
  echo "$p"
}
BASE=$((20000 + RANDOM % 20000))
CTLD_PORT=$(free_port "$BASE")
SLURMD_PORT=$(free_port $((CTLD_PORT + 1)))
# The node as slurmd sees it (CPUs, sockets, cores, threads, memory); memory a
# little under it so the node never drains for "low RealMemory".
HW=$(slurmd -C 2>/dev/null | head -n 1)
hw() { echo "$HW" | tr ' ' '\n' | sed -n "s/^$1=//p"; }
CPUS=$(hw CPUs)
[ -n "$CPUS" ] || fail "slurmd -C did not describe this machine: '$HW'"
MEM=$(($(hw RealMemory) * 9 / 10))
[ "$MEM" -ge 1 ] || MEM=1
NODE="NodeName=$H NodeAddr=127.0.0.1 CPUs=$CPUS"
for k in Boards SocketsPerBoard CoresPerSocket ThreadsPerCore; do
  v=$(hw "$k")
  [ -n "$v" ] && NODE="$NODE $k=$v"
done
export SLURM_CONF=$T/slurm.conf
cat >"$SLURM_CONF" <<EOF
# Written by tests/slurm_test.sh: one node, everything under $T.
ClusterName=colibritest
SlurmctldHost=$H(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SOCK
StateSaveLocation=$T/state
SlurmdSpoolDir=$T/spool
SlurmctldPidFile=$T/run/slurmctld.pid
SlurmdPidFile=$T/run/slurmd.pid
SlurmctldLogFile=$T/log/slurmctld.log
SlurmdLogFile=$T/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
InactiveLimit=0
MinJobAge=300
KillWait=5
$NODE RealMemory=$MEM State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF

# --- 5. slurmctld and slurmd -------------------------------------------------------
say "slurmctld (port $CTLD_PORT) and slurmd (port $SLURMD_PORT) for node $H ($CPUS CPUs)"
slurmctld -D -f "$SLURM_CONF" >"$T/log/slurmctld.out" 2>&1 &
PIDS[slurmctld]=$!
slurmd -D -f "$SLURM_CONF" -N "$H" >"$T/log/slurmd.out" 2>&1 &
PIDS[slurmd]=$!
state=""
for ((i = 0; i < 120; i++)); do # 60 s
  state=$(sinfo -h -N -n "$H" -o %t 2>/dev/null)
  [ "$state" = idle ] && break
  kill -0 "${PIDS[slurmctld]}" 2>/dev/null || fail "slurmctld exited"
  kill -0 "${PIDS[slurmd]}" 2>/dev/null || fail "slurmd exited"
  sleep 0.5
done
[ "$state" = idle ] || fail "node $H is not idle after 60 s (sinfo state: '${state:-no answer}')"
echo "   node $H idle after $((i / 2)) s"

# --- 6. the jobs -----------------------------------------------------------------------
# The reference: the same prompts in one process, without SLURM or MPI.
# shellcheck disable=SC2054  # the commas are in token-id lists
PROMPT_ARGS=(--prompt-ids 1,2,3 --prompt-ids 4,5 --max-new-tokens 4 --ignore-eos)
"$BIN" generate --model "$T/tiny.colibri" "${PROMPT_ARGS[@]}" >"$T/reference.out" 2>"$T/reference.err" ||
  { cat "$T/reference.err"; fail "colibri generate (the reference) failed"; }
REF=$(grep '^sequence ' "$T/reference.out")
[ -n "$REF" ] || fail "the reference run printed no 'sequence' lines"

OVERCOMMIT=()
[ "$CPUS" -lt 2 ] && OVERCOMMIT=(--overcommit)
MULTI=$(dirname "$TEMPLATE")/colibri-multinode.sbatch
JOBIDS=()
declare -A JOBWHAT=()
# submit WHAT TEMPLATE [VAR=VALUE...]: sbatch the template with 2 tasks on our node.
submit() {
  local what=$1 tpl=$2 id
  shift 2
  id=$(env COLIBRI_BIN="$BIN" MODEL="$T/tiny.colibri" PROMPTS="1,2,3 4,5" MAX_NEW_TOKENS=4 COLIBRI_CMD="$CMD" \
    EXTRA_ARGS="--ignore-eos" "$@" \
    sbatch --parsable --chdir="$T" --output="$T/job-%j.out" --nodes=1 --ntasks-per-node=2 --cpus-per-task=1 \
    --gpus-per-node=0 --time=5 "${OVERCOMMIT[@]}" "$tpl" 2>"$T/log/sbatch.err")
  id=${id%%;*}
  [ -n "$id" ] || fail "sbatch $(basename "$tpl") failed: $(cat "$T/log/sbatch.err")"
  JOBIDS+=("$id")
  JOBWHAT[$id]=$what
  echo "   job $id: $what"
}
say "sbatch: the jobs of 2 tasks running colibri $CMD (and colibri batch)"
submit "$(basename "$TEMPLATE")" "$TEMPLATE"
submit "$(basename "$TEMPLATE") with LAUNCH_ARGS=--ucx" "$TEMPLATE" LAUNCH_ARGS=--ucx
submit "$(basename "$TEMPLATE") with LAUNCH_ARGS='--launcher mpirun'" "$TEMPLATE" LAUNCH_ARGS="--launcher mpirun"
if [ -f "$MULTI" ]; then submit "$(basename "$MULTI") on 1 node with STAGE_DIR" "$MULTI" STAGE_DIR="$T/stage"; fi
# colibri-batch.sbatch: the same two prompts as OpenAI Batch API lines (docs/batch.md).
BATCH_TPL=$(dirname "$TEMPLATE")/colibri-batch.sbatch
if [ -f "$BATCH_TPL" ]; then
  for p in "a 1,2,3" "b 4,5"; do
    # shellcheck disable=SC2086  # p is "custom_id ids"
    printf '{"custom_id": "%s", "method": "POST", "url": "/v1/completions", "body": {"prompt": [%s], "max_tokens": 4, "ignore_eos": true, "temperature": 0, "return_token_ids": true}}\n' ${p}
  done >"$T/batch-in.jsonl"
  submit "$(basename "$BATCH_TPL")" "$BATCH_TPL" INPUT="$T/batch-in.jsonl" OUTPUT="$T/batch-out.jsonl" EXTRA_ARGS="--max-running 2"
fi
JOBID=${JOBIDS[*]}

for ((i = 0; i < 180; i++)); do # 90 s
  [ -z "$(squeue -h 2>/dev/null)" ] && break
  sleep 0.5
done
[ -z "$(squeue -h 2>/dev/null)" ] || fail "jobs still queued or running after 90 s: $(squeue)"
echo "   all done after $((i / 2)) s"

# --- 7. checks -------------------------------------------------------------------------
for id in "${JOBIDS[@]}"; do
  OUT=$T/job-$id.out
  say "job $id: ${JOBWHAT[$id]}"
  INFO=$(scontrol show job "$id" 2>/dev/null)
  JSTATE=$(echo "$INFO" | tr ' ' '\n' | sed -n 's/^JobState=//p')
  JEXIT=$(echo "$INFO" | tr ' ' '\n' | sed -n 's/^ExitCode=//p')
  sed 's/^/   | /' "$OUT" 2>/dev/null
  if [ "$JSTATE" != COMPLETED ] || [ "$JEXIT" != 0:0 ]; then fail "job $id ended ${JSTATE:-?} with exit code ${JEXIT:-?}"; fi
  check() { grep -qE -- "$1" "$OUT" || fail "job $id: output lacks a line matching '$1'"; echo "   ok: $2"; }
  check '^colibri job [0-9]+: 2 ranks' "the template ran with 2 tasks"
  case ${JOBWHAT[$id]} in
    colibri-batch*)
      check 'srun --mpi=pmix -n 2 --kill-on-bad-exit=1 ' "colibri launch used srun with PMIx"
      check '^batch: 2 requests done, 0 skipped' "colibri batch answered both requests"
      # The results' token ids as the reference's 'sequence N: ids' lines (a -> 0, b -> 1).
      got=$(python3 -c 'import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    ids = r["response"]["body"]["choices"][0]["token_ids"]
    print("sequence %d: %s" % ("ab".index(r["custom_id"]), ",".join(map(str, ids))))' "$T/batch-out.jsonl" | sort)
      [ "$got" = "$REF" ] || fail "job $id: batch results differ from one-process generate:"$'\n'"$got"$'\nexpected:\n'"$REF"
      echo "   ok: the tokens of one-process generate, in $T/batch-out.jsonl"
      # The template is requeueable: requeue the finished job; its second start resumes
      # on the same output (skips both requests) and appends to the same log.
      scontrol requeue "$id" 2>"$T/log/requeue.err" || fail "job $id: scontrol requeue failed: $(cat "$T/log/requeue.err")"
      # NOTE: slurmctld makes a requeued job eligible only after a delay (its BeginTime); start it now.
      scontrol update JobId="$id" StartTime=now 2>>"$T/log/requeue.err" || true
      for ((i = 0; i < 180; i++)); do # 90 s
        JSTATE=$(scontrol show job "$id" 2>/dev/null | tr ' ' '\n' | sed -n 's/^JobState=//p')
        [ "$JSTATE" = COMPLETED ] && grep -q '^batch: 0 requests done, 2 skipped' "$OUT" && break
        sleep 0.5
      done
      sed -n '/restart 1/,$p' "$OUT" | sed 's/^/   | /'
      check '^colibri job [0-9]+: 2 ranks .*restart 1' "requeued: the job started again"
      check '^batch: 0 requests done, 2 skipped' "the rerun skipped both requests"
      check '^colibri job [0-9]+: 2 ranks .*restart 0' "the first start's log kept (--open-mode=append)"
      [ "$(wc -l <"$T/batch-out.jsonl")" -eq 2 ] || fail "job $id: the output should still hold 2 results"
      echo "   ok: still 2 results after the requeue"
      continue
      ;;
  esac
  case ${JOBWHAT[$id]} in
    *mpirun*) check 'mpirun -np 2 --bind-to none ' "colibri launch used mpirun inside the allocation" ;;
    *) check 'srun --mpi=pmix -n 2 --kill-on-bad-exit=1 ' "colibri launch used srun with PMIx" ;;
  esac
  case ${JOBWHAT[$id]} in
    *ucx*) check '^OMPI_MCA_mpi_yield_when_idle=1 OMPI_MCA_pml=ucx OMPI_MCA_pml_ucx_tls=any OMPI_MCA_pml_ucx_devices=any ' \
      "the ranks were told to use UCX" ;;
    *STAGE_DIR*) check "--model $T/stage/tiny.colibri " "the model was staged with sbcast" ;;
  esac
  check '^decode: ' "decode statistics"
  got=$(grep '^sequence ' "$OUT" | sort -u)
  [ "$got" = "$REF" ] || fail "job $id: tokens differ from one-process generate:"$'\n'"$got"$'\nexpected:\n'"$REF"
  echo "   ok: the tokens of one-process generate ($(echo "$REF" | wc -l) sequences of 4)"
  # run: the coordinator alone prints the tokens; generate: one independent engine per task.
  want=1
  [ "$CMD" = generate ] && want=2
  n=$(grep -c '^sequence 0: ' "$OUT")
  [ "$n" -eq "$want" ] || fail "job $id: expected $want 'sequence 0:' line(s) with colibri $CMD, found $n"
  echo "   ok: $want 'sequence 0:' line(s)"
done
echo "PASS: slurm templates on one node (jobs ${JOBIDS[*]}), colibri $CMD"
