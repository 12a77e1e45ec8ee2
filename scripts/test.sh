#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite (unit tests,
# transformers parity, C API, command-line tests) with CTest.
# usage: scripts/test.sh [ctest arguments, e.g. -R Parity]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
bash "$root/scripts/build.sh"
build="${COLIBRI_BUILD_DIR:-$root/build}"
# Open MPI refuses to run as root unless told; CI and these machines run as root.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
ctest --test-dir "$build" --output-on-failure --parallel "$(nproc)" --timeout 600 "$@"
