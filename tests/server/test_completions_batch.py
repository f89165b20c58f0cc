"""`/v1/completions` streams and prompt batches: a chunk per engine step that produced tokens (even ones that
decode to no text), every prompt of a batch in the engine at once, in order, admitted and aborted together."""

from __future__ import annotations

import json

import httpx

from tests.server.conftest import MODEL
from tests.server.test_lifecycle import metric, small_server, wait_idle  # noqa: F401 - small_server is a fixture

RESERVED = 163592  # <|reserved_token_163592|>: special, so skip_special_tokens shows it as no text


def frames(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def test_stream_sends_a_chunk_per_token_even_without_text(openai_server):
    body = {"model": MODEL, "prompt": [9906, 1917], "max_tokens": 4, "logit_bias": {str(RESERVED): 100},
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    got = frames(openai_server.post("/v1/completions", body))
    choices = [f["choices"][0] for f in got if f["choices"]]
    tokens = [c for c in choices if c["finish_reason"] is None]
    assert [c["text"] for c in tokens] == [""] * 4  # one per token, though none has text
    assert choices[-1]["finish_reason"] == "length" and got[-1]["usage"]["completion_tokens"] == 4


def test_batch_keeps_order_indexes_and_usage(openai_server):
    prompts = [[9906], [9906, 1917], [1917, 1917, 9906]]
    body = {"model": MODEL, "prompt": prompts, "n": 2, "max_tokens": 3, "ignore_eos": True, "temperature": 0}
    r = openai_server.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == list(range(6))
    assert all(c["finish_reason"] == "length" for c in out["choices"])
    assert out["usage"]["prompt_tokens"] == 6 and out["usage"]["completion_tokens"] == 18
    # temperature 0: both choices of a prompt agree, and the batch answers as the prompts alone do
    texts = [c["text"] for c in out["choices"]]
    assert texts[0::2] == texts[1::2]
    alone = openai_server.post("/v1/completions", {**body, "prompt": prompts[2], "n": 1}).json()
    assert alone["choices"][0]["text"] == texts[4]

    got = frames(openai_server.post("/v1/completions", {**body, "stream": True,
                                                         "stream_options": {"include_usage": True}}))
    per_index: dict[int, list[dict]] = {}
    for f in got[:-1]:
        (c,) = f["choices"]
        per_index.setdefault(c["index"], []).append(c)
    assert sorted(per_index) == list(range(6))
    for cs in per_index.values():
        assert [c["finish_reason"] for c in cs] == [None] * 3 + ["length"]
    assert got[-1]["choices"] == [] and got[-1]["usage"] == out["usage"] | {"prompt_tokens_details":
                                                                           got[-1]["usage"]["prompt_tokens_details"]}


def test_batch_runs_at_once_and_a_disconnect_aborts_every_prompt(openai_server):
    body = {"model": MODEL, "prompt": [[9906] * (i + 1) for i in range(4)], "max_tokens": 1500, "ignore_eos": True,
            "stream": True}
    with httpx.Client() as c:
        with c.stream("POST", openai_server.url + "/v1/completions", json=body, headers=openai_server.headers,
                      timeout=120) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            seen = set()
            while len(seen) < 4:  # tokens of every prompt before any prompt is done (1500 tokens each)
                line = next(lines)
                if line.startswith("data: {"):
                    seen.add(json.loads(line[6:])["choices"][0]["index"])
            assert metric(openai_server, "k3serve:requests_in_flight") == 4
    wait_idle(openai_server)


def test_batch_is_admitted_whole_or_refused(small_server):  # noqa: F811 - the fixture
    # --max-queued-requests 2: a batch of 3 prompts would hold 3 engine requests at once, which no wait can
    # make room for: 400 naming the prompt (a 429 would be retried forever)
    r = small_server.post("/v1/completions", {"model": MODEL, "prompt": [[9906], [1917], [9906, 1917]],
                                               "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    ok = small_server.post("/v1/completions", {"model": MODEL, "prompt": [[9906], [1917]], "max_tokens": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
