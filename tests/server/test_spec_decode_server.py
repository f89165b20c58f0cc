"""Speculative decoding through the server: ``--speculative-config`` greedy completions equal a plain
server's (streamed too), a json_schema answer still follows its schema, and /metrics counts drafts."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema

from tests.server.conftest import MODEL

SPEC = '{"method": "suffix", "num_speculative_tokens": 4}'
PROMPT = "alpha beta gamma delta alpha beta gamma delta alpha beta gamma delta alpha beta"
SCHEMA = {"type": "object", "properties": {"c": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
          "required": ["c", "ok"], "additionalProperties": False}


def _complete(server, **extra):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, **extra}
    r = server.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", headers=server.headers, timeout=30).text
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def test_speculative_server_matches_plain(server_factory, openai_server):
    spec = server_factory("--api-contract", "openai", "--speculative-config", SPEC)
    assert _complete(spec) == _complete(openai_server)
    rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "give c and ok"}], "max_tokens": 60,
            "temperature": 0, "response_format": rf, "chat_template_kwargs": {"thinking": False}}
    got = [s.post("/v1/chat/completions", body) for s in (spec, openai_server)]
    assert all(r.status_code == 200 for r in got), got[0].text
    (a, plain) = [r.json()["choices"][0] for r in got]
    assert a["message"]["content"] == plain["message"]["content"] and a["finish_reason"] == "stop"
    jsonschema.validate(json.loads(a["message"]["content"]), SCHEMA)
    assert _metric(spec, "vllm:spec_decode_num_drafts_total") > 0
    assert _metric(spec, "vllm:spec_decode_num_draft_tokens_total") >= _metric(
        spec, "vllm:spec_decode_num_accepted_tokens_total")


def test_a_draft_model_through_http_matches_plain(server_factory, openai_server):
    """k3-default (same vocabulary, other weights: some drafts accepted, some not) drafting for the served
    model: greedy completions, plain and streamed, equal the plain server's."""
    draft = server_factory("--api-contract", "openai", "--speculative-config",
                           '{"method": "draft_model", "model": "k3-default", "num_speculative_tokens": 3}')
    assert _complete(draft) == _complete(openai_server)
    body = {"model": MODEL, "prompt": PROMPT + " alpha", "max_tokens": 16, "temperature": 0, "stream": True}
    texts = []
    for s in (draft, openai_server):
        with httpx.stream("POST", s.url + "/v1/completions", json=body, headers=s.headers, timeout=60) as r:
            assert r.status_code == 200
            chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
        texts.append("".join(c["choices"][0]["text"] for c in chunks))
    assert texts[0] == texts[1] and texts[0]
    assert _metric(draft, "vllm:spec_decode_num_draft_tokens_total") > 0
