"""Issue 50: a large request body is parsed and validated in the worker pool (`server/body.py`), with the
same answers as FastAPI's own inline parsing gives a small one; oversized collections are refused from the
raw JSON before it is parsed. In-process app with a stand-in engine client (conftest.in_process_app)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from k3serve.server import body as body_module
from k3serve.server.body import INLINE_BODY_BYTES
from k3serve.server.limits import RequestLimits
from k3serve.server.state import ServerConfig
from tests.server.conftest import in_process_app
from tests.server.test_bounded_work import Gate, _health_while_held

JSON = {"content-type": "application/json"}
PAD = "a" * (INLINE_BODY_BYTES + 1000)  # an extra field (allowed) that makes a body large
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "thinking": {"type": "disabled"}}


@pytest.fixture(scope="module")
def tokenizer():
    from k3serve.tokenizer import Tokenizer

    return Tokenizer.kimi("k3")


def _app(tokenizer, **limits):
    app = in_process_app(ServerConfig(model="m", access_log=False, limits=RequestLimits(**limits)))
    app.state.k3.tokenizer = tokenizer
    return app


async def _posts(app, path: str, raws: list[bytes]) -> list[httpx.Response]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        return [await c.post(path, content=raw, headers=JSON) for raw in raws]


def test_health_answers_while_a_large_body_is_parsed(tokenizer, monkeypatch):
    app = _app(tokenizer)
    gate = Gate(body_module.parse_body)
    monkeypatch.setattr(body_module, "parse_body", gate)
    r = asyncio.run(_health_while_held(app, gate, "/tokenize", {"prompt": "hello", "x_pad": PAD}))
    assert r.status_code == 200 and r.json()["tokens"] == tokenizer.encode("hello").tolist()


def test_small_bodies_stay_inline(tokenizer, monkeypatch):
    calls = []
    monkeypatch.setattr(body_module, "parse_body", lambda *a: calls.append(a))
    (r,) = asyncio.run(_posts(_app(tokenizer), "/tokenize", [json.dumps({"prompt": "hello"}).encode()]))
    assert r.status_code == 200 and not calls


def test_oversized_collections_are_refused_before_parsing(tokenizer, monkeypatch):
    """Messages over --max-messages (413) and logit_bias over 300 entries (400) are never parsed whole (the
    issue's 200,000 messages and 160,000 entries, scaled down to keep the test fast)."""
    loads = []
    monkeypatch.setattr(body_module, "_loads", lambda *a: loads.append(a))
    many = json.dumps({**CHAT, "messages": [{"role": "user", "content": "hi"}] * 5000}).encode()
    bias = json.dumps({**CHAT, "logit_bias": {str(t): -1.0 for t in range(10_000)}}).encode()
    assert min(len(many), len(bias)) > INLINE_BODY_BYTES
    r_many, r_bias = asyncio.run(_posts(_app(tokenizer, max_messages=1000), "/v1/chat/completions", [many, bias]))
    assert r_many.status_code == 413 and "--max-messages" in r_many.json()["error"]["message"]
    assert r_bias.status_code == 400 and r_bias.json()["error"]["param"] == "logit_bias"
    assert not loads


DEEP = '{"a":' * 100 + "1" + "}" * 100
CASES = {  # small invalid bodies; each also sent padded past INLINE_BODY_BYTES
    "int beyond 64 bits": ('"top_k": 18446744073709551616', "/v1/chat/completions"),
    "wrong type": ('"max_tokens": "x"', "/v1/chat/completions"),
    "NaN": ('"temperature": NaN', "/v1/chat/completions"),  # NaN, 1e400: json.loads reads them, msgspec does not
    "1e400": ('"temperature": 1e400', "/v1/chat/completions"),
    "nested 100 deep": (f'"response_format": {DEEP}', "/v1/chat/completions"),
    "missing field": (None, "/v1/chat/completions"),
    "token id beyond 64 bits": ('"tokens": [18446744073709551616]', "/detokenize"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_large_body_errors_match_inline(tokenizer, case):
    field, path = CASES[case]
    base = '"messages": [{"role": "user", "content": "hi"}]' if path != "/detokenize" else '"tokens": [1]'
    inner = field if field is not None and "tokens" in field else ", ".join(x for x in (base, field) if x)
    if field is None:
        inner = '"max_tokens": 4'
    small, large = "{" + inner + "}", "{" + inner + f', "x_pad": "{PAD}"' + "}"
    assert len(small) < INLINE_BODY_BYTES < len(large)
    r_small, r_large = asyncio.run(_posts(_app(tokenizer), path, [small.encode(), large.encode()]))
    assert r_small.status_code == 400, r_small.text[:300]
    assert (r_large.status_code, r_large.json()) == (r_small.status_code, r_small.json())


def test_large_bad_json_is_400(tokenizer):
    raws = [b'{"messages": [' + b"1," * 50_000, b"[" * 100_000 + b"]" * 100_000,
            b'{"messages": "' + b"\xff" * (INLINE_BODY_BYTES + 1) + b'"}']
    for r in asyncio.run(_posts(_app(tokenizer), "/v1/chat/completions", raws)):
        assert r.status_code == 400 and r.json()["error"]["message"], r.text[:300]


def test_large_valid_body_is_served_as_inline(tokenizer):
    """3,000 messages (~100 KB): tokenized exactly as the same request under the inline threshold."""
    msgs = [{"role": "user", "content": f"m{i}"} for i in range(3000)]
    small = json.dumps({"messages": msgs[:40], "thinking": {"type": "disabled"}}).encode()
    large = json.dumps({"messages": msgs, "thinking": {"type": "disabled"}}).encode()
    assert len(small) < INLINE_BODY_BYTES < len(large)
    r_small, r_large = asyncio.run(_posts(_app(tokenizer), "/tokenize", [small, large]))
    assert r_small.status_code == r_large.status_code == 200
    assert r_large.json()["count"] > 50 * r_small.json()["count"] // 2
    assert "m2999" in tokenizer.decode(r_large.json()["tokens"])


def test_json_msgspec_refuses_reads_as_inline(tokenizer):
    """A lone surrogate (which msgspec refuses and Python's parser reads) gives the inline answer when large."""
    small = b'{"prompt": "a\\ud800b"}'
    large = small[:-1] + b', "x_pad": "' + PAD.encode() + b'"}'
    r_small, r_large = asyncio.run(_posts(_app(tokenizer), "/tokenize", [small, large]))
    assert (r_large.status_code, r_large.json()) == (r_small.status_code, r_small.json())
