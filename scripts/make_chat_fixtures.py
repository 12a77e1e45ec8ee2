#!/usr/bin/env python3
"""Render the chat templates of tests/fixtures/chat_templates/ as transformers does.

Run by hand (not part of the build or of CI); needs only jinja2 (3.1.x):

    python3 scripts/make_chat_fixtures.py           # rewrites cases.json
    python3 scripts/make_chat_fixtures.py --check   # compares, writes nothing

For every family's template (<family>.jinja, see the README there) and every
conversation below it renders ``apply_chat_template(messages, tokenize=False,
add_generation_prompt=..., **kwargs)`` the way transformers does, and stores the
inputs with Python's exact output (or the error message of raise_exception) in
``tests/fixtures/chat_templates/cases.json``; tests/test_chat_template.cpp renders
the same inputs with model/chat_template.h and wants byte-equal text.

The environment is the one of transformers' ``_compile_jinja_template``
(src/transformers/utils/chat_template_utils.py): ImmutableSandboxedEnvironment
with trim_blocks and lstrip_blocks, the loopcontrols extension, the
``{% generation %}`` tag (its AssistantTracker, here without the tracking), a ``tojson``
that does not escape HTML (json.dumps with ensure_ascii=False), and the
``raise_exception`` and ``strftime_now`` globals. The context is
``render_jinja_template``'s: messages, tools and documents (None when absent),
add_generation_prompt, the tokenizer's special tokens, then the kwargs.
strftime_now formats a fixed time (FIXED_TIME, in UTC), which the C++ test
passes as ChatTemplateOptions::fixed_time.
"""
import argparse
import datetime
import json
import pathlib
import sys

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROOT = pathlib.Path(__file__).resolve().parent.parent
DIR = ROOT / "tests" / "fixtures" / "chat_templates"
FIXED_TIME = 1736937000  # 2025-01-15 10:30:00 UTC


class TemplateError(Exception):
    pass


class GenerationTag(jinja2.ext.Extension):
    """transformers' AssistantTracker without the tracking: {% generation %} renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def make_env():
    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.fromtimestamp(FIXED_TIME, datetime.timezone.utc).strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


# The special tokens each family's tokenizer_config.json declares (transformers
# passes its special_tokens_map to the template).
SPECIAL = {
    "mixtral": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    "qwen2_moe": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "qwen3_moe": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "olmoe": {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|padding|>"},
    "deepseek_v2": {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"},
    "deepseek_v3": {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"},
    "glm4_moe": {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
    "gpt_oss": {"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>"},
}

SYS = {"role": "system", "content": "You are a helpful assistant."}
U1 = {"role": "user", "content": "Hello, who are you?"}
A1 = {"role": "assistant", "content": "I am an assistant. How can I help?"}
U2 = {"role": "user", "content": "Write a haiku about  spaces\tand\nnewlines."}
UNI = {"role": "user", "content": "Grüße! 你好，世界 🌍 — «quotes» \"double\" 'single' \\backslash </s> {{ not a tag }}"}
A_UNI = {"role": "assistant", "content": "Ça va ✓ ñ ü 日本語"}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city, e.g. Zürich"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
                "days": {"type": "integer", "description": "Forecast days"},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["city"],
        },
    },
}

BASIC = [
    ("system_user", [SYS, U1], True, {}),
    ("user_only", [U1], True, {}),
    ("multi_turn", [SYS, U1, A1, U2], True, {}),
    ("ends_with_assistant", [U1, A1], False, {}),
    ("unicode", [UNI, A_UNI, U1], True, {}),
    ("no_generation_prompt", [SYS, U1], False, {}),
]

# Family-specific conversations (tool calls, reasoning, template kwargs), shaped
# the way each template reads them.
EXTRA = {
    "mixtral": [
        ("user_assistant_user", [U1, A1, U2], False, {}),
    ],
    "qwen3_moe": [
        ("thinking_off", [U1], True, {"enable_thinking": False}),
        ("reasoning_content", [U1, {"role": "assistant", "content": "Hi!", "reasoning_content": "The user greets."}, U2], True, {}),
        ("think_in_content", [U1, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nHello."}], False, {}),
        ("tools", [SYS, {"role": "user", "content": "Weather in Paris?"},
                   {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
                   {"role": "tool", "content": "{\"temp\": 21}"},
                   {"role": "tool", "content": "sunny"}],
         True, {"tools": [WEATHER_TOOL]}),
    ],
    "deepseek_v3": [
        ("tool_calls", [SYS, {"role": "user", "content": "Weather in Paris and Rome?"},
                        {"role": "assistant", "content": None, "tool_calls": [
                            {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
                            {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]},
                        {"role": "tool", "content": "21C"},
                        {"role": "tool", "content": "25C"},
                        {"role": "assistant", "content": "Paris 21C, Rome 25C."}],
         True, {}),
        ("two_system_messages", [SYS, {"role": "system", "content": "Be brief."}, U1], True, {}),
    ],
    "glm4_moe": [
        ("thinking_off", [U1], True, {"enable_thinking": False}),
        ("reasoning_and_tools", [{"role": "user", "content": "Weather in Paris?"},
                                 {"role": "assistant", "content": "<think>Use the tool.</think>Checking.",
                                  "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2, "tags": ["a", "ü"]}}}]},
                                 {"role": "tool", "content": "{\"temp\": 21}"},
                                 {"role": "assistant", "content": "It is 21C.", "reasoning_content": "Read the result."}],
         True, {"tools": [WEATHER_TOOL]}),
        ("content_parts", [{"role": "user", "content": [{"type": "text", "text": "part one "}, {"type": "text", "text": "part two"}]}], True, {}),
    ],
    "gpt_oss": [
        ("reasoning_effort", [SYS, U1], True, {"reasoning_effort": "high", "model_identity": "You are a test model."}),
        ("builtin_and_tools", [{"role": "developer", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"},
                               {"role": "assistant", "thinking": "I should call the tool.", "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                               {"role": "tool", "content": "{\"temp\": 21}"},
                               {"role": "assistant", "content": "It is 21C."}],
         True, {"tools": [WEATHER_TOOL], "builtin_tools": ["browser", "python"]}),
        ("training_last_assistant", [U1, {"role": "assistant", "content": "Hello!", "thinking": "Greet back."}], False, {}),
    ],
}

# Cases that make the template call raise_exception (the C++ side wants the same message).
ERRORS = {
    "mixtral": [("system_not_supported", [SYS, U1], True, {}), ("roles_must_alternate", [U1, U2], True, {})],
    "gpt_oss": [("channel_tags_in_content", [U1, {"role": "assistant", "content": "<|channel|>final<|message|>x"}], False, {})],
}


def render(env, template, special, messages, add_generation_prompt, kwargs):
    compiled = env.from_string(template)
    ctx = dict(special)
    ctx.update(kwargs)
    tools = ctx.pop("tools", None)
    documents = ctx.pop("documents", None)
    return compiled.render(messages=messages, tools=tools, documents=documents,
                           add_generation_prompt=add_generation_prompt, **ctx)


def build():
    env = make_env()
    out = {"fixed_time": FIXED_TIME, "jinja2_version": jinja2.__version__, "cases": []}
    for family in SPECIAL:
        template = (DIR / f"{family}.jinja").read_text(encoding="utf-8")
        special = SPECIAL[family]
        todo = [(c, False) for c in BASIC + EXTRA.get(family, [])] + [(c, True) for c in ERRORS.get(family, [])]
        for (name, messages, gen, kwargs), want_error in todo:
            case = {"family": family, "name": name, "messages": messages, "add_generation_prompt": gen,
                    "special_tokens": special, "kwargs": kwargs}
            try:
                case["expected"] = render(env, template, special, messages, gen, kwargs)
            except TemplateError as e:
                case["error"] = str(e)
            # Mixtral's template refuses a system message, so its basic cases with one raise too.
            if want_error != ("error" in case) and not (family == "mixtral" and messages[0]["role"] == "system"):
                sys.exit(f"{family}/{name}: " + ("expected raise_exception" if want_error else case["error"]))
            out["cases"].append(case)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with cases.json instead of writing it")
    args = ap.parse_args()
    data = build()
    text = json.dumps(data, ensure_ascii=False, indent=1) + "\n"
    path = DIR / "cases.json"
    if args.check:
        if path.read_text(encoding="utf-8") != text:
            sys.exit(f"{path} differs from a fresh render")
        print(f"{path}: up to date ({len(data['cases'])} cases)")
        return
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path}: {len(data['cases'])} cases")


if __name__ == "__main__":
    main()
