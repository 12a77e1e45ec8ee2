#!/usr/bin/env python3
"""batch_check.py: checks for tests/batch_test.sh (colibri batch, docs/batch.md).

  batch_check.py format RESULTS INPUT   every input line answered once, in the documented format
  batch_check.py generate RESULTS INPUT every result equals `colibri generate` of its request alone
                                        (env BIN: colibri, M: the model)
  batch_check.py same A B               A and B hold the same records (but `created`), each key once
"""
import json
import os
import subprocess
import sys


def load(path):
    data = open(path, "rb").read()
    assert data == b"" or data.endswith(b"\n"), f"{path}: the last line is torn"
    return [json.loads(l) for l in data.decode("utf-8").split("\n") if l.strip()]


def key(r):
    if r["custom_id"] is None:
        return ("line", r["error"]["line"])
    return (r["custom_id"], r["error"]["code"] if r["error"] and r["error"]["code"] == "duplicate_custom_id" else "")


def check_format(results, inp):
    recs = load(results)
    lines = [l for l in open(inp, encoding="utf-8") if l.strip()]
    assert len(recs) == len(lines), (len(recs), len(lines))
    keys = [key(r) for r in recs]
    assert len(set(keys)) == len(keys), "a request answered twice"
    for r in recs:
        assert list(r.keys()) == ["id", "custom_id", "response", "error"], r.keys()
        assert r["id"].startswith("batch_req_"), r["id"]
        if r["error"] is None:
            resp = r["response"]
            assert resp["status_code"] == 200 and resp["request_id"].startswith("req_"), resp
            b = resp["body"]
            assert b["object"] in ("text_completion", "chat.completion"), b
            assert b["id"].startswith("cmpl-" if b["object"] == "text_completion" else "chatcmpl-")
            assert isinstance(b["created"], int) and isinstance(b["model"], str)
            assert len(b["choices"]) == 1
            c = b["choices"][0]
            assert c["index"] == 0 and c["finish_reason"] in ("stop", "length"), c
            if b["object"] == "chat.completion":
                assert c["message"]["role"] == "assistant" and isinstance(c["message"]["content"], str), c
            else:
                assert isinstance(c["text"], str), c
            u = b["usage"]
            assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"], u
            if "token_ids" in c:
                assert len(c["token_ids"]) == u["completion_tokens"] and len(c["prompt_token_ids"]) == u["prompt_tokens"]
        else:
            e = r["error"]
            assert isinstance(e["code"], str) and isinstance(e["message"], str) and isinstance(e["line"], int), e
            if r["custom_id"] is None:
                assert r["response"] is None
            else:
                assert r["response"]["status_code"] == 400 and r["response"]["body"]["error"]["code"] == e["code"], r


def render_qwen2(msgs):
    # tests/fixtures/chat_templates/qwen2_moe.jinja with add_generation_prompt=True
    s = ""
    for i, m in enumerate(msgs):
        c = m["content"]
        if isinstance(c, list):
            c = "".join(p["text"] for p in c)
        if i == 0 and msgs[0]["role"] != "system":
            s += "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n"
        s += "<|im_start|>" + m["role"] + "\n" + c + "<|im_end|>\n"
    return s + "<|im_start|>assistant\n"


def check_generate(results, inp):
    bin_, model = os.environ["BIN"], os.environ["M"]
    reqs = {}
    for l in open(inp, encoding="utf-8"):
        try:
            j = json.loads(l)
            reqs.setdefault(j["custom_id"], j)
        except Exception:
            pass
    n = 0
    for r in load(results):
        if r["error"] is not None:
            continue
        q = reqs[r["custom_id"]]
        b = q["body"]
        chat = q["url"] == "/v1/chat/completions"
        cmd = [bin_, "generate", "-m", model, "-n", str(b.get("max_tokens", b.get("max_completion_tokens", 16))),
               "--temperature", str(b.get("temperature", 1.0)), "--top-p", str(b.get("top_p", 1.0)),
               "--top-k", str(b.get("top_k", 0)), "--seed", str(b.get("seed", 0)), "--threads", "1"]
        if b.get("ignore_eos"):
            cmd.append("--ignore-eos")
        ids_prompt = False
        if chat:
            cmd += ["--prompt", render_qwen2(b["messages"]), "--no-special", "--print-ids"]
        elif isinstance(b["prompt"], list):
            ids_prompt = True
            cmd += ["--prompt-ids", ",".join(map(str, b["prompt"]))]
        else:
            cmd += ["--prompt", b["prompt"], "--print-ids"]
        stop = b.get("stop")
        for s in ([stop] if isinstance(stop, str) else stop or []):
            cmd += ["--stop", s]
        p = subprocess.run(cmd, capture_output=True)
        assert p.returncode == 0, (cmd, p.stderr.decode())
        out = p.stdout.decode("utf-8")
        at = out.rfind("sequence 0: ")
        ids = [int(x) for x in out[at + len("sequence 0: "):].split("\n")[0].strip().split(",") if x]
        c = r["response"]["body"]["choices"][0]
        assert c["token_ids"] == ids, (r["custom_id"], c["token_ids"], ids)
        if not ids_prompt:
            text = out[:at]
            assert text.endswith("\n")
            text = text[:-1]
            got = c["message"]["content"] if chat else c["text"]
            assert got == text, (r["custom_id"], got, text)
            err = p.stderr.decode()
            fr = err[err.index("finish_reason ") + len("finish_reason "):].split()[0]
            fr = {"eos": "stop", "stop": "stop", "length": "length"}[fr]
            assert c["finish_reason"] == fr, (r["custom_id"], c["finish_reason"], fr)
            u = r["response"]["body"]["usage"]
            assert f"{u['prompt_tokens']} prompt tokens" in err, (r["custom_id"], u, err)
        n += 1
    assert n > 0
    print(f"   {n} results equal generate alone")


def check_same(a, b):
    ra, rb = load(a), load(b)
    da, db = {}, {}
    for rs, d in ((ra, da), (rb, db)):
        for r in rs:
            if r["response"] and r["response"].get("body") and "created" in r["response"]["body"]:
                del r["response"]["body"]["created"]
            k = key(r)
            assert k not in d, f"{k} twice"
            d[k] = r
    assert da.keys() == db.keys(), set(da.keys()) ^ set(db.keys())
    for k in da:
        assert da[k] == db[k], (k, da[k], db[k])


if __name__ == "__main__":
    mode = sys.argv[1]
    {"format": check_format, "generate": check_generate, "same": check_same}[mode](*sys.argv[2:])
