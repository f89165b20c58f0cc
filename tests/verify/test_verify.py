"""``k3serve verify`` against endpoints in process: the real k3serve frontend over a scripted engine passes every
check; five deliberately broken servers each fail the check that should catch them; a plain OpenAI stub that is
not k3serve gets a report (unsupported / failing checks), not a crash."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fastapi import FastAPI

from k3serve.verify import Target, run_verify
from k3serve.verify.reference import URLReference
from k3serve.verify.report import table, to_html, to_json, verdict
from tests.verify.conftest import Corrupt, k3serve_app, transport

URL = "http://k3serve.test"


def run(transport, only=(), reference=None):
    results = asyncio.run(run_verify(Target(URL, timeout_s=30), only=only, transport=transport, reference=reference))
    return {r.id: r for r in results}


def test_k3serve_passes_every_check():
    results = run(transport(k3serve_app()))
    bad = {k: (r.status, r.detail) for k, r in results.items() if r.status not in ("pass", "unsupported")}
    assert not bad, bad
    assert results["images.data_url"].status == "unsupported"  # the scripted model has no vision tower
    assert sum(r.status == "pass" for r in results.values()) == len(results) - 1
    rows = list(results.values())
    assert verdict(rows) == "pass" and "verdict: PASS" in table(rows)
    assert json.loads(json.dumps(to_json(rows, Target(URL))))["verdict"] == "pass"
    assert "<table>" in to_html(rows, Target(URL))


def _usage_plus_one(obj):
    for u in [obj.get("usage")] + [c.get("usage") for c in obj.get("choices") or []]:
        if u:
            u["prompt_tokens"] += 1
    return obj


def _reasoning_into_content(obj):
    for c in obj.get("choices") or []:
        m = c.get("message") or c.get("delta") or {}
        if m.get("reasoning_content"):
            m["content"] = m.pop("reasoning_content") + (m.get("content") or "")
    return obj


def _break_arguments(obj):
    for c in obj.get("choices") or []:
        for tc in (c.get("message") or c.get("delta") or {}).get("tool_calls") or []:
            fn = tc.get("function") or {}
            if fn.get("arguments"):
                fn["arguments"] = fn["arguments"].replace('"', "'")
    return obj


def _accept_any_temperature(body):
    body.pop("temperature", None)
    return body


@pytest.mark.parametrize("broken, caught_by", [
    (dict(response=_usage_plus_one), "usage.prompt_tokens_local"),
    (dict(response=_reasoning_into_content), "thinking.on"),
    (dict(response=_break_arguments), "tools.call"),
    (dict(request=_accept_any_temperature), "params.sampling_out_of_contract_refused"),
], ids=["prompt-tokens", "reasoning-leak", "tool-arguments", "temperature"])
def test_a_broken_server_fails_the_check_that_catches_it(broken, caught_by):
    group = caught_by.split(".")[0]
    results = run(Corrupt(k3serve_app(), **broken), only=[group])
    assert results[caught_by].status == "fail", (results[caught_by].detail)


def test_a_logit_shift_fails_fidelity():
    good = URLReference(URL, None, None)
    good.client.http = httpx.AsyncClient(base_url=URL, transport=transport(k3serve_app()))
    same = run(transport(k3serve_app()), only=["fidelity"], reference=good)
    assert {r.status for r in same.values()} == {"pass"}, same
    good = URLReference(URL, None, None)
    good.client.http = httpx.AsyncClient(base_url=URL, transport=transport(k3serve_app()))
    shifted = run(transport(k3serve_app(shift=2.5)), only=["fidelity"], reference=good)
    assert shifted["fidelity.logprob_kl"].status == "fail", shifted["fidelity.logprob_kl"].detail




def test_a_plain_openai_stub_gets_a_report_not_a_crash():
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "stub", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(body: dict):
        if body.get("logprobs"):
            from fastapi.responses import JSONResponse
            return JSONResponse({"error": {"message": "logprobs is not supported", "type": "invalid_request_error"}},
                                status_code=400)
        return {"id": "x", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "Hello!"}, "finish_reason": "stop"}]}

    results = run(transport(app))
    statuses = {r.status for r in results.values()}
    assert "error" not in statuses, {k: r.detail for k, r in results.items() if r.status == "error"}
    assert results["params.logprobs"].status == "unsupported"
    assert results["params.sampling_out_of_contract_refused"].status == "fail"
    assert results["tools.call"].status == "fail"
