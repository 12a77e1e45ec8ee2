#!/usr/bin/env bash
# bench_test.sh: `colibri bench` (docs/benchmarks.md). Run by ctest as
#   bash tests/bench_test.sh <path-to-colibri>
# On Mixtral's tiny synthetic model: bench --json is one JSON object with the
# configuration echoed, every repetition and the medians, positive rates and
# the weight bytes per decode token computed from the file; batch 1 counts
# exactly top_k experts per MoE layer, batch 2 between top_k and the expert
# count. --memory-bandwidth prints a positive rate for every kernel and
# validates; --peak-flops a positive GFLOP/s for AVX2 (and AVX-512F when the
# CPU has it) on x86-64, for NEON on aarch64. Bad arguments exit 11 (invalid argument) with a message, a
# missing file 12, an unparsable number 2. Stops at the first failure.
set -euo pipefail

# shellcheck source=tests/cli_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/cli_lib.sh"
cli_setup bench "$@"


# JSON checks need python3 or jq; without either, the JSON checks fall back to
# grep (keys present) and awk (positive numbers).
JSON=none
if command -v python3 >/dev/null 2>&1; then JSON=python3; elif command -v jq >/dev/null 2>&1; then JSON=jq; fi

# jget FILE EXPR: a value of the JSON in FILE; EXPR is a jq path like .median.decode_tokens_per_s
jget() {
  local f=$1 e=$2
  case $JSON in
    python3)
      python3 - "$f" "$e" <<'EOF'
import json, sys
v = json.load(open(sys.argv[1]))
for part in sys.argv[2].lstrip(".").split("."):
    if part.endswith("]"):
        name, idx = part[:-1].split("[")
        v = v[name] if name else v
        v = v[int(idx)]
    else:
        v = v[part]
print(json.dumps(v) if isinstance(v, (dict, list, bool)) or v is None else v)
EOF
      ;;
    jq) jq -r "$e" "$f" ;;
  esac
}
# jlen FILE KEY: the length of the top-level array KEY.
jlen() {
  case $JSON in
    python3) python3 -c 'import json,sys; print(len(json.load(open(sys.argv[1]))[sys.argv[2]]))' "$1" "$2" ;;
    jq) jq -r ".$2 | length" "$1" ;;
  esac
}
# positive NUMBER: a finite number > 0.
positive() { awk -v x="$1" 'BEGIN { exit !(x + 0 > 0 && x == x + 0) }'; }

echo "colibri: $BIN"
echo "temp dir: $T"
echo "json checker: $JSON"

# ---------------------------------------------------------------------------
step "help"
expect_rc 0 "bench --help" "$BIN" bench --help
for o in --model --batch --prompt-len --new-tokens --threads --reps --warmup --seed --json --memory-bandwidth \
  --size-mb --peak-flops --tokenizer --text-file --text-kib; do out_has "$o"; done
pass "bench --help mentions every option"
expect_rc 0 "colibri --help" "$BIN" --help
out_has "bench"
pass "colibri --help lists bench"

# ---------------------------------------------------------------------------
step "tiny model"
expect_rc 0 "synth tiny" "$BIN" synth --arch mixtral --preset tiny --out "$T/hf"
expect_rc 0 "convert" "$BIN" convert "$T/hf" "$T/m.colibri"
M=$T/m.colibri

# ---------------------------------------------------------------------------
step "bench --json, batch 2"
expect_rc 0 "bench --json" "$BIN" bench --model "$M" --batch 2 --prompt-len 8 --new-tokens 4 --reps 2 --warmup 1 \
  --threads 1 --json
cp "$T/out" "$T/b2.json"
if [ "$JSON" = none ]; then
  echo "   note: neither python3 nor jq found; checking keys with grep"
  for k in '"mode": "model"' '"batch": 2' '"prompt_len": 8' '"new_tokens": 4' '"decode_steps": 3' '"threads": 1' \
    '"prefill_tokens_per_s"' '"decode_tokens_per_s"' '"decode_ms_per_step"' '"weights_per_token"' \
    '"weight_gbps"' '"kernels"' '"architecture": "mixtral"' '"median"'; do
    grep -qF -- "$k" "$T/b2.json" || fail "bench --json lacks $k"
  done
  pass "bench --json holds the expected keys"
else
  [ "$(jget "$T/b2.json" .mode)" = model ] || fail "mode is not 'model'"
  # The configuration echoed as given.
  for kv in batch=2 prompt_len=8 new_tokens=4 decode_steps=3 threads=1 reps=2 warmup=1 seed=0; do
    got=$(jget "$T/b2.json" ".config.${kv%%=*}")
    [ "$got" = "${kv#*=}" ] || fail "config.${kv%%=*} is $got, expected ${kv#*=}"
  done
  pass "the configuration is echoed"
  [ "$(jget "$T/b2.json" .model.architecture)" = mixtral ] || fail "model.architecture is not mixtral"
  [ -n "$(jget "$T/b2.json" .config.kernels)" ] || fail "config.kernels is empty"
  [ -n "$(jget "$T/b2.json" .model.dtype)" ] || fail "model.dtype is empty"
  # Two repetitions, each with positive rates; 2 sequences x 3 decode steps = 6 decode tokens.
  [ "$(jlen "$T/b2.json" reps)" = 2 ] || fail "reps does not hold 2 repetitions"
  for i in 0 1; do
    [ "$(jget "$T/b2.json" ".reps[$i].decode_tokens")" = 6 ] || fail "reps[$i].decode_tokens is not 6"
    [ "$(jget "$T/b2.json" ".reps[$i].prefill_tokens")" = 16 ] || fail "reps[$i].prefill_tokens is not 16"
    for k in prefill_tokens_per_s decode_tokens_per_s decode_ms_per_step weight_gbps; do
      v=$(jget "$T/b2.json" ".reps[$i].$k")
      positive "$v" || fail "reps[$i].$k = $v is not positive"
    done
  done
  for k in prefill_tokens_per_s decode_tokens_per_s decode_ms_per_step weight_gbps; do
    v=$(jget "$T/b2.json" ".median.$k")
    positive "$v" || fail "median.$k = $v is not positive"
    for s in median min max; do
      v=$(jget "$T/b2.json" ".$k.$s")
      positive "$v" || fail "$k.$s = $v is not positive"
    done
  done
  pass "every repetition and the medians have positive rates"
  n=$(jget "$T/b2.json" .noise.noisy)
  [ "$n" = true ] || [ "$n" = false ] || fail "noise.noisy is '$n', not a boolean"
  v=$(jget "$T/b2.json" .noise.measured_seconds)
  positive "$v" || fail "noise.measured_seconds $v is not positive"
  # Bytes: batch 2 touches between top_k and all experts per MoE layer per step;
  # bytes per token = bytes per step / 2; the sum adds up.
  d=$(jget "$T/b2.json" .bytes.distinct_experts_per_moe_layer_per_step)
  k=$(jget "$T/b2.json" .model.top_k)
  e=$(jget "$T/b2.json" .model.experts)
  awk -v d="$d" -v k="$k" -v e="$e" 'BEGIN { exit !(d >= k && d <= e) }' ||
    fail "distinct experts per layer $d not within [top_k $k, experts $e]"
  jget "$T/b2.json" .bytes.routed_source | grep -q "counted over the" || fail "batch 2 did not count experts from the routing"
  ws=$(jget "$T/b2.json" .bytes.weights_per_step)
  wt=$(jget "$T/b2.json" .bytes.weights_per_token)
  dn=$(jget "$T/b2.json" .bytes.dense_per_step)
  lm=$(jget "$T/b2.json" .bytes.lm_head)
  er=$(jget "$T/b2.json" .bytes.embedding_row)
  ro=$(jget "$T/b2.json" .bytes.routed_experts_per_step)
  awk -v ws="$ws" -v wt="$wt" -v dn="$dn" -v lm="$lm" -v er="$er" -v ro="$ro" \
    'BEGIN { s = dn + lm + 2 * er + ro; exit !(ws > 0 && (ws - s) ^ 2 < 1 && (wt * 2 - ws) ^ 2 < 1) }' ||
    fail "weights per step $ws != dense $dn + LM head $lm + 2 x row $er + routed $ro, or per token $wt != half"
  pass "batch 2: $d distinct experts per MoE layer per step, $wt weight bytes per decode token"
fi

# ---------------------------------------------------------------------------
step "bench text, batch 1"
expect_rc 0 "bench batch 1" "$BIN" bench --model "$M" --batch 1 --prompt-len 8 --new-tokens 3 --reps 1 --warmup 0
for w in "prefill tok/s" "decode tok/s" "decode ms/step" "weight GB/s" median min max "weights per decode token" \
  "mixtral" "kernels" "threads" "counted over the"; do out_has "$w"; done
# batch 1: 2 MoE layers x top-2 x the block size: the count the file implies.
out_has "2.00 distinct experts per MoE layer"
v=$(awk '$1 == "median" { print $3 }' "$T/out")
positive "$v" || fail "median decode tok/s '$v' is not positive"
pass "bench prints per-rep, median, min and max rates and the bytes per token"
if [ "$JSON" != none ]; then
  expect_rc 0 "bench batch 1 --json" "$BIN" bench --model "$M" --prompt-len 8 --new-tokens 3 --reps 1 --warmup 0 --json
  cp "$T/out" "$T/b1.json"
  # Tiny Mixtral: 2 MoE layers, top-2, f32 blocks of 3 x 64 x 128 x 4 bytes.
  blk=$(jget "$T/b1.json" .model.expert_block_bytes)
  ro=$(jget "$T/b1.json" .bytes.routed_experts_per_step)
  [ "$blk" -gt 0 ] || fail "expert_block_bytes $blk"
  awk -v ro="$ro" -v blk="$blk" 'BEGIN { exit !(ro == 2 * 2 * blk) }' || fail "batch 1 routed bytes $ro != 2 layers x 2 x $blk"
  pass "batch 1 counts top_k blocks per MoE layer ($ro bytes)"
fi

# ---------------------------------------------------------------------------
step "memory bandwidth"
expect_rc 0 "bench --memory-bandwidth" "$BIN" bench --memory-bandwidth --size-mb 64 --reps 2
for kname in copy scale add triad sum; do
  line=$(grep -E "^$kname " "$T/out") || fail "no line for $kname"
  for col in 2 3; do
    v=$(echo "$line" | awk -v c=$col '{ print $c }')
    positive "$v" || fail "$kname: column $col '$v' is not a positive rate"
  done
done
out_has "validation: passed"
pass "every kernel has a positive best and median rate, validated"
if [ "$JSON" != none ]; then
  expect_rc 0 "bench --memory-bandwidth --json" "$BIN" bench --memory-bandwidth --size-mb 32 --reps 1 --threads 1 --json
  cp "$T/out" "$T/mem.json"
  [ "$(jget "$T/mem.json" .validated)" = true ] || fail "memory --json not validated"
  for kname in copy scale add triad sum; do
    v=$(jget "$T/mem.json" ".kernels.$kname.best_gbps")
    positive "$v" || fail "$kname best_gbps $v"
  done
  [ "$(jget "$T/mem.json" .kernels.sum.arrays_counted)" = 1 ] || fail "sum does not count 1 array"
  [ "$(jget "$T/mem.json" .kernels.triad.arrays_counted)" = 3 ] || fail "triad does not count 3 arrays"
  pass "memory --json holds every kernel"
fi

# ---------------------------------------------------------------------------
step "peak flops"
# The architecture the binary was built for (`colibri --version`), not the
# shell's: an aarch64 binary may run here under qemu-user (scripts/cross_check.sh).
arch=$("$BIN" --version | awk '$1 == "built" && $2 == "for" { sub(/;$/, "", $3); print $3 }')
[ -n "$arch" ] || fail "colibri --version names no architecture"
expect_rc 0 "bench --peak-flops" "$BIN" bench --peak-flops --reps 1 --threads 1
case "$arch" in
x86_64)
  if grep -qw avx2 /proc/cpuinfo && grep -qw fma /proc/cpuinfo; then
    v=$(awk '$1 == "avx2+fma" { print $3 }' "$T/out")
    positive "$v" || fail "avx2+fma GFLOP/s '$v' is not positive"
    pass "avx2+fma: $v GFLOP/s"
  fi
  if grep -qw avx512f /proc/cpuinfo; then
    v=$(awk '$1 == "avx512f" { print $3 }' "$T/out")
    positive "$v" || fail "avx512f GFLOP/s '$v' is not positive"
    pass "avx512f: $v GFLOP/s"
  else
    grep -q '^avx512f ' "$T/out" && fail "avx512f measured on a CPU without it"
    pass "no AVX-512F line on a CPU without it"
  fi
  grep -q '^neon ' "$T/out" && fail "a NEON line from an x86-64 build"
  ;;
aarch64)
  grep -q '^neon ' "$T/out" || fail "no NEON line from an aarch64 build"
  grep -qE '^(avx2\+fma|avx512f) ' "$T/out" && fail "an x86 line from an aarch64 build"
  # The rate from --json, at full precision: under qemu-user it prints as 0.0 GFLOP/s.
  expect_rc 0 "bench --peak-flops --json" "$BIN" bench --peak-flops --reps 1 --threads 1 --json
  v=$(tr -d ' \n' <"$T/out" | grep -o '"neon":{[^}]*' | grep -o '"best_gflops":[-0-9.e+]*' | cut -d: -f2)
  positive "$v" || fail "neon GFLOP/s '$v' is not positive"
  pass "neon: $v GFLOP/s, no x86 line"
  ;;
*) fail "no peak-flops check written for architecture '$arch'" ;;
esac

# ---------------------------------------------------------------------------
step "tokenizer"
TOKFX="$(dirname "$0")/fixtures/tokenizers/qwen2_bpe"
cp -r "$T/hf" "$T/hf_tok"
cp "$TOKFX/tokenizer.json" "$TOKFX/tokenizer_config.json" "$T/hf_tok/"
expect_rc 0 "convert with tokenizer.json" "$BIN" convert "$T/hf_tok" "$T/tok.colibri"
printf 'Hello, world! 你好 🙂\n  code(x) + 42;\n' >"$T/text.txt"
expect_rc 0 "bench --tokenizer --text-file" "$BIN" bench --tokenizer --model "$T/tok.colibri" --text-file "$T/text.txt" --reps 2
out_has "encode"
out_has "MB/s"
# (256 KiB of the built-in text: the default 4 MiB takes ~15 s under the sanitizers.)
expect_rc 0 "bench --tokenizer --json" "$BIN" bench --tokenizer --model "$T/tok.colibri" --text-kib 256 --reps 2 --json
if [ "$JSON" != none ]; then
  [ "$(jget "$T/out" '.mode')" = tokenizer ] || fail "mode should be tokenizer"
  positive "$(jget "$T/out" '.encode_mb_per_s.median')" || fail "encode MB/s should be > 0"
  positive "$(jget "$T/out" '.tokens_per_byte')" || fail "tokens per byte should be > 0"
  pass "JSON: mode, encode MB/s and tokens per byte"
fi
[ "$JSON" = none ] || [ "$(jget "$T/out" '.text_bytes')" -ge 262144 ] || fail "--text-kib 256 should encode >= 262144 bytes"
expect_rc 11 "--text-kib 0" "$BIN" bench --tokenizer --model "$T/tok.colibri" --text-kib 0
expect_rc 11 "--text-kib with --text-file" "$BIN" bench --tokenizer --model "$T/tok.colibri" --text-kib 4 --text-file "$T/text.txt"
expect_rc 11 "bench --tokenizer on a model without one" "$BIN" bench --tokenizer --model "$M"
err_has "no embedded tokenizer"

# ---------------------------------------------------------------------------
step "bad arguments"
expect_rc 11 "no mode" "$BIN" bench
err_has "--model"
expect_rc 11 "--batch 0" "$BIN" bench --model "$M" --batch 0
err_has "--batch"
expect_rc 11 "--prompt-len 0" "$BIN" bench --model "$M" --prompt-len 0
err_has "--prompt-len"
expect_rc 11 "prompt longer than the context" "$BIN" bench --model "$M" --prompt-len 100000 --new-tokens 4
err_has "context"
expect_rc 11 "--new-tokens 1" "$BIN" bench --model "$M" --new-tokens 1
err_has "--new-tokens"
expect_rc 11 "--reps 0" "$BIN" bench --model "$M" --reps 0
err_has "--reps"
expect_rc 11 "--warmup -1" "$BIN" bench --model "$M" --warmup -1
err_has "--warmup"
expect_rc 11 "--threads -2" "$BIN" bench --model "$M" --threads -2
err_has "--threads"
expect_rc 11 "--kernels foo" "$BIN" bench --model "$M" --kernels foo
err_has "foo"
expect_rc 11 "two modes" "$BIN" bench --model "$M" --memory-bandwidth
err_has "one of"
expect_rc 11 "--size-mb 0" "$BIN" bench --memory-bandwidth --size-mb 0
err_has "--size-mb"
expect_rc 11 "--size-mb beyond memory" "$BIN" bench --memory-bandwidth --size-mb 100000000
err_has "memory"
expect_rc 11 "--reps 101 for memory" "$BIN" bench --memory-bandwidth --reps 101
err_has "--reps"
expect_rc 11 "--batch with --peak-flops" "$BIN" bench --peak-flops --batch 2
err_has "--batch"
expect_rc 11 "--size-mb with a model" "$BIN" bench --model "$M" --size-mb 4
err_has "--size-mb"
expect_rc 11 "a stray argument" "$BIN" bench --model "$M" stray
err_has "stray"
expect_rc 12 "a missing model file" "$BIN" bench --model "$T/none.colibri"
err_has "none.colibri"
expect_rc 13 "not a .colibri file" "$BIN" bench --model "$T/hf/config.json"
expect_rc 2 "--batch abc" "$BIN" bench --model "$M" --batch abc
grep -q "Segmentation\|Aborted\|internal error" "$T/err" && fail "a crash or internal error on bad input"

echo "bench_test: all $CHECKS checks passed"
