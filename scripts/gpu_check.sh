#!/usr/bin/env bash
# scripts/gpu_check.sh: the CUDA checks on a machine with an NVIDIA GPU (the H200 lent to
# some sessions through the device tool). That machine has the CUDA toolkit but none of
# Colibri's other build dependencies, so this builds the CUDA kernels and their checks with
# nvcc alone (tests/cuda_check.cu + kernels/cuda/*.cu), then:
#   1. the checks against CPU references (bf16 GEMM, expert FFN SiLU and gpt-oss SwiGLU
#      with biases, f32 -> bf16 rounding, refused bad calls);
#   2. the same checks under compute-sanitizer memcheck (out-of-bounds and misaligned
#      accesses, leaks of launch errors), when compute-sanitizer is there;
#   3. the benchmark table: measured peaks (device copy GB/s, 8192^3 bf16 GEMM TFLOP/s),
#      the expert FFN at decode (1-64 rows) and prefill (1024-8192 rows) sizes of a
#      Mixtral-8x7B expert as GB/s and TFLOP/s against those peaks, host-to-device expert
#      load GB/s (pinned and pageable).
# Well under 8 minutes (about 1-2). Writes the whole log to $OUT/gpu_check.log when OUT is set.
# usage: scripts/gpu_check.sh            env: NVCC (default nvcc on PATH or /usr/local/cuda),
#                                             ARCH (default sm_90), SANITIZE=0 to skip step 2
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
log=/dev/null
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT" && log="$OUT/gpu_check.log"; fi
exec > >(tee "$log") 2>&1
nvcc="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
arch="${ARCH:-sm_90}"
echo "== gpu_check at $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?'), $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>&1 || true
"$nvcc" --version | tail -n 2
b="$(mktemp -d)"
echo "== build (nvcc -arch=$arch)"
t0=$SECONDS
"$nvcc" -O2 -std=c++17 -lineinfo -arch="$arch" -I"$root" -I"$root/include" "$root/tests/cuda_check.cu" \
  "$root/kernels/cuda/ffn.cu" -lcublasLt -o "$b/cuda_check" || { echo "BUILD FAILED"; exit 1; }
echo "built in $((SECONDS - t0)) s"
rc=0
echo "== checks"
"$b/cuda_check"; c=$?
if [ $c -eq 77 ]; then echo "== gpu_check: no GPU on this machine: nothing checked"; exit 77; fi
[ $c -eq 0 ] || { echo "CHECKS FAILED (exit $c)"; rc=1; }
if [ "${SANITIZE:-1}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  echo "== checks under compute-sanitizer memcheck"
  # NOTE: libraries may fail CUDA API calls on purpose (probing); only memory errors count.
  timeout 300 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 3 "$b/cuda_check"; c=$?
  [ $c -eq 0 ] || { echo "MEMCHECK FAILED (exit $c)"; rc=1; }
fi
echo "== benchmark"
"$b/cuda_check" --bench | sed -n '/^== benchmark/,$p'; c=${PIPESTATUS[0]}
[ $c -eq 0 ] || { echo "BENCHMARK FAILED (exit $c)"; rc=1; }
echo "== gpu_check: $([ $rc -eq 0 ] && echo passed || echo FAILED)"
# Let tee write the last lines to the log before the script ends.
exec >&- 2>&-
sleep 1
exit $rc
