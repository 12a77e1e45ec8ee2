#!/usr/bin/env bash
# text_test.sh: text in, text out. A synthetic qwen3_moe model (vocab 512) with
# the tokenizer fixtures (tests/fixtures/tokenizers) converted in: inspect shows
# the tokenizer, generate --prompt streams text, --stop, a batch, --prompt-file,
# EOS ids from generation_config.json, the errors (no tokenizer, a tokenizer
# larger than the vocabulary, a corrupted tokenizer block, a prompt longer than
# the context), and `colibri run --prompt` under mpirun -np 2 printing the same.
# usage: text_test.sh COLIBRI FIXTURES_DIR
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: $0 <path-to-colibri> <fixtures-dir>" >&2; exit 2; }
BIN=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
FX=$2/tokenizers
T=$(mktemp -d "${TMPDIR:-/tmp}/colibri-text.XXXXXX")
trap 'rm -rf "$T"' EXIT
source "$(dirname "$0")/cli_lib.sh"
command -v python3 >/dev/null || { echo "SKIP: needs python3" >&2; exit 77; }
[ -f "$FX/qwen2_bpe/tokenizer.json" ] || { echo "SKIP: no tokenizer fixtures in $FX" >&2; exit 77; }

# text OUT: stdout of a single-sequence text run without the newline generate adds.
text_of() { python3 -c 'import sys; d=open(sys.argv[1],"rb").read(); assert d.endswith(b"\n"); sys.stdout.buffer.write(d[:-1])' "$1"; }

step "convert with a tokenizer"
"$BIN" synth --arch qwen3_moe --preset tiny --out "$T/hf" --log-level warn
cp -r "$T/hf" "$T/hf_plain"
cp "$FX/qwen2_bpe/tokenizer.json" "$FX/qwen2_bpe/tokenizer_config.json" "$T/hf/"
M=$T/m.colibri
expect_rc 0 "convert (tokenizer.json)" "$BIN" convert "$T/hf" "$M"
err_has "tokenizer hf_json"
expect_rc 0 "inspect" "$BIN" inspect "$M"
out_has "tokenizer   hf_json, vocab 480"
expect_rc 0 "inspect --verify" "$BIN" inspect --verify "$M"
out_has "verify: ok"
out_has ", tokenizer,"
expect_rc 0 "inspect --json" "$BIN" inspect --json "$M"
python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); t=j["tokenizer"]; assert t["kind"]=="hf_json" and t["vocab_size"]==480, t; assert j["config"]["tokenizer"]["kind"]=="hf_json"' "$T/out" \
  || fail "inspect --json lacks the tokenizer"
pass "inspect --json shows kind hf_json, vocab 480"

P=$T/plain.colibri
expect_rc 0 "convert without a tokenizer" "$BIN" convert "$T/hf_plain" "$P"
expect_rc 0 "inspect (no tokenizer)" "$BIN" inspect "$P"
out_has "tokenizer   none"
NT=$T/notok.colibri
expect_rc 0 "convert --no-tokenizer" "$BIN" convert "$T/hf" "$NT" --no-tokenizer
cmp -s "$P" "$NT" || fail "--no-tokenizer should give the same bytes as a checkpoint without one"
pass "--no-tokenizer equals no tokenizer, byte for byte"

# ---------------------------------------------------------------------------
step "generate --prompt"
G=(generate -m "$M" -n 24 --ignore-eos)
expect_rc 0 "one prompt, streamed" "$BIN" "${G[@]}" --prompt "Hello, world!"
cp "$T/out" "$T/one.txt"
python3 -c 'import sys; open(sys.argv[1],"rb").read().decode("utf-8")' "$T/one.txt" || fail "output is not valid UTF-8"
grep -q '^sequence' "$T/one.txt" && fail "text output should not carry id lines without --print-ids"
err_has "prefill:"
err_has "finish_reason length"
pass "valid UTF-8 text on stdout, the report on stderr"
expect_rc 0 "--print-ids" "$BIN" "${G[@]}" --prompt "Hello, world!" --print-ids
out_has "sequence 0: "
[ "$(grep -c '^sequence 0: ' "$T/out")" -eq 1 ] || fail "one id line expected"
ids=$(grep '^sequence 0: ' "$T/out" | cut -d' ' -f3)
[ "$(echo "$ids" | tr ',' '\n' | wc -l)" -eq 24 ] || fail "24 ids expected: $ids"
pass "24 ids"

printf 'Hello, world!' >"$T/prompt.txt"
expect_rc 0 "--prompt-file" "$BIN" "${G[@]}" --prompt-file "$T/prompt.txt"
cmp -s "$T/out" "$T/one.txt" || fail "--prompt-file gave other text than --prompt"
pass "--prompt-file = --prompt"

expect_rc 0 "--no-special" "$BIN" "${G[@]}" --prompt "Hello, world!" --no-special
err_has "sequence 0: 9 prompt tokens"

expect_rc 0 "a batch of two" "$BIN" "${G[@]}" --prompt "Hello, world!" --prompt "Привет, мир 123"
[ "$(grep -c '^\[[01]\] ' "$T/out")" -ge 2 ] || fail "expected '[0] ' and '[1] ' lines"
python3 - "$T/out" "$T/one.txt" <<'EOF' || fail "batch sequence 0 differs from the single run"
import sys
out = open(sys.argv[1], "rb").read(); one = open(sys.argv[2], "rb").read()
assert out.startswith(b"[0] " + one) or (b"[0] " + one) in out, (out, one)
EOF
pass "two sequences; sequence 0's text equals the single run's"

# --stop: the text up to (not including) the first occurrence, finish_reason stop.
text_of "$T/one.txt" >"$T/full"
stop=$(python3 - "$T/full" <<'EOF'
import sys
t = open(sys.argv[1], "rb").read().decode("utf-8")
for k in range(len(t) // 2, len(t) - 2):
    s = t[k:k + 2]
    if s.strip() and "\n" not in s and "\ufffd" not in s:
        print(s, end=""); break
EOF
)
[ -n "$stop" ] || fail "found no stop string in the generated text"
expect_rc 0 "--stop '$stop'" "$BIN" "${G[@]}" --prompt "Hello, world!" --stop "$stop" --stop "never-generated-string"
err_has "finish_reason stop"
python3 - "$T/full" "$T/out" "$stop" <<'EOF' || fail "--stop output is not the text before the stop string"
import sys
full = open(sys.argv[1], "rb").read().decode("utf-8"); got = open(sys.argv[2], "rb").read().decode("utf-8")
stop = sys.argv[3]
want = full[:full.index(stop)] + "\n"
assert got == want, (got, want)
EOF
pass "--stop prints the text before '$stop'"
expect_rc 11 "--stop with --prompt-ids" "$BIN" generate -m "$M" -p 1,2 --stop x
expect_rc 11 "an empty --stop" "$BIN" "${G[@]}" --prompt hi --stop ""

# EOS: generation_config.json names the 4th generated token (first seen there).
EOSID=$(python3 -c 'import sys
ids = [int(x) for x in sys.argv[1].split(",")]
print(next(t for i, t in enumerate(ids) if i >= 3 and t not in ids[:i]))' "$ids")
cp -r "$T/hf" "$T/hf_eos"
echo "{\"eos_token_id\": [$EOSID, 2]}" >"$T/hf_eos/generation_config.json"
ME=$T/eos.colibri
expect_rc 0 "convert with generation_config.json" "$BIN" convert "$T/hf_eos" "$ME"
expect_rc 0 "inspect shows the eos ids" "$BIN" inspect "$ME"
out_has "$EOSID"
expect_rc 0 "generate stops at the EOS id" "$BIN" generate -m "$ME" -n 24 --prompt "Hello, world!" --print-ids
err_has "finish_reason eos"
got=$(grep '^sequence 0: ' "$T/out" | cut -d' ' -f3)
case "$ids" in "$got"*) ;; *) fail "EOS run's ids $got are not a prefix of $ids" ;; esac
[ "${got##*,}" = "$EOSID" ] || fail "EOS run should end with $EOSID: $got"
pass "stops at $EOSID (generation_config.json)"
expect_rc 0 "--ignore-eos goes on" "$BIN" generate -m "$ME" -n 24 --prompt "Hello, world!" --ignore-eos --print-ids
out_has "sequence 0: $ids"

# ---------------------------------------------------------------------------
step "errors"
expect_rc 11 "--prompt on a model without a tokenizer" "$BIN" generate -m "$P" --prompt "Hello"
err_has "has no embedded tokenizer"
expect_rc 11 "--prompt and --prompt-ids together" "$BIN" generate -m "$M" --prompt "Hello" -p 1,2
expect_rc 12 "a missing --prompt-file" "$BIN" generate -m "$M" --prompt-file "$T/nope.txt"
python3 -c 'print("word " * 2000)' >"$T/long.txt"
expect_rc 11 "a prompt longer than the context" "$BIN" generate -m "$M" --prompt-file "$T/long.txt"
err_has "exceed the context"

cp -r "$T/hf_plain" "$T/hf_big"
python3 - "$FX/qwen2_bpe/tokenizer.json" "$T/hf_big/tokenizer.json" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1]))
j["added_tokens"].append({"id": 600, "content": "<|beyond|>", "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True})
json.dump(j, open(sys.argv[2], "w"))
EOF
expect_rc 13 "convert refuses a tokenizer with ids past vocab_size" "$BIN" convert "$T/hf_big" "$T/big.colibri"
err_has "vocab_size is 512"
[ ! -e "$T/big.colibri" ] && ! compgen -G "$T/big.colibri.tmp*" >/dev/null || fail "a refused conversion left a file"
expect_rc 0 "--no-tokenizer converts it" "$BIN" convert "$T/hf_big" "$T/big.colibri" --no-tokenizer

C=$T/corrupt.colibri
cp "$M" "$C"
off=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["tokenizer"]["offset"])' <("$BIN" inspect --json "$M"))
python3 - "$C" $((off + 100)) <<'EOF'
import sys
with open(sys.argv[1], "r+b") as f:
    f.seek(int(sys.argv[2])); b = f.read(1); f.seek(int(sys.argv[2])); f.write(bytes([b[0] ^ 0xFF]))
EOF
expect_rc 14 "inspect --verify on a corrupted tokenizer block" "$BIN" inspect --verify "$C"
out_has "tensor 'tokenizer'"
expect_rc 14 "generate checks the tokenizer block" "$BIN" generate -m "$C" --prompt "Hello"
err_has "checksum mismatch in tensor 'tokenizer'"

# ---------------------------------------------------------------------------
step "SentencePiece (tokenizer.model)"
# The llama_spm fixture has 600 ids: more than the tiny preset's 512 (refused),
# and end to end with a Mixtral synthesized with --vocab 640.
if [ -f "$FX/llama_spm/tokenizer.model" ]; then
  cp -r "$T/hf_plain" "$T/hf_spm"
  cp "$FX/llama_spm/tokenizer.model" "$FX/llama_spm/tokenizer_config.json" "$T/hf_spm/"
  expect_rc 13 "convert refuses tokenizer.model with 600 ids for vocab 512" "$BIN" convert "$T/hf_spm" "$T/spm.colibri"
  err_has "tokenizer.model: the tokenizer has 600 ids"
  [ -e "$T/spm.colibri" ] && fail "a refused conversion left a file"
  "$BIN" synth --arch mixtral --preset tiny --vocab 640 --out "$T/hf_spm640" --log-level warn
  cp "$FX/llama_spm/tokenizer.model" "$FX/llama_spm/tokenizer_config.json" "$T/hf_spm640/"
  S=$T/spm640.colibri
  expect_rc 0 "convert (tokenizer.model, vocab 640)" "$BIN" convert "$T/hf_spm640" "$S"
  expect_rc 0 "inspect" "$BIN" inspect "$S"
  out_has "tokenizer   sentencepiece, vocab 600"
  # transformers: "Hello, world!" is 10 ids with <s> (expected.json), 9 without.
  expect_rc 0 "generate --prompt (sentencepiece)" "$BIN" generate -m "$S" -n 16 --ignore-eos --prompt "Hello, world!"
  err_has "sequence 0: 10 prompt tokens"
  python3 -c 'import sys; open(sys.argv[1],"rb").read().decode("utf-8")' "$T/out" || fail "output is not valid UTF-8"
  pass "valid UTF-8 text"
  expect_rc 0 "--no-special (sentencepiece)" "$BIN" generate -m "$S" -n 4 --ignore-eos --prompt "Hello, world!" --no-special
  err_has "sequence 0: 9 prompt tokens"
fi

# ---------------------------------------------------------------------------
step "colibri run --prompt under mpirun -np 2"
if command -v mpirun >/dev/null; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_WAIT_POLICY=passive
  expect_rc 0 "mpirun -np 2 colibri run --prompt" mpirun --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 \
    --mca btl self,vader,tcp -np 2 "$BIN" run "${G[@]:1}" --prompt "Hello, world!" --log-level warn
  cmp -s "$T/out" "$T/one.txt" || fail "the cluster printed other text than generate"
  pass "same text as generate"
else
  echo "   (mpirun not found: skipped)"
fi

echo "text_test: all $CHECKS checks passed"
