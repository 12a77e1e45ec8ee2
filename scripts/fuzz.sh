#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz) with Clang, ASan and UBSan into
# build-fuzz/, replays each target's whole corpus (every seed and every stored
# reproducer of a fixed finding, once), then fuzzes each for a bounded time,
# starting from a copy of the corpus (the repository is not modified). Fails on
# any crash, sanitizer report, leak, timeout or out-of-memory, printing the reproducer.
# usage: scripts/fuzz.sh [seconds-per-target (default 60)] [target...]
# env:   COLIBRI_FUZZ_BUILD_DIR  build directory (default build-fuzz/)
#        COLIBRI_FUZZ_JOBS       targets fuzzed at once (default 1)
#        COLIBRI_FUZZ_KEEP=1     keep the grown corpora (their paths are printed)
#        COLIBRI_FUZZ_ARGS       extra libFuzzer flags, e.g. "-seed=1"
#        COLIBRI_FUZZ_STEP       build (build only), run (no build: fuzz what is built)
#                                or all (default); scripts/test.sh builds while other
#                                tests run, then fuzzes
# Reproduce a finding: build-fuzz/bin/<target> <reproducer>
# See docs/fuzzing.md.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${COLIBRI_FUZZ_BUILD_DIR:-$root/build-fuzz}"
jobs="${COLIBRI_FUZZ_JOBS:-1}"
all_targets=(fuzz_colibri_file fuzz_safetensors fuzz_placement_json fuzz_config_json fuzz_routing_trace)

seconds=60
if [ $# -gt 0 ]; then
  case "$1" in
    -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    ''|*[!0-9]*) ;;
    *) seconds="$1"; shift ;;
  esac
fi
targets=()
for t in "$@"; do targets+=("fuzz_${t#fuzz_}"); done  # "safetensors" or "fuzz_safetensors"
[ ${#targets[@]} -gt 0 ] || targets=("${all_targets[@]}")
for t in "${targets[@]}"; do
  case " ${all_targets[*]} " in
    *" $t "*) ;;
    *) echo "fuzz: unknown target '$t' (targets: ${all_targets[*]})" >&2; exit 2 ;;
  esac
done

step="${COLIBRI_FUZZ_STEP:-all}"
case "$step" in build | run | all) ;; *) echo "fuzz: COLIBRI_FUZZ_STEP must be build, run or all" >&2; exit 2 ;; esac

# ---- tools: clang with the libFuzzer/sanitizer runtimes ------------------------
have_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
missing=()
if command -v dpkg-query >/dev/null 2>&1; then
  if command -v clang++ >/dev/null 2>&1; then
    # The runtimes must match the clang that is there (Debian 12: 14).
    ver="$(clang++ -dumpversion | cut -d. -f1)"
    have_pkg "libclang-rt-$ver-dev" || missing+=("libclang-rt-$ver-dev")
  else
    missing+=(clang libclang-rt-dev)  # the distribution's default clang and its runtimes
  fi
  for p in cmake ninja-build pkg-config libspdlog-dev libfmt-dev nlohmann-json3-dev libxxhash-dev; do
    have_pkg "$p" || missing+=("$p")
  done
fi
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
      echo "fuzz: missing ${missing[*]} and not root; install them" >&2
      exit 1
    fi
  fi
  echo "fuzz: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# ---- build ------------------------------------------------------------------------
if [ "$step" != run ]; then
  if [ ! -f "$build/CMakeCache.txt" ]; then
    # COLIBRI_UNITY_BUILD: the library sources in a few translation units (cmake/build_speed.cmake).
    cmake -S "$root/tests/fuzz" -B "$build" -G Ninja -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
      -DCOLIBRI_UNITY_BUILD="${COLIBRI_UNITY_BUILD:-ON}" >/dev/null
  fi
  cmake --build "$build" --parallel "$(nproc)" --target "${targets[@]}"
  [ "$step" = build ] && { echo "fuzz: ${#targets[@]} targets built in $build"; exit 0; }
fi
for t in "${targets[@]}"; do
  [ -x "$build/bin/$t" ] || { echo "fuzz: $build/bin/$t is not built (COLIBRI_FUZZ_STEP=run needs a build step first)" >&2; exit 1; }
done

# ---- fuzz -------------------------------------------------------------------------
work="$(mktemp -d "${TMPDIR:-/tmp}/colibri-fuzz.XXXXXX")"
artifacts="$build/artifacts"
mkdir -p "$artifacts"
if [ "${COLIBRI_FUZZ_KEEP:-0}" = 1 ]; then
  echo "fuzz: corpora kept under $work"
else
  trap 'rm -rf "$work"' EXIT
fi
# NOTE: every UBSan report is fatal (-fno-sanitize-recover at build time); leaks
# are checked by libFuzzer itself (-detect_leaks=1 is its default under ASan).
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=0}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"

run_one() {
  local t="$1" corpus="$work/$1" log="$work/$1.log"
  mkdir -p "$corpus" "$artifacts/$t"
  cp -R "$root/tests/fuzz/corpus/$t/." "$corpus/"
  local dict=()
  [ -f "$root/tests/fuzz/$t.dict" ] && dict=(-dict="$root/tests/fuzz/$t.dict")
  local rc=0
  # The whole corpus once (-runs=0: execute every input, no fuzzing), then the
  # bounded run from it. A corpus input that fails is a regression.
  "$build/bin/$t" -runs=0 -rss_limit_mb=2048 -timeout=10 -artifact_prefix="$artifacts/$t/" \
    "$root/tests/fuzz/corpus/$t" >"$work/$t.replay.log" 2>&1 || rc=$?
  if [ "$rc" != 0 ]; then
    cp "$work/$t.replay.log" "$log"
    echo "$rc" >"$work/$t.rc"
    return
  fi
  [ "$seconds" -gt 0 ] || { cp "$work/$t.replay.log" "$log"; echo 0 >"$work/$t.rc"; return; }
  # shellcheck disable=SC2086
  "$build/bin/$t" "$corpus" "${dict[@]}" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
    -artifact_prefix="$artifacts/$t/" -print_final_stats=1 ${COLIBRI_FUZZ_ARGS:-} >"$log" 2>&1 || rc=$?
  echo "$rc" >"$work/$t.rc"
}

pids=()
for t in "${targets[@]}"; do
  echo "fuzz: $t for ${seconds}s"
  run_one "$t" &
  pids+=($!)
  if [ "${#pids[@]}" -ge "$jobs" ]; then
    wait "${pids[0]}"
    pids=("${pids[@]:1}")
  fi
done
for p in "${pids[@]}"; do wait "$p"; done

failed=0
echo
for t in "${targets[@]}"; do
  log="$work/$t.log"
  rc="$(cat "$work/$t.rc")"
  execs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)"
  speed="$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)"
  cov="$(grep -o ' cov: [0-9]*' "$log" | tail -1 | awk '{print $2}')"
  ft="$(grep -o ' ft: [0-9]*' "$log" | tail -1 | awk '{print $2}')"
  result=ok
  if [ "$rc" != 0 ]; then
    failed=1
    if grep -q 'ERROR: libFuzzer: timeout' "$log"; then result=TIMEOUT
    elif grep -q 'out-of-memory' "$log"; then result=OUT-OF-MEMORY
    elif grep -q 'LeakSanitizer' "$log"; then result=LEAK
    elif grep -q 'colibri-fuzz== FINDING' "$log"; then result=FINDING
    elif grep -q 'runtime error:' "$log"; then result=UNDEFINED-BEHAVIOUR
    elif grep -q 'AddressSanitizer' "$log"; then result=ADDRESS-ERROR
    else result="CRASH(rc=$rc)"; fi
  fi
  # NOTE: one line per target, "fuzz: TARGET RESULT ...": scripts/test.sh counts the ok ones.
  printf 'fuzz: %-20s %-8s %10s execs %7s/s  cov %5s  ft %6s\n' "$t" "$result" "${execs:-?}" "${speed:-?}" "${cov:-?}" "${ft:-?}"
  if [ "$result" != ok ]; then
    repro="$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$log" | tail -1)"
    saved="$artifacts/$t.log"
    cp "$log" "$saved"
    echo "    log: $saved"
    grep -m1 -E 'FINDING|ERROR: |runtime error:|out-of-memory' "$log" | sed 's/^/    /' || true
    if [ -n "$repro" ]; then
      echo "    reproducer: $repro"
      echo "    replay:     $build/bin/$t $repro"
    fi
  fi
done
[ "$failed" = 0 ] && echo "fuzz: all ${#targets[@]} targets clean (corpus replayed, then ${seconds}s each)" || echo "fuzz: FAILED" >&2
exit "$failed"
