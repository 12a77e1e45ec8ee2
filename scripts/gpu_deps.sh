#!/usr/bin/env bash
# scripts/gpu_deps.sh: downloads (here, where apt and the Debian repositories are) the
# Debian packages that the whole Colibri build needs beyond a compiler, CMake, ninja and
# the CUDA toolkit, for scripts/gpu_check.sh to build the engine on a lent GPU machine
# (which has no network and none of these). Nothing is installed: `apt-get download`
# only fetches the .debs (no root needed); gpu_check.sh unpacks them into a prefix there.
# The list follows CMakeLists.txt: find_package spdlog (with fmt), nlohmann_json,
# cxxopts, GTest (tests/: its targets file names gmock too, so libgmock-dev),
# pkg_check_modules libxxhash, libpcre2-8, libutf8proc, sentencepiece, and pkgconf for
# pkg-config itself. Their Depends are resolved with apt-cache; the C/C++ runtime and
# what the build never uses are left out (SKIP below). A few MB in all.
# usage: scripts/gpu_deps.sh [DIR]      (default DIR: .gpu-debs in the repository root,
#        ignored by git; carry it: run with carry [".gpu-debs"], command scripts/gpu_check.sh)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${1:-$root/.gpu-debs}"
want=(libspdlog-dev libspdlog1.10 libfmt-dev libfmt9 libcxxopts-dev nlohmann-json3-dev
      libxxhash-dev libxxhash0 libpcre2-dev libpcre2-8-0 libutf8proc-dev libutf8proc2
      libsentencepiece-dev libsentencepiece0 libgtest-dev libgmock-dev googletest
      pkgconf pkgconf-bin libpkgconf3)
# Dependencies not carried: the C and C++ runtimes and libc headers (there with any
# compiler), catch2 (spdlog's own tests), the 16/32-bit and POSIX PCRE2 libraries (only
# libpcre2-8 is linked).
skip=" libc6 libc-dev libc6-dev libgcc-s1 libstdc++6 catch2 libpcre2-16-0 libpcre2-32-0 libpcre2-posix3 "
command -v apt-get >/dev/null && command -v apt-cache >/dev/null || { echo "gpu_deps: needs apt-get and apt-cache (Debian/Ubuntu)"; exit 1; }

# The closure of Depends/PreDepends (first alternative of each), less SKIP.
declare -A seen=()
queue=("${want[@]}")
pkgs=()
while [ ${#queue[@]} -gt 0 ]; do
  p="${queue[0]}"; queue=("${queue[@]:1}")
  [ -n "${seen[$p]:-}" ] && continue
  seen[$p]=1
  apt-cache show "$p" >/dev/null 2>&1 || { echo "gpu_deps: no package $p known to apt (run apt-get update first?)"; exit 1; }
  pkgs+=("$p")
  while read -r d; do
    case "$skip" in *" $d "*) continue ;; esac
    [ -n "${seen[$d]:-}" ] || queue+=("$d")
  done < <(apt-cache depends --no-recommends --no-suggests --no-conflicts --no-breaks --no-replaces --no-enhances "$p" |
           sed -n 's/^ *|\{0,1\}\(Pre\)\{0,1\}Depends: <\{0,1\}\([^ >]*\)>\{0,1\}$/\2/p' | awk '!s[$0]++')
done
extra=()
for p in "${pkgs[@]}"; do case " ${want[*]} " in *" $p "*) ;; *) extra+=("$p") ;; esac; done
[ ${#extra[@]} -eq 0 ] || echo "gpu_deps: also needed (resolved): ${extra[*]}"

mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"
# Drop .debs of other versions or of packages no longer wanted (apt-get download fetches anew).
keep=" "
for p in "${pkgs[@]}"; do
  v="$(apt-cache policy "$p" | sed -n 's/^ *Candidate: //p')"
  keep+="${p}_${v//:/%3a}_ "
done
for f in "$dir"/*.deb; do
  [ -e "$f" ] || continue
  b="$(basename "$f")"
  case "$keep" in *" ${b%"${b##*_}"} "*) ;; *) echo "gpu_deps: removing stale $b"; rm -f "$f" ;; esac
done
# As root, apt hands the download to its _apt user, who may not write DIR: keep it root.
sandbox=(); [ "$(id -u)" -ne 0 ] || sandbox=(-o APT::Sandbox::User=root)
(cd "$dir" && apt-get download -q "${sandbox[@]}" "${pkgs[@]}")
n=$(ls "$dir"/*.deb | wc -l)
echo "gpu_deps: $n packages in $dir ($(du -sh "$dir" | cut -f1)):"
(cd "$dir" && ls -1 *.deb | sed 's/^/  /')
[ "$n" -eq ${#pkgs[@]} ] || { echo "gpu_deps: expected ${#pkgs[@]} .debs, found $n"; exit 1; }
