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
