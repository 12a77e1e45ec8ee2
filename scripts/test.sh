#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite: the CTest
# suite (unit tests, transformers parity, C API, command line, MPI cluster,
# signals, SLURM), then the AddressSanitizer/UndefinedBehaviorSanitizer build of
# the unit tests, then every libFuzzer target for a bounded time.
# usage: scripts/test.sh [--quick] [--sanitize asan|tsan|all] [--fuzz-seconds N] [ctest args...]
#   --quick            only the CTest suite (no sanitizer build, no fuzzing)
#   --sanitize KIND    which sanitizer stage to run (default asan; tsan and all also exist)
#   --fuzz-seconds N   seconds per fuzz target (default 60; 0 skips fuzzing)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
quick=0
sanitize=asan
fuzz_seconds=60
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
bash "$root/scripts/setup.sh"
bash "$root/scripts/build.sh"
build="${COLIBRI_BUILD_DIR:-$root/build}"
# Open MPI refuses to run as root unless told; CI and these machines run as root.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
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

start=$(date +%s)
ctest --test-dir "$build" --output-on-failure --parallel "$(nproc)" --timeout 900 "${ctest_args[@]}" 2>&1 | tee "$log"
count_ctest
echo "test.sh: CTest suite passed in $(( $(date +%s) - start )) s"
if [ "$quick" -eq 0 ]; then
  start=$(date +%s)
  bash "$root/scripts/sanitize.sh" "$sanitize" 2>&1 | tee "$log"
  count_ctest
  echo "test.sh: sanitizer stage ($sanitize) passed in $(( $(date +%s) - start )) s"
  if [ "$fuzz_seconds" -gt 0 ]; then
    start=$(date +%s)
    COLIBRI_FUZZ_JOBS="${COLIBRI_FUZZ_JOBS:-$(nproc)}" bash "$root/scripts/fuzz.sh" "$fuzz_seconds" 2>&1 | tee "$log"
    passed=$((passed + $(grep -c '^fuzz: .* ok' "$log" || true)))
    echo "test.sh: fuzzing passed in $(( $(date +%s) - start )) s"
  fi
fi
echo "tests: $passed passed, $skipped skipped, 0 failed"
