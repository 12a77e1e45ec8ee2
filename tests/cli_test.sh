#!/usr/bin/env bash
# cli_test.sh: the colibri command end to end. Run by ctest as
#   bash tests/cli_test.sh <path-to-colibri> <fixtures-dir>
# Checks --help, synth -> convert -> inspect --verify -> generate, the
# reproducibility of generation, --dump-logits, detection of a corrupted expert
# block, and the exit codes of bad input (10 + Status, see model/error.h and
# launcher/main.cpp: 2 usage, 11 invalid argument, 12 i/o, 13 malformed file,
# 14 checksum, 15 unsupported). Stops at the first failure with a message.
set -euo pipefail

if [ $# -ne 2 ]; then
  echo "usage: $0 <path-to-colibri> <fixtures-dir>" >&2
  exit 2
fi
BIN=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
FIX=$2
[ -x "$BIN" ] || { echo "FAIL: $1 is not an executable" >&2; exit 1; }

T=$(mktemp -d "${TMPDIR:-/tmp}/colibri-cli.XXXXXX")
trap 'rm -rf "$T"' EXIT

# shellcheck source=tests/cli_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/cli_lib.sh"

# no_tmp FILE: no temporary FILE.tmp.XXXXXX (or FILE.tmp) may be left.
no_tmp() { ! compgen -G "$1.tmp*" >/dev/null || fail "$(compgen -G "$1.tmp*" | head -1) was left behind"; }
# sequences: the "sequence N:" lines of the last command.
sequences() { grep '^sequence ' "$T/out" || true; }

# flip_byte FILE OFFSET: xors one byte with 0x5a in place (no python needed).
flip_byte() {
  local f=$1 off=$2 v
  v=$(od -An -tu1 -j "$off" -N1 "$f" | tr -d ' \n')
  [ -n "$v" ] || fail "cannot read byte $off of $f"
  v=$((v ^ 0x5a))
  # shellcheck disable=SC2059
  printf "\\$(printf '%03o' "$v")" | dd of="$f" bs=1 seek="$off" conv=notrunc status=none
}

HAVE_PY=0
if command -v python3 >/dev/null 2>&1; then HAVE_PY=1; fi

echo "colibri: $BIN"
echo "fixtures: $FIX"
echo "temp dir: $T"

# ---------------------------------------------------------------------------
step "help and usage"
expect_rc 0 "colibri --help" "$BIN" --help
for c in synth convert inspect generate "exit codes"; do out_has "$c"; done
pass "--help lists every subcommand and the exit codes"
expect_rc 0 "colibri --version" "$BIN" --version
out_has "colibri "
out_has "built for "
out_has "CPU kernels: generic"

expect_rc 0 "colibri synth --help" "$BIN" synth --help
for o in --arch --preset --seed --out --dtype --shard-mb --help; do out_has "$o"; done
pass "synth --help mentions its options"
expect_rc 0 "colibri convert --help" "$BIN" convert --help
for o in --dtype HF_DIR OUT.colibri --help; do out_has "$o"; done
pass "convert --help mentions its options"
expect_rc 0 "colibri inspect --help" "$BIN" inspect --help
for o in --verify --json --experts FILE --help; do out_has "$o"; done
pass "inspect --help mentions its options"
expect_rc 0 "colibri generate --help" "$BIN" generate --help
for o in --model --prompt-ids --max-new-tokens --temperature --top-k --top-p --seed --ignore-eos \
         --dump-logits --threads --prefill-chunk --max-context --kernels --no-verify --help; do
  out_has "$o"
done
pass "generate --help mentions its options"

expect_rc 2 "no subcommand" "$BIN"
err_has "usage: colibri"
expect_rc 2 "unknown subcommand" "$BIN" frobnicate
err_has "unknown command 'frobnicate'"
expect_rc 2 "unknown option" "$BIN" inspect --no-such-option x.colibri
err_has "no-such-option"

# ---------------------------------------------------------------------------
step "synth -> convert -> inspect"
HF=$T/hf
expect_rc 0 "synth tiny" "$BIN" synth --preset tiny --seed 7 --out "$HF"
if [ ! -f "$HF/config.json" ] || [ ! -f "$HF/model.safetensors" ]; then
  fail "synth did not write config.json and model.safetensors"
fi
pass "synth wrote config.json and model.safetensors"

for dt in f32 bf16 f16; do
  M=$T/tiny-$dt.colibri
  expect_rc 0 "convert --dtype $dt" "$BIN" convert "$HF" "$M" --dtype "$dt"
  [ -f "$M" ] || fail "convert did not write $M"
  no_tmp "$M"
  pass "$M written, no .tmp left"
  expect_rc 0 "inspect --verify ($dt)" "$BIN" inspect --verify "$M"
  out_has "verify: ok"
  out_has "expert dtype $dt"
  out_has "colibri v1"
done
M=$T/tiny-f32.colibri
MB=$T/tiny-bf16.colibri

# The same weights sharded (with model.safetensors.index.json) convert to the same bytes.
expect_rc 0 "synth tiny sharded" "$BIN" synth --preset tiny --seed 7 --shard-mb 1 --out "$T/hf-sharded"
[ -f "$T/hf-sharded/model.safetensors.index.json" ] || fail "synth --shard-mb 1 wrote no index"
expect_rc 0 "convert sharded" "$BIN" convert "$T/hf-sharded" "$T/sharded.colibri" --dtype f32
cmp -s "$M" "$T/sharded.colibri" || fail "sharded and single-file checkpoints converted differently"
pass "sharded checkpoint converts to the identical file"

expect_rc 0 "inspect --json" "$BIN" inspect --json "$M"
cp "$T/out" "$T/inspect.json"
out_has '"format_version": 1'
out_has '"experts"'
if [ "$HAVE_PY" -eq 1 ]; then
  python3 -c 'import json,sys; json.load(sys.stdin)' <"$T/inspect.json" || fail "inspect --json is not valid JSON"
  pass "inspect --json parses as JSON"
else
  echo "   skip: python3 not found, not parsing inspect --json"
fi
expect_rc 0 "inspect --verify --json" "$BIN" inspect --verify --json "$M"
out_has '"verified"'

# ---------------------------------------------------------------------------
step "generate"
expect_rc 0 "generate two prompts (greedy)" "$BIN" generate --model "$M" --prompt-ids 1,2,3,4 --prompt-ids 5,6 \
  --max-new-tokens 6 --ignore-eos
out_has "sequence 0: "
out_has "sequence 1: "
out_has "prefill: "
out_has "decode: "
[ "$(sequences | wc -l)" -eq 2 ] || fail "expected 2 sequence lines"
sequences | while read -r _ _ ids; do
  n=$(echo "$ids" | tr ',' '\n' | grep -c .)
  [ "$n" -eq 6 ] || fail "a sequence has $n tokens, expected 6: $ids"
done
pass "two sequences of 6 tokens, prefill and decode lines"
sequences >"$T/greedy1"
expect_rc 0 "generate greedy again" "$BIN" generate -m "$M" -p 1,2,3,4 -p 5,6 -n 6 --ignore-eos
sequences >"$T/greedy2"
cmp -s "$T/greedy1" "$T/greedy2" || fail "greedy generation differs between two runs"
pass "greedy generation is reproducible"
expect_rc 0 "generate with an explicit f32 KV cache in blocks of 3" "$BIN" generate -m "$M" -p 1,2,3,4 -p 5,6 -n 6 \
  --ignore-eos --kv-dtype f32 --kv-block 3
sequences >"$T/greedy3"
cmp -s "$T/greedy1" "$T/greedy3" || fail "--kv-dtype f32 --kv-block 3 changed the tokens"
for kd in bf16 f16; do
  expect_rc 0 "generate with a $kd KV cache" "$BIN" generate -m "$M" -p 1,2,3,4 -p 5,6 -n 6 --ignore-eos --kv-dtype "$kd"
  [ "$(sequences | wc -l)" -eq 2 ] || fail "expected 2 sequence lines with --kv-dtype $kd"
  err_has "$kd"  # the log names the cache's type
done
pass "--kv-dtype f32 and --kv-block leave the tokens as they were; bf16 and f16 caches generate"

expect_rc 0 "generate bf16 model" "$BIN" generate -m "$MB" -p 1,2,3,4 -p 5,6 -n 6 --ignore-eos
[ "$(sequences | wc -l)" -eq 2 ] || fail "expected 2 sequence lines from the bf16 model"

SAMPLE=(--temperature 0.9 --top-k 64 --top-p 0.95 -n 8 --ignore-eos -p "10,20,30" -p 40)
expect_rc 0 "sample with seed 11" "$BIN" generate -m "$M" "${SAMPLE[@]}" --seed 11
sequences >"$T/s11a"
expect_rc 0 "sample with seed 11 again" "$BIN" generate -m "$M" "${SAMPLE[@]}" --seed 11
sequences >"$T/s11b"
cmp -s "$T/s11a" "$T/s11b" || fail "sampling with the same --seed differs between two runs"
pass "sampling with the same seed is reproducible"
expect_rc 0 "sample with seed 12" "$BIN" generate -m "$M" "${SAMPLE[@]}" --seed 12
sequences >"$T/s12"
if cmp -s "$T/s11a" "$T/s12"; then
  echo "   note: seeds 11 and 12 happened to sample the same tokens (allowed)"
else
  echo "   note: seeds 11 and 12 sample different tokens"
fi

expect_rc 0 "generate --dump-logits" "$BIN" generate -m "$M" -p 1,2,3 -p 4 -n 2 --dump-logits "$T/logits.npy"
[ -f "$T/logits.npy" ] || fail "--dump-logits wrote no file"
magic=$(head -c 6 "$T/logits.npy" | od -An -tx1 | tr -d ' \n')
[ "$magic" = "934e554d5059" ] || fail "logits file starts with $magic, not \\x93NUMPY"
pass "--dump-logits writes a .npy file (\\x93NUMPY)"

# ---------------------------------------------------------------------------
step "corruption"
CX=$T/corrupt-expert.colibri
cp "$M" "$CX"
expect_rc 0 "inspect --experts" "$BIN" inspect --experts "$CX"
off=$(awk '$1 == "layer" && $2 == 1 && $3 == "expert" && $4 == 2 && $5 == "offset" { print $6 }' "$T/out")
[ -n "$off" ] || fail "no offset for layer 1 expert 2 in inspect --experts"
if [ "$HAVE_PY" -eq 1 ]; then
  joff=$(python3 -c 'import json,sys
j = json.load(sys.stdin)
print([e["offset"] for e in j["experts"] if e["layer"] == 1 and e["expert"] == 2][0])' <"$T/inspect.json")
  [ "$joff" = "$off" ] || fail "inspect --json puts layer 1 expert 2 at $joff, the text output at $off"
  pass "text and JSON agree on the expert offset ($off)"
fi
flip_byte "$CX" $((off + 1000))
cmp -s "$M" "$CX" && fail "flipping a byte changed nothing"
expect_rc 0 "inspect without --verify does not read expert blocks" "$BIN" inspect "$CX"
expect_rc 14 "inspect --verify on a corrupted expert block" "$BIN" inspect --verify "$CX"
out_has "FAIL"
out_has "expert 2 of layer 1"
out_has "verify: FAILED"
[ "$(grep -c '^FAIL' "$T/out")" -eq 1 ] || fail "expected exactly one FAIL line"
pass "exactly one mismatch reported"

CD=$T/corrupt-dense.colibri
cp "$M" "$CD"
expect_rc 0 "inspect (tensor table)" "$BIN" inspect "$CD"
doff=$(awk '$1 == "blk.0.attn_q" { print $(NF-2) }' "$T/out")
[ -n "$doff" ] || fail "no offset for blk.0.attn_q in inspect output"
flip_byte "$CD" $((doff + 12))
expect_rc 14 "inspect --verify on a corrupted dense tensor" "$BIN" inspect --verify "$CD"
out_has "tensor 'blk.0.attn_q'"
expect_rc 14 "generate checks dense tensors at load" "$BIN" generate -m "$CD" -p 1,2 -n 1
err_has "checksum mismatch in tensor 'blk.0.attn_q'"

# ---------------------------------------------------------------------------
step "error exit codes"
mkdir -p "$T/llama"
cp "$HF/model.safetensors" "$T/llama/"
sed 's/MixtralForCausalLM/LlamaForCausalLM/' "$HF/config.json" >"$T/llama/config.json"
grep -q LlamaForCausalLM "$T/llama/config.json" || fail "could not rewrite the architecture"
expect_rc 15 "convert an unknown architecture" "$BIN" convert "$T/llama" "$T/llama.colibri"
err_has "LlamaForCausalLM"
err_has "MixtralForCausalLM"
[ ! -e "$T/llama.colibri" ] || fail "a failed convert left its output"
no_tmp "$T/llama.colibri"

expect_rc 12 "convert a missing input directory" "$BIN" convert "$T/no-such-dir" "$T/x.colibri"
err_has "no-such-dir"
[ ! -e "$T/x.colibri" ] || fail "a failed convert left its output"
no_tmp "$T/x.colibri"

mkdir -p "$T/outdir"
expect_rc 11 "convert onto an existing directory" "$BIN" convert "$HF" "$T/outdir"
err_has "is a directory"
[ -d "$T/outdir" ] || fail "the directory was replaced"
no_tmp "$T/outdir"
expect_rc 12 "convert into a missing directory" "$BIN" convert "$HF" "$T/no/such/dir/m.colibri"
no_tmp "$T/no/such/dir/m.colibri"

expect_rc 11 "convert with a bad --dtype" "$BIN" convert "$HF" "$T/y.colibri" --dtype int4
err_has "int4"
expect_rc 11 "convert without an output" "$BIN" convert "$HF"

expect_rc 11 "generate an out-of-range token id" "$BIN" generate -m "$M" -p 1,999,3 -n 1
err_has "token id 999"
expect_rc 11 "generate a negative token id" "$BIN" generate -m "$M" -p 1,-4 -n 1
err_has "token id -4"
expect_rc 11 "generate a token id that is not a number" "$BIN" generate -m "$M" -p 1,abc -n 1
err_has "'abc'"
long=$(printf '1%.0s,' $(seq 1 600))
expect_rc 11 "generate a prompt longer than the model's context" "$BIN" generate -m "$M" -p "${long%,}" -n 1
err_has "exceed the context"
expect_rc 11 "generate a prompt longer than --max-context" "$BIN" generate -m "$M" -p 1,2,3,4,5 -n 1 --max-context 4
err_has "exceed the context of 4 positions"
expect_rc 11 "generate with --top-p 1.5" "$BIN" generate -m "$M" -p 1,2 --temperature 1 --top-p 1.5
err_has "top-p"
expect_rc 11 "generate with --top-p 0" "$BIN" generate -m "$M" -p 1,2 --top-p 0
err_has "top-p"
expect_rc 11 "generate without --model" "$BIN" generate -p 1,2
expect_rc 11 "generate without --prompt-ids" "$BIN" generate -m "$M"
expect_rc 12 "generate a missing model file" "$BIN" generate -m "$T/absent.colibri" -p 1
err_has "absent.colibri"

head -c 100000 "$M" >"$T/truncated.colibri"
expect_rc 13 "generate a truncated .colibri" "$BIN" generate -m "$T/truncated.colibri" -p 1,2 -n 1
err_has "truncated"
expect_rc 13 "inspect a truncated .colibri" "$BIN" inspect "$T/truncated.colibri"
expect_rc 13 "inspect a file that is not .colibri" "$BIN" inspect "$HF/model.safetensors"
err_has "bad magic"

# ---------------------------------------------------------------------------
step "reference fixtures"
nfix=0
for d in "$FIX"/*/; do
  [ -f "$d/hf/config.json" ] || continue
  name=$(basename "$d")
  nfix=$((nfix + 1))
  F=$T/fixture-$name.colibri
  expect_rc 0 "convert fixture $name" "$BIN" convert "$d/hf" "$F"
  expect_rc 0 "inspect --verify fixture $name" "$BIN" inspect --verify "$F"
  out_has "verify: ok"
  if [ "$HAVE_PY" -eq 1 ] && [ -f "$d/expected.json" ]; then
    # Greedy tokens for every reference prompt, as Hugging Face produced them.
    args=$(python3 -c 'import json,sys
e = json.load(open(sys.argv[1]))
print(" ".join("-p " + ",".join(map(str, p)) for p in e["prompts"]), "-n", e["num_new_tokens"])' "$d/expected.json")
    python3 -c 'import json,sys
e = json.load(open(sys.argv[1]))
for i, t in enumerate(e["greedy_tokens"]): print("sequence %d: %s" % (i, ",".join(map(str, t))))' \
      "$d/expected.json" >"$T/want"
    # shellcheck disable=SC2086
    expect_rc 0 "generate fixture $name" "$BIN" generate -m "$F" $args --ignore-eos
    sequences >"$T/got"
    cmp -s "$T/want" "$T/got" || fail "fixture $name: greedy tokens differ from expected.json
want: $(cat "$T/want")
got:  $(cat "$T/got")"
    pass "fixture $name: greedy tokens match Hugging Face"
  fi
done
if [ "$nfix" -eq 0 ]; then echo "   skip: no fixtures under $FIX"; fi
if [ "$HAVE_PY" -eq 0 ]; then echo "   skip: python3 not found, fixture tokens not compared"; fi


step "routing trace, stats, placements, cache-sim, launch"
expect_rc 0 "generate --record-routing" "$BIN" generate -m "$M" -p 1,2,3,4,5 -p 9,8 -n 6 --ignore-eos --record-routing "$T/trace.jsonl"
[ -s "$T/trace.jsonl" ] && ! compgen -G "$T/trace.jsonl.tmp*" >/dev/null || fail "routing trace missing or left as .tmp"
pass "routing trace written"
expect_rc 0 "stats" "$BIN" stats "$T/trace.jsonl" --out "$T/stats.json"
[ -s "$T/stats.json" ] || fail "stats.json missing"
for pol in contiguous round_robin balanced replicated; do
  expect_rc 0 "place --policy $pol" "$BIN" place --model "$M" --ranks 3 --policy "$pol" --stats "$T/stats.json" --out "$T/p-$pol.json"
  out_has "balancedness"
done
expect_rc 11 "place balanced without stats" "$BIN" place --model "$M" --ranks 3 --policy balanced --out "$T/p.json"
expect_rc 12 "stats of a missing trace" "$BIN" stats "$T/nope.jsonl" --out "$T/s.json"
printf '{"format":"colibri-routing","version":1,"num_layers":2,"num_experts":4,"top_k":2}\n{"step":0,"layer":0\n' > "$T/bad.jsonl"
expect_rc 13 "stats of a malformed trace" "$BIN" stats "$T/bad.jsonl" --out "$T/s.json"
err_has "bad.jsonl:2"
expect_rc 0 "cache-sim on the recorded trace" "$BIN" cache-sim --trace "$T/trace.jsonl" --capacity 2
out_has "belady"
expect_rc 11 "run with a placement for another world size" "$BIN" run -m "$M" -p 1,2 --placement "$T/p-balanced.json"
err_has "3 ranks"
expect_rc 11 "run with an expert cache smaller than one expert" "$BIN" run -m "$M" -p 1,2 --expert-cache-bytes 100
err_has "smaller than one expert"
expect_rc 0 "launch --dry-run" "$BIN" launch -n 3 --dry-run -- run -m "$M" -p 1,2
out_has "--oversubscribe"
out_has "--bind-to none"
expect_rc 0 "launch --dry-run --ucx" "$BIN" launch -n 2 --ucx --dry-run -- run -m "$M" -p 1,2
out_has "--mca pml ucx --mca pml_ucx_tls any --mca pml_ucx_devices any"
expect_rc 11 "launch -n 0" "$BIN" launch -n 0 -- run -m "$M"
expect_rc 11 "launch without a command" "$BIN" launch -n 2

echo "cli_test: all $CHECKS checks passed"
