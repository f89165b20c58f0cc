"""Prefill/decode end to end over HTTP: `k3serve serve --role prefill`, `--role decode` and a `both` server,
with `k3serve route --prefill URL --decode URL` in front. Greedy tokens and top-20 logprobs through the router
equal the `both` server's (JSON and SSE, chunked prefill, a decode-side prefix hit on the second turn); the
prefill worker's pools are empty again afterwards; bad kv_transfer_params are a 400. Two prefill and two decode
workers (`serve --prefill-replicas 2 --decode-replicas 2`) answer concurrent requests like the `both` server."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.pd.cluster import cluster, metric

pytestmark = pytest.mark.slow  # four servers, three engines: ~30 s idle, minutes on a loaded machine
MODEL = "k3-tiny-random"
ENGINE = ["--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "16",
          "--gpu-memory-utilization", "0.02"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    # eight engine processes in all (the 2+2 among them): minutes on a loaded 2-core box
    with cluster(MODEL, ENGINE, tmp_path_factory.mktemp("pd") / "servers.log", handoff_timeout=5,
                 timeout=600) as urls:
        yield urls


@pytest.fixture(scope="module")
def two_by_two(servers):
    """`serve --prefill-replicas 2 --decode-replicas 2`: four workers behind one prefill/decode router."""
    return servers["pd22"]


def _completion(url: str, prompt: list[int], stream: bool) -> tuple[list[int], list[dict]]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logprobs": 20, "stream": stream}
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        return lp["tokens"], lp["top_logprobs"]
    tokens, tops = [], []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                frame = json.loads(line[6:])
                assert "error" not in frame, frame
                lp = frame["choices"][0]["logprobs"] if frame["choices"] else None
                if lp:
                    tokens += lp["tokens"]
                    tops += lp["top_logprobs"]
    return tokens, tops


def _same(got, want) -> None:
    assert got[0] == want[0]
    for a, b in zip(got[1], want[1]):
        assert list(a) == list(b) and max(abs(a[k] - b[k]) for k in a) <= 1e-5


def test_router_prefill_decode_equals_one_server(servers):
    first = list(range(300, 337))
    second = first + list(range(500, 520))  # the decode worker holds first's 2 full blocks
    for prompt in (first, second):
        for stream in (False, True):
            _same(_completion(servers["router"], prompt, stream), _completion(servers["both"], prompt, stream))
    assert metric(servers["decode"], "k3serve:handoff_transfers_total") == 4
    assert metric(servers["decode"], "k3serve:handoff_bytes_total") > 0
    deadline = time.monotonic() + 10
    while metric(servers["prefill"], "k3serve:handoffs_held") or metric(servers["prefill"],
                                                                          "vllm:kv_cache_usage_perc"):
        assert time.monotonic() < deadline, "the prefill worker still holds hand-offs"
        time.sleep(0.5)


def test_bad_kv_transfer_params_are_400(servers):
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2}
    r = httpx.post(servers["decode"] + "/v1/completions", timeout=60,
                   json=body | {"kv_transfer_params": {"address": "not a url", "request_id": "x"}})
    assert r.status_code == 400 and r.json()["error"]["message"]
    r = httpx.post(servers["prefill"] + "/v1/completions", json=body | {"prompt": [[1, 2], [3, 4]]}, timeout=60)
    assert r.status_code == 400 and "one prompt per request" in r.json()["error"]["message"]
    r = httpx.post(servers["router"] + "/v1/completions", json=body | {"kv_transfer_params": {}}, timeout=60)
    assert r.status_code == 400


def test_two_prefill_two_decode_equal_one_server(two_by_two, servers):
    prompts = [list(range(100 + 7 * i, 100 + 7 * i + 20 + 9 * i)) for i in range(4)]  # 20..47 tokens
    with ThreadPoolExecutor(4) as pool:  # concurrent, so both workers of each role get requests
        got = list(pool.map(lambda a: _completion(two_by_two, *a), [(p, i % 2 == 1) for i, p in enumerate(prompts)]))
    for i, p in enumerate(prompts):
        _same(got[i], _completion(servers["both"], p, i % 2 == 1))
    workers = httpx.get(two_by_two + "/router/workers").json()
    assert all(w["served_requests"] >= 1 for role in ("prefill", "decode") for w in workers[role]), workers
    deadline = time.monotonic() + 10
    for w in workers["prefill"]:
        while metric(w["url"], "k3serve:handoffs_held") or metric(w["url"], "vllm:kv_cache_usage_perc"):
            assert time.monotonic() < deadline, f"prefill worker {w['url']} still holds hand-offs"
            time.sleep(0.5)
