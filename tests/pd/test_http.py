"""Prefill/decode end to end over HTTP: `k3serve serve --role prefill`, `--role decode` and a `both` server,
with `k3serve route --prefill URL --decode URL` in front. Greedy tokens and top-20 logprobs through the router
equal the `both` server's (JSON and SSE, chunked prefill, a decode-side prefix hit on the second turn); the
prefill worker's pools are empty again afterwards; bad kv_transfer_params are a 400. Two prefill and two decode
workers (`serve --prefill-replicas 2 --decode-replicas 2`) answer concurrent requests like the `both` server."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytestmark = pytest.mark.slow  # four servers, three engines: ~30 s idle, minutes on a loaded machine
MODEL = "k3-tiny-random"
ENGINE = ["--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "16",
          "--gpu-memory-utilization", "0.02"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: list[str], log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "k3serve", *args], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def _wait(urls: list[str], procs: list, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    for url in urls:
        while True:
            assert all(p.poll() is None for p in procs), "a server exited while starting"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"{url} did not start"
            time.sleep(0.5)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    log = (tmp_path_factory.mktemp("pd") / "servers.log").open("wb")
    ports = [free_port() for _ in range(4)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs = []
    try:
        for port, role in zip(ports[:3], ("both", "prefill", "decode")):
            procs.append(_start(["serve", MODEL, "--port", str(port), "--role", role, "--handoff-timeout", "5",
                                 *ENGINE], log))
        _wait(urls[:3], procs)
        procs.append(_start(["route", "--port", str(ports[3]), "--prefill", urls[1], "--decode", urls[2]], log))
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(urls[3] + "/health", timeout=2)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline
                time.sleep(0.3)
        yield dict(zip(("both", "prefill", "decode", "router"), urls))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGINT)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        log.close()


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


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_router_prefill_decode_equals_one_server(servers):
    first = list(range(300, 337))
    second = first + list(range(500, 520))  # the decode worker holds first's 2 full blocks
    for prompt in (first, second):
        for stream in (False, True):
            _same(_completion(servers["router"], prompt, stream), _completion(servers["both"], prompt, stream))
    assert _metric(servers["decode"], "k3serve:handoff_transfers_total") == 4
    assert _metric(servers["decode"], "k3serve:handoff_bytes_total") > 0
    deadline = time.monotonic() + 10
    while _metric(servers["prefill"], "k3serve:handoffs_held") or _metric(servers["prefill"],
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


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory, servers):
    """`serve --prefill-replicas 2 --decode-replicas 2`: four workers behind one prefill/decode router."""
    log = (tmp_path_factory.mktemp("pd22") / "servers.log").open("wb")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _start(["serve", MODEL, "--port", str(port), "--prefill-replicas", "2", "--decode-replicas", "2",
                   "--handoff-timeout", "5", *ENGINE], log)
    try:
        deadline = time.monotonic() + 600  # eight processes start; minutes on a loaded 2-core box
        while True:
            assert proc.poll() is None, "serve --prefill-replicas 2 --decode-replicas 2 exited"
            try:
                workers = httpx.get(url + "/router/workers", timeout=2).json()
                if all(httpx.get(w["url"] + "/health", timeout=2).status_code == 200
                       for role in ("prefill", "decode") for w in workers[role]):
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the 2+2 workers did not start"
            time.sleep(0.5)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


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
        while _metric(w["url"], "k3serve:handoffs_held") or _metric(w["url"], "vllm:kv_cache_usage_perc"):
            assert time.monotonic() < deadline, f"prefill worker {w['url']} still holds hand-offs"
            time.sleep(0.5)
