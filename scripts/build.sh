#!/usr/bin/env bash
# Configures and builds Colibri into build/ (Release). Extra arguments go to
# cmake's configure step, e.g. scripts/build.sh -DCOLIBRI_CUDA=OFF.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${COLIBRI_BUILD_DIR:-$root/build}"
generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
if [ ! -f "$build/CMakeCache.txt" ] || [ $# -gt 0 ]; then
  cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE="${COLIBRI_BUILD_TYPE:-Release}" "$@"
fi
cmake --build "$build" --parallel "$(nproc)"
