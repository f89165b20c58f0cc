"""Hostile input at the HTTP edge: no request a client can send makes the server answer >= 500 or fall over.

Hypothesis draws a valid body per endpoint, then replaces one to three of its fields (top-level or nested:
a message's content, a tool's parameters, a logit_bias key, ...) with hostile values: integers far beyond
64 bits, NaN and infinities, JSON nested 65 to 5,000 deep, oversized strings and lists, lone surrogates,
special-token text, wrong types. Every answer must be < 500 and, when an error, an OpenAI-style error object;
afterwards the server is healthy, still serves a normal request, and /metrics has counted no 500.

The default case count keeps this under a minute; K3SERVE_FUZZ_CASES=5000 runs a long campaign.
"""

from __future__ import annotations

import copy
import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import API_KEY, MODEL, Server

CASES = int(os.environ.get("K3SERVE_FUZZ_CASES", "300"))
USER = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}


class Deep:
    """JSON nested `depth` levels, kept as text: json.dumps (and repr) of it would itself hit the recursion limit."""

    def __init__(self, depth: int, kind: str):
        self.depth, self.kind = depth, kind
        head, tail = {"list": ("[", "]"), "dict": ('{"a":', "}"),
                      "schema": ('{"type":"object","properties":{"x":', "}}")}[kind]
        self.text = head * depth + "1" + tail * depth

    def __repr__(self) -> str:
        return f"Deep({self.depth}, {self.kind!r})"


# one flat list: hypothesis then draws distinct (field, value) pairs instead of near-copies of earlier draws
HOSTILE = [
    2**31, 2**32, 2**53 + 1, 2**63, 2**64, -(2**63) - 1, -(2**64), 2**200, -(10**300), 10**4000, -1, 0, 2**31 - 1,
    float("nan"), float("inf"), float("-inf"), 1e308, -1e308, 1.5, 5e-324,
    Deep(65, "list"), Deep(200, "schema"), Deep(900, "schema"), Deep(900, "dict"), Deep(5000, "list"),
    Deep(100_000, "list"),
    "a" * 200_000, "\ud800", "x\x00y", "<|end_of_msg|>", "<|im_end|>", "", " " * 10_000, "1", "none",
    [0] * 10_000, ["a"] * 1000, [2**64] * 100, [None] * 100, [{}] * 100,
    None, True, False, [], {}, [[]], {"": None}, {"type": "object"},
]
# valid bodies, and the paths (into them) whose values get replaced
BODIES = {
    "/v1/chat/completions": {"model": MODEL, "messages": USER, "max_tokens": 2},
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 2},
    "/v1/messages": {"model": MODEL, "messages": USER, "max_tokens": 2},
    "/v1/messages/count_tokens": {"model": MODEL, "messages": USER},
    "/tokenize": {"model": MODEL, "prompt": "hi"},
    "/detokenize": {"model": MODEL, "tokens": [1, 2]},
}
SAMPLING = ["n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "presence_penalty",
            "frequency_penalty", "repetition_penalty", "stop", "stop.0", "stop_token_ids", "stop_token_ids.0",
            "logit_bias", "logit_bias.100", "logit_bias.KEY", "stream", "stream_options", "ignore_eos", "user",
            "model", "stream_options.include_usage"]
PATHS = {
    "/v1/chat/completions": SAMPLING + [
        "messages", "messages.0", "messages.0.content", "messages.0.role", "messages.0.name",
        "messages.0.content.0.type", "messages.0.content.0.text", "messages.0.content.0.image_url.url",
        "tools", "tools.0", "tools.0.function.parameters", "tools.0.function.name", "tools.0.function.strict",
        "tool_choice", "tool_choice.function.name", "response_format", "response_format.type",
        "response_format.json_schema.schema", "response_format.json_schema.name", "response_format.json_schema.strict",
        "max_completion_tokens", "logprobs", "top_logprobs", "reasoning_effort", "thinking", "thinking.type",
        "thinking.effort", "chat_template_kwargs", "chat_template_kwargs.thinking", "parallel_tool_calls", "EXTRA"],
    "/v1/completions": SAMPLING + ["prompt", "prompt.0", "prompt.0.0", "echo", "logprobs", "suffix",
                                   "skip_special_tokens", "EXTRA"],
    "/v1/messages": ["max_tokens", "messages", "messages.0.content", "messages.0.role", "messages.0.content.0.type",
                     "messages.0.content.0.source.data", "system", "tools", "tools.0.input_schema", "tools.0.name",
                     "tool_choice", "tool_choice.type", "stop_sequences", "temperature", "top_p", "top_k", "stream",
                     "thinking", "thinking.type", "metadata", "model", "EXTRA"],
    "/v1/messages/count_tokens": ["messages", "messages.0.content", "system", "tools", "tools.0.input_schema",
                                  "tool_choice", "model", "EXTRA"],
    "/tokenize": ["prompt", "messages", "messages.0.content", "add_special_tokens", "tools", "response_format",
                  "model", "EXTRA"],
    "/detokenize": ["tokens", "tokens.0", "model", "EXTRA"],
}
# shapes that open nested paths: a path's prefix that is missing or not a container gets one of these
SEEDS = {"tools": [TOOL], "tools.0": TOOL, "tool_choice": {"type": "function", "function": {"name": "f"}},
         "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
         "messages.0.content": [{"type": "text", "text": "hi", "image_url": {"url": "x"},
                                 "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}],
         "stream_options": {"include_usage": True}, "logit_bias": {"100": 1}, "prompt": [[1, 2]],
         "stop": ["x"], "stop_token_ids": [5], "thinking": {"type": "enabled"}, "chat_template_kwargs": {}}


def mutate(body: dict, path: str, value: object) -> None:
    parts = path.split(".")
    node: object = body
    for i, key in enumerate(parts[:-1]):
        prefix = ".".join(parts[:i + 1])
        child = node[int(key)] if isinstance(node, list) and key.isdigit() and int(key) < len(node) else (
            node.get(key) if isinstance(node, dict) else None)
        if not isinstance(child, (dict, list)):
            child = copy.deepcopy(SEEDS.get(prefix, {}))
            if isinstance(node, dict):
                node[key] = child
            elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
                node[int(key)] = child
            else:
                return
        node = child
    last = parts[-1]
    if last == "KEY":  # the value becomes a key (logit_bias token ids)
        if isinstance(node, dict):
            node[str(value)[:100_000]] = 1
    elif last == "EXTRA":
        node["x_extra"] = value
    elif isinstance(node, dict):
        node[last] = value
    elif isinstance(node, list) and last.isdigit() and int(last) < len(node):
        node[int(last)] = value


def encode(body: object) -> bytes:
    # NaN/Infinity are JSON extensions Python's parser (the server's) accepts; surrogates travel as \ud800 escapes
    raws: list[str] = []

    def raw(o):
        raws.append(o.text)
        return f"\x00RAW{len(raws) - 1}\x00"

    text = json.dumps(body, allow_nan=True, default=raw)
    for i, r in enumerate(raws):
        text = text.replace(json.dumps(f"\x00RAW{i}\x00"), r, 1)
    return text.encode()


def check(r: httpx.Response, case: str) -> None:
    assert r.status_code < 500, (case, r.status_code, r.text[:500])
    text = r.text
    assert "Traceback" not in text and "internal error" not in text, (case, text[:500])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"] and err["type"], (case, err)


@pytest.fixture(scope="module")
def fuzz_server(tiny_checkpoint):
    # openai contract: the widest parameter space; a short context and queue keep accepted cases quick
    s = Server(None, str(tiny_checkpoint), "--served-model-name", MODEL, "--api-key", API_KEY, "--max-model-len",
               "96", "--api-contract", "openai", "--max-queued-requests", "8", "--disable-access-log")
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(fuzz_server):
    with httpx.Client(base_url=fuzz_server.url, headers=fuzz_server.headers, timeout=120) as c:
        yield c


CHAT, COMPLETION, MESSAGES = "/v1/chat/completions", "/v1/completions", "/v1/messages"
# the reproduced 500s and 429s of issue 50: each is a 400 naming its field
NAMED = {
    "top_k beyond 64 bits": (CHAT, {"top_k": 2**64}, "top_k"),
    "stop_token_ids beyond 64 bits": (CHAT, {"stop_token_ids": [2**64]}, "stop_token_ids.0"),
    "logit_bias key beyond 64 bits": (CHAT, {"logit_bias": {str(2**64): 1}}, "logit_bias"),
    "seed beyond 64 bits": (CHAT, {"seed": 2**64}, "seed"),
    "max_tokens beyond 64 bits": (CHAT, {"max_tokens": 2**64}, "max_tokens"),
    "min_tokens beyond 64 bits": (CHAT, {"min_tokens": 2**64}, "min_tokens"),
    "temperature NaN": (CHAT, {"temperature": float("nan")}, "temperature"),
    "n above the queue": (CHAT, {"n": 9}, "n"),  # 9 <= 16 choices, but the server holds 8 at once
    "completion top_k": (COMPLETION, {"top_k": 2**64}, "top_k"),
    "completion stop_token_ids": (COMPLETION, {"stop_token_ids": [2**70]}, "stop_token_ids.0"),
    "completion n above the queue": (COMPLETION, {"n": 9}, "n"),
    "messages top_k": (MESSAGES, {"top_k": 2**64}, "top_k"),
    "messages max_tokens": (MESSAGES, {"max_tokens": 2**64}, "max_tokens"),
    "response_format 300 deep": (CHAT, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": Deep(300, "schema")}}}, "response_format"),
    "tool parameters 300 deep": (CHAT, {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": Deep(300, "schema")}}]}, "tools"),
    "input_schema 300 deep": (MESSAGES, {"tools": [{"name": "f", "input_schema": Deep(300, "schema")}]}, "tools"),
    "schema too large": (CHAT, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"enum": list(range(30_000))}}}}, "response_format.json_schema.schema"),
    "detokenize beyond 64 bits": ("/detokenize", {"tokens": [2**64]}, "tokens.0"),
}


@pytest.mark.parametrize("case", list(NAMED))
def test_out_of_range_is_400_naming_the_field(client, case):
    path, edit, field = NAMED[case]
    r = client.post(path, content=encode({**BODIES[path], **edit}), headers={"content-type": "application/json"})
    assert r.status_code == 400, (case, r.text[:300])
    assert r.json()["error"]["param"] == field, r.text[:300]


def test_deep_whole_body_is_400(client):
    r = client.post(CHAT, content=encode(Deep(100_000, "list")), headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"]


def test_refused_key_is_counted(fuzz_server):
    """401s are in the error counter (the key check answers before the counting wrapper)."""
    assert httpx.post(fuzz_server.url + CHAT, json=BODIES[CHAT]).status_code == 401
    assert 'k3serve:http_errors_total{status="401"}' in httpx.get(fuzz_server.url + "/metrics").text


PAIRS = [(path, field) for path in sorted(BODIES) for field in PATHS[path]]
SETTINGS = dict(deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large, HealthCheck.large_base_example])


@settings(max_examples=CASES, **SETTINGS)
@given(pair=st.sampled_from(PAIRS), value=st.sampled_from(HOSTILE),
       more=st.lists(st.tuples(st.integers(0, 1000), st.sampled_from(HOSTILE)), max_size=1))
def test_hostile_fields_never_5xx(client, pair, value, more):
    """One field hostile (sometimes one more of the same endpoint), the rest of the body valid."""
    path, field = pair
    edits = [(field, value)] + [(PATHS[path][i % len(PATHS[path])], v) for i, v in more]
    body = copy.deepcopy(BODIES[path])
    for f, v in edits:
        mutate(body, f, copy.deepcopy(v))  # a later edit may write into this value: never into HOSTILE itself
    r = client.post(path, content=encode(body), headers={"content-type": "application/json"})
    check(r, f"{path} {[(f, repr(v)[:80]) for f, v in edits]}")


@settings(max_examples=max(10, CASES // 10), **SETTINGS)
@given(path=st.sampled_from(sorted(BODIES)), body=st.sampled_from(HOSTILE))
def test_hostile_whole_bodies_never_5xx(client, path, body):
    check(client.post(path, content=encode(body), headers={"content-type": "application/json"}), f"{path} body")


def test_server_healthy_after_fuzz(fuzz_server, client):
    """Runs after the fuzz tests (file order): the server still serves, and counted no 500."""
    assert client.get("/health").status_code == 200
    r = client.post("/v1/chat/completions", json=BODIES["/v1/chat/completions"])
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert 'status="500"' not in client.get("/metrics").text
