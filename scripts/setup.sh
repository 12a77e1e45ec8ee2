#!/usr/bin/env bash
# Installs every build and test dependency of Colibri from Debian packages.
# Safe to run twice: packages already present are skipped, and apt is only
# called when something is missing. Needs root (or sudo) when it installs.
set -euo pipefail

PACKAGES=(
  build-essential g++ cmake ninja-build pkg-config git
  libspdlog-dev libfmt-dev libcxxopts-dev nlohmann-json3-dev libxxhash-dev
  libpcre2-dev libutf8proc-dev libsentencepiece-dev
  libgtest-dev libgmock-dev googletest libbenchmark-dev
  libomp-dev clang libclang-rt-14-dev
  openmpi-bin libopenmpi-dev libucx-dev ucx-utils
  python3 python3-matplotlib
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#PACKAGES[@]} packages already installed"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
    echo "setup: missing packages (${missing[*]}) and not root; run as root or install them" >&2
    exit 1
  fi
fi

echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "setup: done"
