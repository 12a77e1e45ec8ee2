#!/usr/bin/env bash
# synth_test.sh: `colibri synth` for every family the converter supports. Run by
# ctest as
#   bash tests/synth_test.sh <path-to-colibri>
# For each family: synth --preset tiny -> convert -> inspect --verify (names the
# family) -> generate (a short prompt and one longer than gpt-oss's tiny sliding
# window) prints 4 tokens per prompt. Also: --help lists the families and
# presets, an unknown --arch or --preset fails with exit 11 (invalid argument)
# naming the choices and writes nothing, the same seed gives identical files
# and another seed different ones, a sharded checkpoint converts to the same
# bytes, and Mixtral's tiny preset is byte-identical to the first version of
# synth (demos and benchmarks depend on it). Stops at the first failure.
set -euo pipefail

# shellcheck source=tests/cli_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/cli_lib.sh"
cli_setup synth "$@"

FAMILIES="mixtral qwen2_moe qwen3_moe olmoe deepseek_v2 deepseek_v3 glm4_moe gpt_oss"


# same_files A B: every file of directory A exists in B with the same bytes, and B has no others.
same_files() {
  local a=$1 b=$2 f
  [ "$(cd "$a" && ls | sort)" = "$(cd "$b" && ls | sort)" ] || fail "$a and $b hold different file names"
  for f in "$a"/*; do
    cmp -s "$f" "$b/$(basename "$f")" || fail "$(basename "$f") differs between $a and $b"
  done
}

echo "colibri: $BIN"
echo "temp dir: $T"

# ---------------------------------------------------------------------------
step "synth --help"
expect_rc 0 "colibri synth --help" "$BIN" synth --help
for w in $FAMILIES tiny small medium --arch --preset --seed --out --dtype --shard-mb; do out_has "$w"; done
pass "synth --help lists every family and preset"

# ---------------------------------------------------------------------------
step "bad --arch and --preset"
expect_rc 11 "synth --arch llama" "$BIN" synth --arch llama --preset tiny --out "$T/bad"
err_has "llama"
for f in $FAMILIES; do err_has "$f"; done
[ ! -e "$T/bad" ] || fail "synth with an unknown --arch created its output directory"
pass "unknown --arch names every family and writes nothing"
expect_rc 11 "synth --preset huge" "$BIN" synth --arch olmoe --preset huge --out "$T/bad"
for p in huge tiny small medium; do err_has "$p"; done
[ ! -e "$T/bad" ] || fail "synth with an unknown --preset created its output directory"
pass "unknown --preset names the presets and writes nothing"
expect_rc 11 "synth without --out" "$BIN" synth --arch gpt_oss

# ---------------------------------------------------------------------------
# The long prompt (12 tokens + 4 new) is longer than gpt-oss's tiny window (8).
LONG=5,6,7,8,9,10,11,12,13,14,15,16
for f in $FAMILIES; do
  step "$f: synth -> convert -> inspect -> generate"
  HF=$T/$f
  M=$T/$f.colibri
  expect_rc 0 "$f: synth --preset tiny" "$BIN" synth --arch "$f" --preset tiny --out "$HF"
  [ -f "$HF/config.json" ] && [ -f "$HF/model.safetensors" ] || fail "$f: synth did not write config.json and model.safetensors"
  grep -qF "\"model_type\": \"$f\"" "$HF/config.json" || fail "$f: config.json lacks \"model_type\": \"$f\""
  bytes=$(wc -c <"$HF/model.safetensors")
  [ "$bytes" -gt 1000000 ] && [ "$bytes" -lt 20000000 ] || fail "$f: tiny model.safetensors is $bytes bytes, expected a few MB"
  pass "$f: config.json and a $bytes-byte model.safetensors"

  expect_rc 0 "$f: convert" "$BIN" convert "$HF" "$M"
  [ -f "$M" ] || fail "$f: convert did not write $M"
  expect_rc 0 "$f: inspect --verify" "$BIN" inspect --verify "$M"
  grep -qE "^model +$f: " "$T/out" || fail "$f: inspect does not print the architecture '$f'"
  out_has "verify: ok"
  pass "$f: inspect names the architecture and verifies"

  expect_rc 0 "$f: generate" "$BIN" generate -m "$M" -p 1,2,3 -p "$LONG" -n 4 --ignore-eos
  for i in 0 1; do
    grep -qE "^sequence $i: [0-9]+(,[0-9]+){3}$" "$T/out" || fail "$f: generate did not print 4 tokens for prompt $i"
  done
  pass "$f: generate printed 4 tokens for each prompt"
done

# ---------------------------------------------------------------------------
step "seeds"
for f in $FAMILIES; do
  expect_rc 0 "$f: synth --seed 0 again" "$BIN" synth --arch "$f" --preset tiny --seed 0 --out "$T/$f-again"
  same_files "$T/$f" "$T/$f-again"
  pass "$f: the same seed gives identical files"
done
expect_rc 0 "deepseek_v3: synth --seed 1" "$BIN" synth --arch deepseek_v3 --preset tiny --seed 1 --out "$T/ds3-seed1"
if cmp -s "$T/deepseek_v3/model.safetensors" "$T/ds3-seed1/model.safetensors"; then
  fail "deepseek_v3: seeds 0 and 1 gave the same weights"
fi
pass "another seed gives other weights"

# ---------------------------------------------------------------------------
step "shards"
for f in deepseek_v3 gpt_oss; do
  expect_rc 0 "$f: synth --shard-mb 1" "$BIN" synth --arch "$f" --preset tiny --shard-mb 1 --out "$T/$f-sharded"
  [ -f "$T/$f-sharded/model.safetensors.index.json" ] || fail "$f: synth --shard-mb 1 wrote no index"
  [ ! -e "$T/$f-sharded/model.safetensors" ] || fail "$f: synth --shard-mb 1 also wrote model.safetensors"
  expect_rc 0 "$f: convert sharded" "$BIN" convert "$T/$f-sharded" "$T/$f-sharded.colibri"
  cmp -s "$T/$f.colibri" "$T/$f-sharded.colibri" || fail "$f: sharded and single-file checkpoints converted differently"
  pass "$f: the sharded checkpoint converts to the identical file"
done

# ---------------------------------------------------------------------------
step "mixtral unchanged"
# SHA-256 of `colibri synth --preset tiny` (mixtral, seed 0) as the first
# version of synth wrote them; a change breaks existing demos and benchmarks.
want_cfg=23ca5869613f5b923de875c193baf511611927c0a34dfe079e69c03c8ae3cf14
want_st=20f255fac7558a8475b51d3478b7bdb4819be942bc8c8a2ac76a64e8b32f2f6b
if command -v sha256sum >/dev/null 2>&1; then
  got_cfg=$(sha256sum "$T/mixtral/config.json" | cut -d' ' -f1)
  got_st=$(sha256sum "$T/mixtral/model.safetensors" | cut -d' ' -f1)
  [ "$got_cfg" = "$want_cfg" ] || fail "mixtral tiny config.json changed: sha256 $got_cfg, expected $want_cfg"
  [ "$got_st" = "$want_st" ] || fail "mixtral tiny model.safetensors changed: sha256 $got_st, expected $want_st"
  pass "mixtral tiny is byte-identical to the original synth"
else
  echo "   skip: sha256sum not found, not checking mixtral's bytes"
fi

echo "synth_test: all $CHECKS checks passed"
