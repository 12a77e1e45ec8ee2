#!/usr/bin/env bash
# The layers of docs/architecture.md, checked on the sources: every
# `#include "folder/..."` of a file must name its own folder or a layer below
# it, so that no folder depends on one above it (no cycle). Lists every
# violation; exit 1 if any.
# usage: layering_test.sh SOURCE_ROOT
set -euo pipefail
root="${1:?usage: layering_test.sh SOURCE_ROOT}"
cd "$root"
# folder: the folders (and include/'s colibri.h as "include") it may include.
declare -A allowed=(
  [model]="model include"
  [kernels/cpu]="kernels/cpu model"
  [kernels/cuda]="kernels/cuda model"
  [comm]="comm model"
  [worker]="worker comm kernels/cpu kernels/cuda model"
  [coordinator]="coordinator worker comm kernels/cpu kernels/cuda model"
  [launcher/capi]="launcher/capi coordinator worker comm kernels/cpu kernels/cuda model include"
  [launcher]="launcher coordinator worker comm kernels/cpu kernels/cuda model"
)
bad=0
checked=0
for folder in model kernels/cpu kernels/cuda comm worker coordinator launcher/capi launcher; do
  for f in $(find "$folder" -maxdepth 1 -type f \( -name '*.h' -o -name '*.cpp' -o -name '*.cu' \) | sort); do
    checked=$((checked + 1))
    while IFS= read -r inc; do
      case "$inc" in
        colibri.h) target=include ;;
        */*/*) target="${inc%/*}" ;;   # kernels/cpu/x.h, launcher/capi/x.h
        */*) target="${inc%%/*}" ;;
        *) continue ;;                 # a file of the same folder by bare name
      esac
      ok=0
      for a in ${allowed[$folder]}; do [ "$a" = "$target" ] && ok=1; done
      if [ "$ok" -eq 0 ]; then
        echo "LAYERING: $f includes \"$inc\": $folder may include only ${allowed[$folder]}"
        bad=$((bad + 1))
      fi
    done < <(sed -nE 's/^[[:space:]]*#[[:space:]]*include[[:space:]]+"([^"]+)".*/\1/p' "$f")
  done
done
# Every source folder is one of the layers above.
for d in $(find . -path ./build -prune -o -path './build-*' -prune -o -path ./tests -prune -o -path ./.git -prune -o \
           \( -name '*.cpp' -o -name '*.cu' \) -print | xargs -n1 dirname | sed 's#^\./##' | sort -u); do
  case " model kernels/cpu kernels/cuda comm worker coordinator launcher/capi launcher " in
    *" $d "*) ;;
    *) echo "LAYERING: sources in $d belong to no layer (add it to tests/layering_test.sh and docs/architecture.md)"; bad=$((bad + 1)) ;;
  esac
done
[ "$checked" -gt 50 ] || { echo "LAYERING: only $checked files found under $root"; exit 1; }
if [ "$bad" -ne 0 ]; then echo "layering: $bad violation(s) in $checked files"; exit 1; fi
echo "layering: $checked files, every include within its layer or below"
