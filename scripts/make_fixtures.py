#!/usr/bin/env python3
"""Generate the tiny Mixtral reference fixtures under tests/fixtures/.

Run by hand (it is not part of the build or of CI):

    pip install torch transformers safetensors numpy
    python3 scripts/make_fixtures.py            # all fixtures
    python3 scripts/make_fixtures.py mixtral_b  # only some

For every config below it builds a randomly initialised Hugging Face
``MixtralForCausalLM`` (float32, eager attention, eager experts), saves it with
``save_pretrained`` into ``tests/fixtures/<name>/hf/``, reloads it from disk and
records, for three random prompts (the RMSNorm gains, which HF initialises to 1,
are redrawn as 1 + N(0, 0.2^2) so that they matter):

* ``prompt_logits.<i>``  [L_i, V]: logits at every prompt position (one full
  forward pass, no KV cache);
* ``greedy_logits.<i>``  [16, V]: a 16-token greedy continuation, each step a
  full forward pass over the whole sequence so far (no KV cache); row j holds
  the logits of the last position when the sequence is prompt + j new tokens.

Seeds are searched (starting from a per-fixture base seed) until every greedy
step and every prompt position has a top1-top2 logit margin >= MIN_GREEDY_MARGIN and every router
decision (every token, every layer, prompts and greedy sequences) has a gap
between the k-th and (k+1)-th routing probability >= MIN_ROUTER_GAP, so that
an engine with float32 rounding differences cannot flip a token or an expert.

As a self-check, an independent plain-torch float64 implementation of the
Mixtral forward pass that reads the saved model.safetensors directly (the same
input the C++ engine gets) must agree with the HF logits.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import MixtralConfig, MixtralForCausalLM

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"

NUM_NEW_TOKENS = 16
PROMPT_LENGTHS = (5, 9, 13)
MIN_GREEDY_MARGIN = 5e-3  # stricter than the 1e-3 the tests need
MIN_ROUTER_GAP = 1e-4  # stricter than the 1e-5 the tests need
MAX_SEED_TRIES = 200
SELF_CHECK_TOL = 1e-5

COMMON = dict(
    hidden_act="silu",
    max_position_embeddings=128,
    attention_dropout=0.0,
    router_jitter_noise=0.0,
    bos_token_id=1,
    eos_token_id=2,
)

FIXTURE_SPECS = {
    "mixtral_a": dict(
        base_seed=1000,
        description=(
            "2 layers, hidden 64, intermediate 96, 4 heads / 2 kv heads (GQA ratio 2, head_dim "
            "derived = 16), 4 experts top-2, vocab 160, rope_theta 1e4, rms_norm_eps 1e-5, untied "
            "lm_head, no sliding window."
        ),
        config=dict(
            vocab_size=160,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=None,
            num_local_experts=4,
            num_experts_per_tok=2,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            sliding_window=None,
            initializer_range=0.15,
        ),
    ),
    "mixtral_b": dict(
        base_seed=2000,
        description=(
            "3 layers, hidden 48, intermediate 64, 6 heads / 1 kv head (MQA, ratio 6) with "
            "head_dim 8 (explicit, = hidden/heads), 6 experts top-1, vocab 128, rope_theta 1e6, "
            "rms_norm_eps 1e-6, untied lm_head, no sliding window."
        ),
        config=dict(
            vocab_size=128,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=1,
            head_dim=8,
            num_local_experts=6,
            num_experts_per_tok=1,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            sliding_window=None,
            initializer_range=0.15,
        ),
    ),
    "mixtral_c": dict(
        base_seed=3000,
        description=(
            "2 layers, hidden 32, intermediate 64, 4 heads x head_dim 16 (explicit; 4*16 = 64 != "
            "hidden 32) / 4 kv heads (no GQA), 8 experts top-2, vocab 128, rope_theta 1e4, "
            "rms_norm_eps 1e-5, sliding_window 6 (each query attends to itself and the 5 previous "
            "positions), tied word embeddings (no lm_head.weight in the checkpoint)."
        ),
        config=dict(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=16,
            num_local_experts=8,
            num_experts_per_tok=2,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            sliding_window=6,
            initializer_range=0.15,
        ),
    ),
}


def build_config(spec_cfg: dict) -> MixtralConfig:
    cfg = dict(COMMON)
    cfg.update(spec_cfg)
    return MixtralConfig(**cfg, attn_implementation="eager", experts_implementation="eager")


NORM_WEIGHT_STD = 0.2


@torch.no_grad()
def randomize_norm_weights(model: MixtralForCausalLM) -> None:
    """HF initialises every RMSNorm gain to exactly 1, which would let an engine that
    forgets to apply (or mis-indexes) the gains still pass. Draw them as 1 + N(0, 0.2^2)
    from the global RNG (seeded per try) so they matter."""
    for mod_name, mod in model.named_modules():
        if type(mod).__name__ == "MixtralRMSNorm":
            mod.weight.copy_(1.0 + NORM_WEIGHT_STD * torch.randn_like(mod.weight))


class RouterGapRecorder:
    """Forward hooks on every layer's router (mlp.gate) recording the smallest gap
    between the k-th and (k+1)-th softmax routing probability over all tokens."""

    def __init__(self, model: MixtralForCausalLM, top_k: int, num_experts: int):
        self.top_k = top_k
        self.num_experts = num_experts
        self.min_gap = math.inf
        self.handles = []
        for layer in model.model.layers:
            self.handles.append(layer.mlp.gate.register_forward_hook(self._hook))

    def _hook(self, module, inputs, output):
        router_logits = output[0] if isinstance(output, tuple) else output
        probs = torch.softmax(router_logits.float(), dim=-1)
        if self.top_k >= self.num_experts:
            return
        srt = torch.sort(probs, dim=-1, descending=True).values
        gap = (srt[:, self.top_k - 1] - srt[:, self.top_k]).min().item()
        self.min_gap = min(self.min_gap, gap)

    def reset(self):
        self.min_gap = math.inf

    def remove(self):
        for h in self.handles:
            h.remove()


def top2_margin(logits_row: torch.Tensor) -> float:
    v = torch.topk(logits_row, 2).values
    return float(v[0] - v[1])


@torch.no_grad()
def run_reference(model: MixtralForCausalLM, prompts: list[list[int]], recorder: RouterGapRecorder):
    prompt_logits, greedy_logits, greedy_tokens, greedy_margins = [], [], [], []
    recorder.reset()
    for ids in prompts:
        x = torch.tensor([ids], dtype=torch.long)
        prompt_logits.append(model(input_ids=x, use_cache=False).logits[0].float().clone())
    prompt_router_gap = recorder.min_gap

    recorder.reset()
    for ids in prompts:
        seq = list(ids)
        step_logits, toks, margins = [], [], []
        for _ in range(NUM_NEW_TOKENS):
            x = torch.tensor([seq], dtype=torch.long)
            last = model(input_ids=x, use_cache=False).logits[0, -1].float().clone()
            tok = int(torch.argmax(last))
            step_logits.append(last)
            toks.append(tok)
            margins.append(top2_margin(last))
            seq.append(tok)
        greedy_logits.append(torch.stack(step_logits))
        greedy_tokens.append(toks)
        greedy_margins.append(margins)
    greedy_router_gap = recorder.min_gap
    return dict(
        prompt_logits=prompt_logits,
        greedy_logits=greedy_logits,
        greedy_tokens=greedy_tokens,
        greedy_margins=greedy_margins,
        prompt_router_gap=prompt_router_gap,
        greedy_router_gap=greedy_router_gap,
    )


# ---------------------------------------------------------------------------
# Independent float64 reference reading the checkpoint exactly as saved on disk
# ---------------------------------------------------------------------------

def load_checkpoint(hf_dir: Path) -> tuple[dict, dict]:
    cfg = json.loads((hf_dir / "config.json").read_text())
    w = {}
    with safe_open(str(hf_dir / "model.safetensors"), framework="pt") as f:
        for k in f.keys():
            w[k] = f.get_tensor(k).to(torch.float64)
    return cfg, w


def manual_forward(cfg: dict, w: dict, ids: list[int]) -> torch.Tensor:
    """Plain Mixtral forward in the weights' dtype (float64 here): returns logits [L, V]."""
    H = cfg["hidden_size"]
    nh = cfg["num_attention_heads"]
    nkv = cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or H // nh
    eps = cfg["rms_norm_eps"]
    theta = cfg["rope_parameters"]["rope_theta"]
    E = cfg["num_local_experts"]
    k = cfg["num_experts_per_tok"]
    win = cfg.get("sliding_window")
    L = len(ids)

    def rms(x, g):
        return g * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))

    # RoPE, rotate-half (non-interleaved) convention.
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = torch.arange(L, dtype=torch.float64)[:, None] * inv_freq[None, :]  # [L, hd/2]
    dt = w["model.embed_tokens.weight"].dtype  # float64 for the self-check; float32 also works
    cos, sin = torch.cos(ang).to(dt), torch.sin(ang).to(dt)

    def rope(x):  # x: [heads, L, hd]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    allowed = torch.ones(L, L, dtype=torch.bool).tril()
    if win is not None:
        qi = torch.arange(L)[:, None]
        ki = torch.arange(L)[None, :]
        allowed &= ki > qi - win

    h = w["model.embed_tokens.weight"][torch.tensor(ids)]
    for li in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{li}."
        x = rms(h, w[p + "input_layernorm.weight"])
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(L, nh, hd).transpose(0, 1)
        kk = (x @ w[p + "self_attn.k_proj.weight"].T).view(L, nkv, hd).transpose(0, 1)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(L, nkv, hd).transpose(0, 1)
        q, kk = rope(q), rope(kk)
        rep = nh // nkv
        kk = kk.repeat_interleave(rep, dim=0)  # query head j uses kv head j // rep
        v = v.repeat_interleave(rep, dim=0)
        s = (q @ kk.transpose(1, 2)) / math.sqrt(hd)
        s = s.masked_fill(~allowed, -math.inf)
        a = torch.softmax(s, dim=-1) @ v  # [nh, L, hd]
        a = a.transpose(0, 1).reshape(L, nh * hd)
        h = h + a @ w[p + "self_attn.o_proj.weight"].T

        x = rms(h, w[p + "post_attention_layernorm.weight"])
        probs = torch.softmax(x @ w[p + "block_sparse_moe.gate.weight"].T, dim=-1)  # [L, E]
        topv, topi = torch.topk(probs, k, dim=-1)
        topv = topv / topv.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for t in range(L):
            for j in range(k):
                e = int(topi[t, j])
                pe = p + f"block_sparse_moe.experts.{e}."
                g = x[t] @ w[pe + "w1.weight"].T
                u = x[t] @ w[pe + "w3.weight"].T
                y = (torch.nn.functional.silu(g) * u) @ w[pe + "w2.weight"].T
                out[t] += topv[t, j] * y
        assert E >= k
        h = h + out
    h = rms(h, w["model.norm.weight"])
    head = w["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else w["lm_head.weight"]
    return h @ head.T


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.to(torch.float64)
    b = b.to(torch.float64)
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


@torch.no_grad()
def sliding_window_check(model: MixtralForCausalLM, ids: list[int], window: int) -> dict:
    """Compare the model with and without its sliding window on a prompt longer than
    the window: positions < window must be identical, later ones must differ."""
    x = torch.tensor([ids], dtype=torch.long)
    with_win = model(input_ids=x, use_cache=False).logits[0]
    saved = model.config.sliding_window
    model.config.sliding_window = None
    try:
        no_win = model(input_ids=x, use_cache=False).logits[0]
    finally:
        model.config.sliding_window = saved
    diff = (with_win - no_win).abs().amax(-1)
    return dict(
        max_abs_diff_before_window=float(diff[:window].max()),
        max_abs_diff_after_window=float(diff[window:].max()),
        # Before the window fills, both masks allow the same keys (differences are only
        # float rounding of the differently-built masks); afterwards every position must change.
        applied=bool(diff[:window].max() < 1e-5 and diff[window:].min() > 1e-3),
        min_abs_diff_after_window=float(diff[window:].min()),
    )


def make_fixture(name: str, spec: dict) -> dict:
    out_dir = FIXTURES / name
    hf_dir = out_dir / "hf"
    for seed in range(spec["base_seed"], spec["base_seed"] + MAX_SEED_TRIES):
        torch.manual_seed(seed)
        config = build_config(spec["config"])
        model = MixtralForCausalLM(config).to(torch.float32).eval()
        randomize_norm_weights(model)

        gen = torch.Generator().manual_seed(seed)
        prompts = [
            torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS
        ]
        recorder = RouterGapRecorder(model, config.num_experts_per_tok, config.num_local_experts)
        res = run_reference(model, prompts, recorder)
        recorder.remove()
        min_margin = min(min(m) for m in res["greedy_margins"])
        # Also keep the argmax of every prompt position unambiguous, in case a test compares it.
        min_prompt_margin = min(top2_margin(row) for t in res["prompt_logits"] for row in t)
        min_gap = min(res["prompt_router_gap"], res["greedy_router_gap"])
        finite = all(torch.isfinite(t).all() for t in res["prompt_logits"] + res["greedy_logits"])
        ok = (finite and min_margin >= MIN_GREEDY_MARGIN and min_prompt_margin >= MIN_GREEDY_MARGIN
              and min_gap >= MIN_ROUTER_GAP)
        print(f"[{name}] seed {seed}: min greedy margin {min_margin:.3e}, min prompt argmax margin "
              f"{min_prompt_margin:.3e}, min router gap {min_gap:.3e}"
              f"{'' if ok else '  -> rejected'}")
        if ok:
            break
    else:
        raise SystemExit(f"[{name}] no acceptable seed in {MAX_SEED_TRIES} tries")

    # Save, then reload from disk and compute everything from the reloaded model, so the
    # expected outputs are exactly those of the files the engine will read.
    if out_dir.exists():
        shutil.rmtree(out_dir)
    hf_dir.mkdir(parents=True)
    model.save_pretrained(str(hf_dir), safe_serialization=True)
    reloaded = MixtralForCausalLM.from_pretrained(
        str(hf_dir), dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), reloaded.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), f"round-trip mismatch on {n1}"
    recorder = RouterGapRecorder(reloaded, config.num_experts_per_tok, config.num_local_experts)
    res2 = run_reference(reloaded, prompts, recorder)
    recorder.remove()
    for a, b in zip(res["prompt_logits"] + res["greedy_logits"], res2["prompt_logits"] + res2["greedy_logits"]):
        assert torch.equal(a, b), "reloaded model gives different logits"
    assert res["greedy_tokens"] == res2["greedy_tokens"]

    # Independent float64 check against the saved checkpoint.
    ck_cfg, ck_w = load_checkpoint(hf_dir)
    worst = 0.0
    for i, ids in enumerate(prompts):
        ref = manual_forward(ck_cfg, ck_w, ids)
        for pos in range(len(ids)):
            worst = max(worst, rel_l2(res["prompt_logits"][i][pos], ref[pos]))
        full = ids + res["greedy_tokens"][i]
        ref = manual_forward(ck_cfg, ck_w, full)
        for j in range(NUM_NEW_TOKENS):
            worst = max(worst, rel_l2(res["greedy_logits"][i][j], ref[len(ids) - 1 + j]))
        assert ref[len(ids) - 1 :].argmax(-1)[:NUM_NEW_TOKENS].tolist() == res["greedy_tokens"][i]
    assert worst < SELF_CHECK_TOL, f"[{name}] float64 self-check rel L2 {worst:.3e}"
    print(f"[{name}] float64 self-check: worst per-position rel L2 vs HF float32 = {worst:.3e}")

    tensors = {}
    for i in range(len(prompts)):
        tensors[f"prompt_logits.{i}"] = res["prompt_logits"][i].to(torch.float32).contiguous()
        tensors[f"greedy_logits.{i}"] = res["greedy_logits"][i].to(torch.float32).contiguous()
    save_file(tensors, str(out_dir / "expected.safetensors"), metadata={"format": "pt"})

    prompt_margins = [
        min(top2_margin(row) for row in res["prompt_logits"][i]) for i in range(len(prompts))
    ]
    max_abs_logit = max(float(t.abs().max()) for t in res["prompt_logits"] + res["greedy_logits"])
    meta = dict(
        name=name,
        description=spec["description"],
        seed=seed,
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        initializer_range=spec["config"]["initializer_range"],
        norm_weight_init="1 + N(0, %g^2) (HF default is all ones)" % NORM_WEIGHT_STD,
        num_new_tokens=NUM_NEW_TOKENS,
        prompts=prompts,
        greedy_tokens=res["greedy_tokens"],
        greedy_margins=[[float(x) for x in m] for m in res["greedy_margins"]],
        min_greedy_margin=float(min(min(m) for m in res["greedy_margins"])),
        min_prompt_argmax_margin=float(min(prompt_margins)),
        min_router_gap=float(min(res["prompt_router_gap"], res["greedy_router_gap"])),
        min_router_gap_prompts=float(res["prompt_router_gap"]),
        min_router_gap_greedy=float(res["greedy_router_gap"]),
        max_abs_logit=max_abs_logit,
        float64_selfcheck_max_rel_l2=worst,
        notes=(
            "prompt_logits.<i> [L_i, V]: full forward of prompt i, no cache. greedy_logits.<i> "
            "[16, V]: row j = last-position logits of a full no-cache forward over prompt i + the "
            "first j greedy tokens; greedy_tokens[i][j] = argmax of that row. Router gaps are "
            "softmax-probability gaps between the k-th and (k+1)-th expert."
        ),
    )
    if config.sliding_window is not None:
        longest = max(prompts, key=len) + res["greedy_tokens"][prompts.index(max(prompts, key=len))]
        sw = sliding_window_check(reloaded, longest, config.sliding_window)
        meta["sliding_window"] = config.sliding_window
        meta["sliding_window_applied"] = sw["applied"]
        meta["sliding_window_check"] = sw
        print(f"[{name}] sliding window check: {sw}")
    (out_dir / "expected.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def main(argv: list[str]) -> None:
    torch.set_grad_enabled(False)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    names = argv or list(FIXTURE_SPECS)
    for name in names:
        make_fixture(name, FIXTURE_SPECS[name])
    total = sum(p.stat().st_size for p in FIXTURES.rglob("*") if p.is_file())
    print(f"tests/fixtures total size: {total / 1e6:.3f} MB")


if __name__ == "__main__":
    main(sys.argv[1:])
