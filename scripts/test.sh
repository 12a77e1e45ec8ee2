#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite: the CTest
# suite (unit tests, transformers parity, C API, command line, MPI cluster,
# signals, SLURM), then the AddressSanitizer/UndefinedBehaviorSanitizer build of
# the unit tests, then every libFuzzer target for a bounded time.
# Every test runs once in the strictest build that can run it: the programs and
# scripts the sanitizer stage runs instrumented (CTest label "sanitized") are
# left out of the uninstrumented pass; --quick runs them there instead.
# usage: scripts/test.sh [--quick] [--sanitize asan|tsan|all] [--fuzz-seconds N] [ctest args...]
#   --quick            only the CTest suite (no sanitizer build, no fuzzing)
#   --sanitize KIND    which sanitizer stage to run (default asan; tsan and all also exist)
#   --fuzz-seconds N   seconds of fuzzing per target after its corpus is replayed
#                      (default 10; 0: replay the corpora only; -1 skips fuzzing)
# Each stage prints its time ("test.sh: ... in N s"); README.md's "Tests" section
# states them for the CI machine.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
quick=0
sanitize=asan
fuzz_seconds=10
ctest_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=1 ;;
    --sanitize) sanitize="$2"; shift ;;
    --fuzz-seconds) fuzz_seconds="$2"; shift ;;
    *) ctest_args+=("$1") ;;
  esac
  shift
done
# Stage times: wall seconds, and the CPU seconds (user + system) of the stage's
# processes, which other work on the machine does not inflate as it does the wall time.
times_file="$(mktemp)"
cpu_now() {  # sets cpu: CPU seconds of this script's finished child processes so far
  times >"$times_file"  # NOTE: in this shell, never in $(...): a subshell's children are not ours
  cpu=$(tail -1 "$times_file" | awk '{ s = 0; for (i = 1; i <= NF; i++) { split($i, b, /[ms]/); s += b[1] * 60 + b[2] } printf "%d", s }')
}
stage_start() { t0=$(date +%s); cpu_now; c0=$cpu; }
stage_end() { cpu_now; echo "test.sh: $1 in $(( $(date +%s) - t0 )) s (CPU $(( cpu - c0 )) s)"; }
all_start=$(date +%s)
stage_start
bash "$root/scripts/setup.sh"
stage_end "setup"
# The CI build (cmake/build_speed.cmake): unity builds; one CUDA architecture
# (this machine's GPU where one is visible, else Hopper, the target; a user
# building for the GPU chooses with CMAKE_CUDA_ARCHITECTURES); and the GPU-only
# test cases compiled into colibri_tests only where a GPU can run them (without
# one they run on the CPU emulator, cuda.emulated.engine.*).
build_args=(-DCOLIBRI_UNITY_BUILD=ON)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  build_args+=(-DCMAKE_CUDA_ARCHITECTURES=native -DCOLIBRI_GPU_TESTS=ON)
else
  build_args+=(-DCMAKE_CUDA_ARCHITECTURES=90 -DCOLIBRI_GPU_TESTS=OFF)
fi
stage_start
bash "$root/scripts/build.sh" "${build_args[@]}"
stage_end "build"
build="${COLIBRI_BUILD_DIR:-$root/build}"
# Open MPI refuses to run as root unless told; CI and these machines run as root.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# CTest runs nproc tests at once, each with nproc OpenMP threads: with libgomp's
# default (active) waiting, a thread waiting at a barrier spins on a core the
# thread it waits for needs. Passive waiting computes the same (the sanitizer
# stage and the MPI tests always ran so); measured on the loaded 2-core CI machine,
# QuantDense.EveryFixtureStoresTheRightMatricesAndStaysCloseToF32 took 90 s
# active and 2 s passive.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-passive}"
log="$(mktemp)"
# Tests counted over all stages: CTest's own count, each sanitizer stage's, and
# one per fuzz target.
# CTest counts a skipped test (GTEST_SKIP: a CPU without AVX-512, say) among
# "tests passed"; here it is subtracted and reported apart.
passed=0
skipped=0
count_ctest() {
  local all skip
  all=$(sed -nE 's/.*tests passed, 0 tests failed out of ([0-9]+).*/\1/p' "$log" | awk '{s += $1} END {print s + 0}')
  skip=$(grep -cE '\(Skipped\)$' "$log" || true)
  skipped=$((skipped + skip))
  passed=$((passed + all - skip))
}

# The tests' measured costs (tests/ctest_costs), so that CTest starts the
# longest first instead of finding them last on a fresh build folder.
seed_costs() {  # $1: build folder, $2: the cost file
  local f="$1/Testing/Temporary/CTestCostData.txt"
  [ -f "$f" ] || { mkdir -p "$(dirname "$f")"; cp "$2" "$f"; }
}
# Background steps: the next stage's build runs at the lowest priority while
# this stage's tests run (many of them wait on processes they start, which
# leaves cores idle); its output goes to a file, shown if it fails.
bg_pid=""
bg_log="$(mktemp)"
bg_start() { "$@" >"$bg_log" 2>&1 & bg_pid=$!; }
bg_wait() {  # $1: what; fails the run when the step failed
  local rc=0
  wait "$bg_pid" || rc=$?
  bg_pid=""
  if [ "$rc" -ne 0 ]; then cat "$bg_log"; echo "test.sh: $1 failed (exit $rc)"; exit 1; fi
  tail -3 "$bg_log"
}
# kill_tree PID: the process and everything it started (a failed stage leaves no
# background build or fuzzer running).
kill_tree() {
  local c
  for c in $(pgrep -P "$1" 2>/dev/null); do kill_tree "$c"; done
  kill "$1" 2>/dev/null || true
}
fuzz_log=""
trap 'rm -f "$log" "$times_file" "$bg_log" ${fuzz_log:+"$fuzz_log"}; [ -z "$bg_pid" ] || kill_tree "$bg_pid"' EXIT
# Tests at once: one more than the cores (many tests mostly wait on the processes
# they start); CTest runs RUN_SERIAL tests (signals) alone.
test_jobs=$(( $(nproc) + 1 ))

stage_start
seed_costs "$build" "$root/tests/ctest_costs/release.txt"
if [ "$quick" -eq 0 ]; then
  bg_start nice -n 19 env COLIBRI_SANITIZE_STEP=build bash "$root/scripts/sanitize.sh" "$sanitize"
fi
main_args=()
# The sanitizer stage runs these instrumented (tests/CMakeLists.txt, label "sanitized").
[ "$quick" -eq 0 ] && [ "$sanitize" = asan -o "$sanitize" = all ] && main_args=(-LE sanitized)
ctest --test-dir "$build" --output-on-failure --parallel "$test_jobs" --timeout 900 "${main_args[@]}" "${ctest_args[@]}" 2>&1 | tee "$log"
count_ctest
if [ "$quick" -eq 0 ]; then
  bg_wait "the sanitizer build ($sanitize)"
  stage_end "CTest suite passed (and the sanitizer build, in the background)"
  stage_start
  # The fuzz targets: built at nice 19 beside the sanitizer tests (which leave a
  # core idle while they wait on the processes they start), in the ASan build's
  # folder (scripts/sanitize.sh configures it with -DCOLIBRI_FUZZ=ON; they are not
  # part of its `all`), or with tsan alone in scripts/fuzz.sh's own; then run after
  # the tests, two at a time. (Run beside the tests as well, they ran 5-10x fewer
  # inputs and the stage took longer: docs/ci.md.)
  fuzz_log="$(mktemp)"
  fuzz_env=()
  case "$sanitize" in
    asan | all) fuzz_env=(COLIBRI_FUZZ_BUILD_DIR="${COLIBRI_ASAN_BUILD_DIR:-$root/build-asan}") ;;
  esac
  [ "$fuzz_seconds" -ge 0 ] && bg_start nice -n 19 env "${fuzz_env[@]}" COLIBRI_FUZZ_STEP=build bash "$root/scripts/fuzz.sh"
  COLIBRI_SANITIZE_STEP=test bash "$root/scripts/sanitize.sh" "$sanitize" 2>&1 | tee "$log"
  count_ctest
  if [ "$fuzz_seconds" -ge 0 ]; then
    bg_wait "the fuzz build"
    stage_end "sanitizer stage ($sanitize) passed (and the fuzz build, in the background)"
    stage_start
    env "${fuzz_env[@]}" COLIBRI_FUZZ_STEP=run COLIBRI_FUZZ_JOBS="${COLIBRI_FUZZ_JOBS:-$(nproc)}" \
      bash "$root/scripts/fuzz.sh" "$fuzz_seconds" 2>&1 | tee "$fuzz_log"
    passed=$((passed + $(grep -c '^fuzz: .* ok' "$fuzz_log" || true)))
    stage_end "fuzzing passed"
  else
    stage_end "sanitizer stage ($sanitize) passed"
  fi
  rm -f "$fuzz_log"
else
  stage_end "CTest suite passed"
fi
echo "tests: $passed passed, $skipped skipped, 0 failed"
echo "test.sh: all stages in $(( $(date +%s) - all_start )) s"
