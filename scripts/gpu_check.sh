#!/usr/bin/env bash
# scripts/gpu_check.sh: every CUDA check on a machine with an NVIDIA GPU (the H200 lent to
# some sessions through the device tool), in one run, with a table at the end. That machine
# has the CUDA toolkit, CMake, ninja and a compiler but none of Colibri's other build
# dependencies and no network: those travel as Debian packages (scripts/gpu_deps.sh, run
# on the development machine, fills .gpu-debs; the device tool's run carries [".gpu-debs"]).
# Stages:
#   engine   (in the background from the start, when the .debs are there) the .debs are
#            unpacked into a prefix, the whole engine is configured against it (CUDA on,
#            sm_90, MPI off: Open MPI is not carried) and built with every core;
#   build    tests/cuda_check.cu and every kernels/cuda/*.cu, with nvcc alone;
#   checks   the kernels against CPU references (cuda_check: bf16 GEMM, expert FFN SiLU
#            and gpt-oss SwiGLU with biases, f32 -> bf16 rounding, refused bad calls, and
#            whatever else tests/cuda_check.cu checks);
#   memcheck the same under compute-sanitizer memcheck, when it is there;
#   bench    the benchmark table (after the engine build, so the host is quiet): measured
#            peaks (device copy GB/s, 8192^3 bf16 GEMM TFLOP/s), a Mixtral-8x7B expert's
#            FFN at decode (1-64 rows) and prefill (1024-8192 rows) sizes as GB/s and
#            TFLOP/s against those peaks, host-to-device expert load GB/s;
#   engine tests  colibri_tests --gtest_filter='*Cuda*:*Gpu*' (CUDA against the CPU, on
#            the transformers fixtures among others, at the bf16 CPU tolerances), the CPU
#            parity tests on the same fixtures as the baseline (Fixtures/Parity*), and any
#            ctest test named cuda.* or gpu.* other than cuda.check (run above).
# Each stage has a timeout, clamped to a whole-run budget (BUDGET, 450 s: under 8 minutes
# with the table); a stage that fails prints its tail and the run goes on to the table.
# Exit: 0 all passed, 77 no GPU (the GPU stages skipped; the rest passed), 1 a failure.
# Logs, when OUT is set: $OUT/gpu_check.log (everything printed), gpu_check_engine.log (the
# engine's configure and build), gpu_check_parity.log (the parity tests' output).
# usage: scripts/gpu_check.sh
# env: NVCC (default: nvcc on PATH, else /usr/local/cuda/bin/nvcc), ARCH (sm_90),
#      SANITIZE=0 (skip memcheck), COLIBRI_DEBS (default .gpu-debs in the repository root),
#      ENGINE=0 (skip the engine), ENGINE_BUILD_DIR (default: a new folder under /tmp),
#      ENGINE_CMAKE_ARGS (more -D options), BUDGET (seconds, 450), BUILD_TIMEOUT (the
#      engine build's, 240 s), JOBS (default: nproc)
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
log=/dev/null
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT" && log="$OUT/gpu_check.log"; fi
exec > >(tee "$log") 2>&1
nvcc="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
arch="${ARCH:-sm_90}"
budget="${BUDGET:-450}"
jobs="${JOBS:-$(nproc 2>/dev/null || echo 4)}"
debs="${COLIBRI_DEBS:-$root/.gpu-debs}"
[ ! -d "$debs" ] || debs="$(cd "$debs" && pwd)"
work="$(mktemp -d /tmp/gpu_check.XXXXXX)"
export GTEST_COLOR=no

rows=()
failed=0
nogpu=0
# row STAGE RESULT SECONDS: one line of the table (printed as it happens too).
row() {
  rows+=("$(printf '%-34s %-44s %6s' "$1" "$2" "$3 s")")
  echo "-- $1: $2 ($3 s)"
  case "$2" in *FAIL* | *TIMEOUT*) failed=1 ;; esac
}
# limit CAP [RESERVE]: CAP seconds, less if the budget (less RESERVE for later stages)
# ends sooner; 0 (skip the stage) when fewer than 10 s would be left.
limit() {
  local l=$((budget - SECONDS - ${2:-0}))
  [ "$l" -lt "$1" ] || l=$1
  [ "$l" -ge 10 ] || l=0
  echo "$l"
}
# must CAP [RESERVE]: the same for a stage that runs whatever is left (10 s at least:
# `timeout 0` would mean no limit).
must() {
  local l
  l=$(limit "$@")
  [ "$l" -gt 0 ] || l=10
  echo "$l"
}
# result RC: a stage's exit code in words.
result() {
  case "$1" in
    0) echo passed ;; 77) echo "no GPU" ;; 124 | 137) echo "TIMEOUT" ;; *) echo "FAILED (exit $1)" ;;
  esac
}
# gtest_counts FILE: "N passed, M skipped, K failed" from a gtest run's output.
gtest_counts() {
  local p s f
  p=$(sed -n 's/^\[  PASSED  \] \([0-9]*\) test.*/\1/p' "$1" | tail -n 1)
  s=$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) test.*/\1/p' "$1" | tail -n 1)
  f=$(sed -n 's/^\[  FAILED  \] \([0-9]*\) test.*/\1/p' "$1" | tail -n 1)
  echo "${p:-0} passed, ${s:-0} skipped, ${f:-0} failed"
}

echo "== gpu_check at $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?'), $(date -u +%FT%TZ), budget ${budget} s, $jobs jobs"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>&1 || true
"$nvcc" --version | tail -n 2
echo "host: $(uname -m), $(. /etc/os-release 2>/dev/null && echo "$PRETTY_NAME"), $(${CXX:-c++} --version 2>/dev/null | head -n 1), $(cmake --version 2>/dev/null | head -n 1)"

# unpack_deb DEB DIR: a .deb's files into DIR, with dpkg-deb, else ar and tar, else
# python3 (UNPACK=dpkg|ar|python forces one).
unpack_deb() {
  local how="${UNPACK:-}"
  if [ -z "$how" ]; then
    if command -v dpkg-deb >/dev/null; then how=dpkg; elif command -v ar >/dev/null; then how="ar"; else how=python; fi
  fi
  case "$how" in
    dpkg) dpkg-deb -x "$1" "$2" ;;
    ar) (d="$(mktemp -d)" && cd "$d" && m="$(ar t "$1" | grep '^data\.tar')" && ar x "$1" "$m" &&
          tar -xf "$m" -C "$2" && rm -rf "$d") ;;
    python) python3 - "$1" "$2" <<'EOF'
import io, sys, tarfile
f = open(sys.argv[1], "rb")
assert f.read(8) == b"!<arch>\n", "not an ar archive"
while len(h := f.read(60)) == 60:
    name, size = h[:16].decode().strip().rstrip("/"), int(h[48:58])
    data = f.read(size); f.read(size % 2)
    if name.startswith("data.tar"):
        t = tarfile.open(fileobj=io.BytesIO(data))
        t.extractall(sys.argv[2], **({"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}))
EOF
    ;;
  esac
}
# ---- engine: unpack the .debs, configure and build (background) ----------------------
# Writes $work/engine.log and $work/engine.status ("STEP RC SECONDS" lines).
engine_job() {
  local t gen keep f
  t=$SECONDS
  mkdir -p "$prefix"
  for f in "$debs"/*.deb; do unpack_deb "$f" "$prefix" || return 1; done
  echo "unpack 0 $((SECONDS - t))" >>"$work/engine.status"
  local usr="$prefix/usr" ma
  ma="$(ls -d "$usr"/lib/*-linux-gnu 2>/dev/null | head -n 1)"
  ma="${ma:-$usr/lib}"
  export CMAKE_PREFIX_PATH="$usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  # No CPATH/LIBRARY_PATH: the imported targets name the prefix's headers and libraries
  # (and a LIBRARY_PATH entry would count as implicit, keeping it out of the RUNPATH).
  export LD_LIBRARY_PATH="$ma${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  # The .pc files say prefix=/usr: the sysroot puts the prefix in front of their -I/-L.
  export PKG_CONFIG_LIBDIR="$ma/pkgconfig:$usr/share/pkgconfig" PKG_CONFIG_SYSROOT_DIR="$prefix"
  unset PKG_CONFIG_PATH
  # Keep going past a failure: one run shows every error.
  if command -v ninja >/dev/null; then gen=(-G Ninja); keep=(-k 0); else gen=(); keep=(-k); fi
  t=$SECONDS
  # shellcheck disable=SC2086
  timeout "$(must 90 200)" cmake -S "$root" -B "$bdir" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DCOLIBRI_CUDA=ON -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_CUDA_ARCHITECTURES="${arch#sm_}" -DCOLIBRI_MPI=OFF \
    -DCMAKE_PREFIX_PATH="$usr" -DPKG_CONFIG_EXECUTABLE="$usr/bin/pkgconf" ${ENGINE_CMAKE_ARGS:-}
  echo "configure $? $((SECONDS - t))" >>"$work/engine.status"
  grep -q '^configure 0 ' "$work/engine.status" || return 1
  t=$SECONDS
  echo "== engine build"
  timeout "$(must "${BUILD_TIMEOUT:-240}" 150)" cmake --build "$bdir" -j "$jobs" -- "${keep[@]}"
  echo "build $? $((SECONDS - t))" >>"$work/engine.status"
}
engine_pid=
bdir="${ENGINE_BUILD_DIR:-$work/build}"
mkdir -p "$bdir" && bdir="$(cd "$bdir" && pwd)"
# Inside the build folder, so that a build folder used again finds its prefix where it was.
prefix="$bdir/gpu-deps"
if [ "${ENGINE:-1}" = 0 ]; then
  echo "== engine: skipped (ENGINE=0)"
  row "engine" "skipped (ENGINE=0)" 0
elif ls "$debs"/*.deb >/dev/null 2>&1; then
  echo "== engine: $(ls "$debs"/*.deb | wc -l) .debs from $debs; configure and build in $bdir (background, log below when done)"
  engine_job >"$work/engine.log" 2>&1 &
  engine_pid=$!
else
  echo "== engine: skipped: no .debs in $debs. To build and test the engine here, run scripts/gpu_deps.sh"
  echo "   on the development machine, then the device tool's run with carry [\".gpu-debs\"]."
  row "engine" "skipped (no .debs: scripts/gpu_deps.sh)" 0
fi

# ---- nvcc alone: cuda_check and every kernels/cuda/*.cu ------------------------------
b="$work/nvcc"
mkdir -p "$b"
echo "== build: cuda_check (nvcc -arch=$arch): tests/cuda_check.cu + $(cd "$root" && echo kernels/cuda/*.cu)"
t0=$SECONDS
ok=1
flags=(-O2 -std=c++17 -lineinfo -arch="$arch" -I"$root" -I"$root/include")
pids=()
for f in "$root"/tests/cuda_check.cu "$root"/kernels/cuda/*.cu; do
  timeout "$(must 240 120)" "$nvcc" "${flags[@]}" -c "$f" -o "$b/$(basename "$f" .cu).o" &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || ok=0; done
# The kernels as an archive: the link takes only what cuda_check uses.
if [ $ok = 1 ]; then
  objs=()
  for f in "$b"/*.o; do [ "$f" = "$b/cuda_check.o" ] || objs+=("$f"); done
  "$nvcc" -lib "${objs[@]}" -o "$b/libkernels.a" &&
    "$nvcc" -arch="$arch" "$b/cuda_check.o" -L"$b" -lkernels -lcublasLt -o "$b/cuda_check" || ok=0
fi
if [ $ok = 1 ]; then row "build (nvcc alone)" ok $((SECONDS - t0)); else row "build (nvcc alone)" "BUILD FAILED" $((SECONDS - t0)); fi

if [ $ok = 1 ]; then
  echo "== checks"
  t0=$SECONDS
  timeout "$(must 120 60)" "$b/cuda_check"; c=$?
  [ $c -eq 77 ] && nogpu=1
  row "checks (cuda_check)" "$(result $c)" $((SECONDS - t0))
  if [ $nogpu = 1 ]; then
    row "memcheck" "no GPU" 0
  elif [ "${SANITIZE:-1}" != 1 ]; then
    row "memcheck" "skipped (SANITIZE=0)" 0
  elif ! command -v compute-sanitizer >/dev/null; then
    row "memcheck" "skipped (no compute-sanitizer)" 0
  else
    echo "== checks under compute-sanitizer memcheck"
    t0=$SECONDS
    l=$(limit 180 120)
    if [ "$l" = 0 ]; then
      row "memcheck" "skipped (out of time)" 0
    else
      # NOTE: libraries may fail CUDA API calls on purpose (probing); only memory errors count.
      timeout "$l" compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 3 "$b/cuda_check" 2>&1 |
        tee "$work/memcheck.log"; c=${PIPESTATUS[0]}
      # NOTE: on GPU machines under gVisor compute-sanitizer refuses the device (seen there):
      # that is no memory error, and no failure of ours.
      if [ $c != 0 ] && grep -q 'Device not supported' "$work/memcheck.log"; then
        row "memcheck" "unavailable (sanitizer: device not supported)" $((SECONDS - t0))
      else
        row "memcheck" "$(result $c)" $((SECONDS - t0))
      fi
    fi
  fi
fi

# ---- the engine's build finishes -------------------------------------------------------
engine_ok=0
if [ -n "$engine_pid" ]; then
  t0=$SECONDS
  wait "$engine_pid"
  echo "== engine: configure and build (waited $((SECONDS - t0)) s for it)"
  [ -z "${OUT:-}" ] || cp "$work/engine.log" "$OUT/gpu_check_engine.log"
  st() { sed -n "s/^$1 //p" "$work/engine.status" 2>/dev/null; }
  if [ -z "$(st unpack)" ]; then
    tail -n 20 "$work/engine.log"
    row "engine: unpack .debs" "FAILED" 0
  else
    read -r c s <<<"$(st configure)"
    if [ "${c:-1}" != 0 ]; then
      tail -n 40 "$work/engine.log"
      row "engine: configure" "$(result "${c:-1}")" "${s:-0}"
    else
      # Where each dependency was found: the prefix, or (a warning) somewhere else.
      deps="$(grep -E '^(spdlog|fmt|nlohmann_json|cxxopts|GTest)_DIR:|^pkgcfg_lib_[A-Z0-9]*_[a-z0-9_]*:' "$bdir/CMakeCache.txt")"
      n=$(grep -c . <<<"$deps"); inpre=$(grep -c "=$prefix/" <<<"$deps")
      echo "dependencies: $inpre of $n from the unpacked prefix $prefix"
      grep -v "=$prefix/" <<<"$deps" | sed 's/^/  NOT FROM THE PREFIX: /'
      grep -E '^-- Colibri: ' "$work/engine.log"
      row "engine: configure" "ok ($inpre/$n deps from the .debs)" "$s"
      read -r c s <<<"$(st build)"
      if [ "${c:-1}" != 0 ]; then
        grep -E -m 20 'error|FAILED:' "$work/engine.log"
        echo "-- last lines of the build:"
        sed -n '/^== engine build$/,$p' "$work/engine.log" | tail -n 40
        row "engine: build ($jobs jobs)" "BUILD $(result "${c:-1}")" "${s:-0}"
      else
        tail -n 2 "$work/engine.log"
        echo "$(grep -c 'warning:' "$work/engine.log") compiler warnings"
        row "engine: build ($jobs jobs)" ok "$s"
        engine_ok=1
      fi
    fi
  fi
fi

if [ $ok = 1 ] && [ $nogpu = 0 ]; then
  echo "== benchmark"
  t0=$SECONDS
  l=$(limit 120 100)
  if [ "$l" = 0 ]; then
    row "benchmark" "skipped (out of time)" 0
  else
    timeout "$l" "$b/cuda_check" --bench | sed -n '/^== benchmark/,$p'; c=${PIPESTATUS[0]}
    row "benchmark" "$(result "$c")" $((SECONDS - t0))
  fi
elif [ $ok = 1 ]; then
  row "benchmark" "no GPU" 0
fi

# ---- the engine's tests ------------------------------------------------------------------
# gtest NAME STAGE FILTER CAP RESERVE [quiet]: colibri_tests on FILTER, one table row. Quiet: the
# output goes to $OUT/gpu_check_NAME.log only, and its failures and last lines here.
gtest() {
  local t=$SECONDS l c out="$work/gtest_$1.log" counts
  l=$(limit "$4" "$5")
  [ "$l" != 0 ] || { row "$2" "skipped (out of time)" 0; return; }
  echo "== $2: colibri_tests --gtest_filter='$3'"
  if [ -n "${6:-}" ]; then
    (cd "$bdir" && timeout "$l" ./bin/colibri_tests --gtest_filter="$3") >"$out" 2>&1
    c=$?
    grep -E '^\[  FAILED  \]|Failure$' "$out" | head -n 40
    tail -n 3 "$out"
    [ -z "${OUT:-}" ] || cp "$out" "$OUT/gpu_check_$1.log"
  else
    (cd "$bdir" && timeout "$l" ./bin/colibri_tests --gtest_filter="$3") 2>&1 | tee "$out"
    c=${PIPESTATUS[0]}
  fi
  counts="$(gtest_counts "$out")"
  case "$c" in
    0) if [ "${counts%% *}" = 0 ]; then row "$2" "none ran ($counts)" $((SECONDS - t)); else row "$2" "passed ($counts)" $((SECONDS - t)); fi ;;
    124 | 137) row "$2" "TIMEOUT ($counts)" $((SECONDS - t)) ;;
    *) row "$2" "FAILED (exit $c: $counts)" $((SECONDS - t)) ;;
  esac
}
if [ $engine_ok = 1 ]; then
  # Where the tests' shared libraries come from through their RUNPATH alone (all but the
  # toolkit's should be the prefix's); LD_LIBRARY_PATH names the prefix too, in case.
  echo "colibri_tests' shared libraries: $(ldd "$bdir/bin/colibri_tests" | grep -c "$prefix/") from the prefix:"
  ldd "$bdir/bin/colibri_tests" | grep -E 'spdlog|fmt|xxhash|pcre2|utf8proc|sentencepiece|cudart|cublas|not found'
  ma="$(ls -d "$prefix"/usr/lib/*-linux-gnu 2>/dev/null | head -n 1)"
  export LD_LIBRARY_PATH="${ma:-$prefix/usr/lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  gtest cuda "engine: Cuda*/Gpu* tests" '*Cuda*:*Gpu*' 200 30
  gtest parity "engine: CPU parity (fixtures)" 'Fixtures/Parity.*:Fixtures/ParityRounded.*' 60 0 quiet
  re='^(cuda|gpu)[._]'
  n=$(cd "$bdir" && ctest -N -R "$re" -E '^cuda\.check$' 2>/dev/null | sed -n 's/^Total Tests: //p')
  if [ "${n:-0}" -gt 0 ]; then
    echo "== engine: ctest -R '$re' (less cuda.check)"
    t0=$SECONDS
    l=$(limit 150 0)
    if [ "$l" = 0 ]; then
      row "engine: ctest cuda.*/gpu.*" "skipped (out of time)" 0
    else
      (cd "$bdir" && timeout "$l" ctest -R "$re" -E '^cuda\.check$' --output-on-failure -j 2); c=$?
      row "engine: ctest cuda.*/gpu.* ($n)" "$(result $c)" $((SECONDS - t0))
    fi
  else
    row "engine: ctest cuda.*/gpu.*" "none registered" 0
  fi
fi

echo
echo "== summary ($(date -u +%FT%TZ), $SECONDS s in all)"
printf '%-34s %-44s %6s\n' stage result time
printf '%s\n' "${rows[@]}"
if [ $failed = 1 ]; then
  status="FAILED"; rc=1
elif [ $nogpu = 1 ]; then
  status="no GPU on this machine: the GPU stages were skipped, the rest passed"; rc=77
else
  status="passed"; rc=0
fi
echo "== gpu_check: $status"
# Let tee write the last lines to the log before the script ends.
exec >&- 2>&-
sleep 1
exit $rc
