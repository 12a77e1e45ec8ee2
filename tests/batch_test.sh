#!/usr/bin/env bash
# batch_test.sh: colibri batch (docs/batch.md) end to end on a tiny synthetic
# qwen3_moe model with a tokenizer and a chat template: completions and chat
# lines equal to `colibri generate` of each request alone (greedy, sampled with
# seeds, stop strings, EOS), the output format, bad lines as error records (exit
# 0 with the count), resume after kill -9 (each custom_id once, no torn line,
# results equal to an uninterrupted run), the progress line on a terminal, a
# SIGTERM, mpirun -np 2 equal to one process, and the exit codes of bad arguments.
# usage: batch_test.sh COLIBRI [FIXTURES_DIR]
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 <path-to-colibri> [fixtures-dir]" >&2; exit 2; }
BIN=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
HERE=$(cd "$(dirname "$0")" && pwd)
FX=${2:-$HERE/fixtures}
T=$(mktemp -d "${TMPDIR:-/tmp}/colibri-batch.XXXXXX")
trap 'rm -rf "$T"' EXIT
source "$HERE/cli_lib.sh"
command -v python3 >/dev/null || { echo "SKIP: needs python3" >&2; exit 77; }
[ -f "$FX/tokenizers/qwen2_bpe/tokenizer.json" ] || { echo "SKIP: no tokenizer fixtures in $FX" >&2; exit 77; }
export BIN T

step "a tiny model with a tokenizer and a chat template"
"$BIN" synth --arch qwen3_moe --preset tiny --out "$T/hf" --log-level warn
cp "$FX/tokenizers/qwen2_bpe/tokenizer.json" "$T/hf/"
python3 - "$FX/tokenizers/qwen2_bpe/tokenizer_config.json" "$FX/chat_templates/qwen2_moe.jinja" "$T/hf/tokenizer_config.json" <<'EOF'
import json, sys
c = json.load(open(sys.argv[1]))
c["chat_template"] = open(sys.argv[2]).read()
json.dump(c, open(sys.argv[3], "w"))
EOF
M=$T/m.colibri
export M
expect_rc 0 "convert" "$BIN" convert "$T/hf" "$M" --log-level warn
expect_rc 0 "inspect shows the chat template" "$BIN" inspect "$M"
out_has "chat        template"

# ---------------------------------------------------------------------------
step "completions and chat lines equal generate of each request alone"
# A stop string that occurs in the greedy text of one prompt.
expect_rc 0 "generate (for a stop string)" "$BIN" generate -m "$M" --prompt "The quick brown fox" -n 16 --ignore-eos
STOP=$(python3 -c 'import sys; t=open(sys.argv[1],"rb").read().decode(); t=t.rstrip("\n"); print(t[len(t)//2:len(t)//2+2], end="")' "$T/out")
[ -n "$STOP" ] || fail "no text to take a stop string from"
export STOP
python3 - "$T/req.jsonl" <<'EOF'
import json, os, sys
stop = os.environ["STOP"]
L = []
def c(cid, body, url="/v1/completions"):
    L.append(json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body}))
c("greedy", {"model": "m", "prompt": "Hello, world!", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True})
c("sampled", {"prompt": "Hello, world!", "max_tokens": 10, "temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 7, "ignore_eos": True, "return_token_ids": True})
c("sampled2", {"prompt": "Привет, мир 123", "max_tokens": 14, "temperature": 1.2, "seed": 12345, "ignore_eos": True, "return_token_ids": True})
c("ids", {"prompt": [5, 17, 99, 3, 250], "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True})
c("stop", {"prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stop": [stop], "return_token_ids": True})
c("eos", {"prompt": "a b c", "max_tokens": 40, "temperature": 0.9, "seed": 1, "return_token_ids": True})
c("chat", {"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 10, "temperature": 0, "ignore_eos": True, "return_token_ids": True}, "/v1/chat/completions")
c("chat-sampled", {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Tell me"}, {"type": "text", "text": " a story"}]}],
                   "max_completion_tokens": 9, "temperature": 1.0, "seed": 3, "ignore_eos": True, "return_token_ids": True}, "/v1/chat/completions")
# Bad lines.
L.append('{"custom_id": "broken", "method": "POST", "url": ')
c("unknown-field", {"prompt": "x", "frequency_penalty": 0.5})
c("unknown-url", {"input": "x"}, "/v1/embeddings")
c("too-long", {"prompt": list(range(1, 200)), "max_tokens": 4})
c("n2", {"prompt": "x", "n": 2})
c("empty", {"prompt": ""})
c("greedy", {"prompt": "again"})
L.append(json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}))
c("no-template-needed", {"prompt": "x", "max_tokens": 2, "temperature": 0}, "/v1/chat/completions")
open(sys.argv[1], "w").write("\n".join(L) + "\n")
EOF
B=(batch -m "$M" --max-context 128 --max-running 3 --max-step-tokens 7 --threads 1)
expect_rc 0 "batch with 9 bad lines" "$BIN" "${B[@]}" --input "$T/req.jsonl" --output "$T/res.jsonl"
err_has "8 requests done"
err_has "9 errors"
python3 "$HERE/batch_check.py" format "$T/res.jsonl" "$T/req.jsonl" || fail "the results are not in the documented format"
pass "every line answered once, in the OpenAI Batch format"
python3 "$HERE/batch_check.py" generate "$T/res.jsonl" "$T/req.jsonl" || fail "a result differs from generate alone"
pass "every result equals colibri generate of the request alone (ids, text, finish_reason)"
python3 - "$T/res.jsonl" <<'EOF' || fail "bad lines: wrong error records"
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
err = {}
for r in recs:
    if r["error"] is not None:
        err[(r["custom_id"], r["error"].get("line"))] = r
codes = {k[0]: v["error"]["code"] for k, v in err.items()}
want = {None: None, "unknown-field": "unknown_field", "unknown-url": "invalid_url", "too-long": "context_length_exceeded",
        "n2": "invalid_value", "empty": "invalid_value", "greedy": "duplicate_custom_id", "no-template-needed": "unknown_field"}
for k, v in want.items():
    assert k in codes, (k, codes)
    if v: assert codes[k] == v, (k, codes[k], v)
assert sum(1 for k in err if k[0] is None) == 2, err.keys()
assert "frequency_penalty" in err[("unknown-field", 10)]["error"]["message"]
assert err[("unknown-field", 10)]["response"]["status_code"] == 400
assert [r for r in recs if r["custom_id"] is None][0]["response"] is None
EOF
pass "invalid JSON, unknown field, unknown url, too long, n=2, empty prompt, duplicate, no custom_id: error records"

# ---------------------------------------------------------------------------
step "resume after kill -9"
python3 - "$T/big.jsonl" <<'EOF'
import json, random, sys
r = random.Random(5)
words = "alpha beta gamma delta one two three red green blue cat dog sun moon".split()
with open(sys.argv[1], "w") as f:
    for i in range(200):
        body = {"prompt": " ".join(r.choice(words) for _ in range(r.randint(1, 12))), "max_tokens": r.randint(4, 24),
                "ignore_eos": i % 3 != 0, "temperature": 0 if i % 2 else 0.7, "seed": i}
        url = "/v1/completions"
        if i % 5 == 0:
            url = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
        f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": url, "body": body}) + "\n")
EOF
BB=(batch -m "$M" --max-context 128 --max-running 4 --threads 1 --input "$T/big.jsonl")
expect_rc 0 "uninterrupted run of 200" "$BIN" "${BB[@]}" --output "$T/ref.jsonl"
err_has "200 requests done"
"$BIN" "${BB[@]}" --output "$T/killed.jsonl" >"$T/k.out" 2>"$T/k.err" &
pid=$!
for _ in $(seq 1 600); do
  [ -f "$T/killed.jsonl" ] && [ "$(wc -l <"$T/killed.jsonl")" -ge 40 ] && break
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.05
done
kill -9 "$pid" 2>/dev/null || fail "the run ended before it could be killed (make the input larger)"
wait "$pid" 2>/dev/null || true
n1=$(wc -l <"$T/killed.jsonl")
[ "$n1" -lt 200 ] || fail "killed run wrote every result"
printf '{"id": "batch_req_torn", "custom_id": "r19' >>"$T/killed.jsonl"  # a torn last line, as a kill mid-write leaves
pass "killed with $n1 results written (and a torn line appended)"
expect_rc 0 "rerun on the same output" "$BIN" "${BB[@]}" --output "$T/killed.jsonl"
err_has "skipped"
err_has "torn last line"
grep -qF "$n1 skipped" "$T/err" || fail "expected '$n1 skipped'"
python3 "$HERE/batch_check.py" same "$T/killed.jsonl" "$T/ref.jsonl" || fail "resumed results differ from the uninterrupted run"
pass "every custom_id exactly once, no torn line, equal to the uninterrupted run"
expect_rc 0 "a third run skips everything" "$BIN" "${BB[@]}" --output "$T/killed.jsonl"
err_has "0 requests done, 200 skipped"

if command -v script >/dev/null; then
  # On a terminal: the progress line (done / total, tokens/s, ETA) before the summary.
  script -qec "$(printf '%q ' "$BIN" "${BB[@]}" --output "$T/tty.jsonl" --log-level warn)" /dev/null >"$T/tty.out" 2>&1 </dev/null ||
    fail "colibri batch on a terminal failed: $(tail -n 5 "$T/tty.out")"
  tr '\r' '\n' <"$T/tty.out" | grep -qE '^batch: [0-9]+ / 200 requests, [0-9]+ running, [0-9.]+ tokens/s, ETA ' ||
    fail "no progress line on a terminal: $(tail -n 5 "$T/tty.out")"
  grep -q "Progress\|/ 200 requests" "$T/err" && fail "a progress line on stderr that is not a terminal"
  pass "a progress line on a terminal, none otherwise"
fi

# ---------------------------------------------------------------------------
step "SIGTERM: stops admitting, drops the requests in flight, exit 143"
"$BIN" "${BB[@]}" --output "$T/term.jsonl" >"$T/t.out" 2>"$T/t.err" &
pid=$!
for _ in $(seq 1 600); do
  [ -f "$T/term.jsonl" ] && [ "$(wc -l <"$T/term.jsonl")" -ge 20 ] && break
  sleep 0.05
done
kill -TERM "$pid"
set +e
wait "$pid"
rc=$?
set -e
[ "$rc" -eq 143 ] || { cat "$T/t.err" >&2; fail "SIGTERM: exit $rc, expected 143"; }
grep -qF "interrupted by SIGTERM" "$T/t.err" || fail "no interruption message"
expect_rc 0 "rerun after SIGTERM" "$BIN" "${BB[@]}" --output "$T/term.jsonl"
python3 "$HERE/batch_check.py" same "$T/term.jsonl" "$T/ref.jsonl" || fail "results after SIGTERM + rerun differ"
pass "interrupted and resumed: equal to the uninterrupted run"

# ---------------------------------------------------------------------------
step "mpirun -np 2 (expert workers) equals one process"
if command -v mpirun >/dev/null; then
  expect_rc 0 "mpirun -np 2 colibri batch" mpirun --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 -np 2 \
    "$BIN" "${B[@]}" --input "$T/req.jsonl" --output "$T/mpi.jsonl"
  python3 "$HERE/batch_check.py" same "$T/mpi.jsonl" "$T/res.jsonl" || fail "mpirun -np 2 results differ from one process"
  pass "2 ranks: the same results"
else
  echo "   (mpirun not found: skipped)"
fi

# ---------------------------------------------------------------------------
step "bad arguments"
expect_rc 11 "no --input" "$BIN" batch -m "$M" --output "$T/x.jsonl"
expect_rc 11 "no --output" "$BIN" batch -m "$M" --input "$T/req.jsonl"
expect_rc 12 "unreadable --input" "$BIN" batch -m "$M" --input "$T/nope.jsonl" --output "$T/x.jsonl"
mkdir "$T/dir"
expect_rc 11 "--output a directory" "$BIN" batch -m "$M" --input "$T/req.jsonl" --output "$T/dir"
expect_rc 11 "--output = --input" "$BIN" batch -m "$M" --input "$T/req.jsonl" --output "$T/req.jsonl"
expect_rc 11 "--max-running 0" "$BIN" batch -m "$M" --input "$T/req.jsonl" --output "$T/x.jsonl" --max-running 0
expect_rc 11 "--max-step-tokens 0" "$BIN" batch -m "$M" --input "$T/req.jsonl" --output "$T/x.jsonl" --max-step-tokens 0
for o in "--max-running 65537" "--max-step-tokens -1" "--max-context -1" "--kv-cache-mb -1" "--threads 100000"; do
  # shellcheck disable=SC2086  # the option and its value
  expect_rc 11 "$o" "$BIN" batch -m "$M" --input "$T/req.jsonl" --output "$T/x.jsonl" $o
  err_has "${o%% *}"
done
expect_rc 11 "--max-context past the model's" "$BIN" batch -m "$M" --input "$T/req.jsonl" --output "$T/x.jsonl" --max-context 16777216
err_has "positions"
[ ! -e "$T/x.jsonl" ] || fail "a refused run created its --output"
pass "refused runs create no output"
expect_rc 12 "missing model" "$BIN" batch -m "$T/none.colibri" --input "$T/req.jsonl" --output "$T/x.jsonl"
expect_rc 12 "output in a missing folder" "$BIN" batch -m "$M" --input "$T/req.jsonl" --output "$T/no/such/x.jsonl"
expect_rc 0 "--help" "$BIN" batch --help
out_has "--max-running"
out_has "--input"

echo "batch_test: all $CHECKS checks passed"
