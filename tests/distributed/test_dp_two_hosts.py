"""Data parallel across two "hosts" on 127.0.0.1: ``k3serve serve -dp 2 --nnodes 2 --node-rank 0`` serves HTTP
with replica 0, a second ``--node-rank 1`` command runs replica 1's engine core, which reaches host 0's client
over TCP (engine/dp_hosts.py). Greedy completions through HTTP equal one process's; stopping host 0 stops host 1
(exit 0); host 1 dying fails the requests in flight (503 or an error event), and host 0 exits 1, no hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from k3serve.core.process import free_port
from tests.server.test_process_lifetime import Launch

pytestmark = pytest.mark.slow  # three engine loads, two of them over TCP

MODEL = "k3-tiny-random"
PROMPTS = [[5, 6, 7, 8, 9], [100, 7, 42], [11, 12, 13, 14, 15, 16, 17], [900, 901]]


def host1(flags: list[str], tmp_path) -> subprocess.Popen:
    with (tmp_path / "host1.log").open("w") as log:
        return subprocess.Popen([sys.executable, "-m", "k3serve", "serve", *flags, "--node-rank", "1"],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "K3SERVE_DP_CLIENT_TIMEOUT_S": "5"}, start_new_session=True)


def completions(port: int, max_tokens: int = 6) -> list[list[int]]:
    """The greedy token ids of PROMPTS, sent concurrently (so both replicas get some)."""
    out: list = [None] * len(PROMPTS)

    def one(i):
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=180,
                       json={"model": MODEL, "prompt": PROMPTS[i], "max_tokens": max_tokens, "temperature": 0,
                             "ignore_eos": True, "logprobs": 1})
        assert r.status_code == 200, r.text
        out[i] = r.json()["choices"][0]["logprobs"]["tokens"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert all(o is not None for o in out)
    return out


def kill(p: subprocess.Popen) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)


def dp_flags(*extra: str) -> list[str]:
    return [MODEL, "-dp", "2", "--nnodes", "2", "--data-parallel-rpc-port", str(free_port()), "--max-model-len", "256",
            *extra]


# plain replicas; and the experts over both hosts' ranks (one world meeting at host 0, cores in lockstep)
@pytest.mark.parametrize("extra", [(), ("--enable-expert-parallel", "--master-addr", "127.0.0.1")],
                         ids=["plain", "ep-lockstep"])
def test_two_hosts_equal_one_process_and_stop_with_host_0(tmp_path, extra):
    (tmp_path / "one").mkdir()
    one = Launch(MODEL, "--max-model-len", "256", tmp_path=tmp_path / "one")
    try:
        one.wait_healthy(expect_procs=1)
        want = completions(one.port)
    finally:
        one.close()
    flags = dp_flags(*extra, *(("--master-port", str(free_port())) if extra else ()))
    h1 = host1(flags, tmp_path)
    (tmp_path / "h0").mkdir()
    h0 = Launch(*flags, tmp_path=tmp_path / "h0")
    try:
        h0.wait_healthy(expect_procs=1)  # replica 0 only: replica 1 is host 1's
        assert completions(h0.port) == want
        assert completions(h0.port) == want  # the replicas' prefix caches hit now
        h0.proc.send_signal(signal.SIGINT)
        assert h0.proc.wait(60) == 130
        assert h1.wait(60) == 0, (tmp_path / "host1.log").read_text()[-3000:]
        assert "host 1 runs data-parallel replicas 1" in (tmp_path / "host1.log").read_text()
    finally:
        h0.close()
        kill(h1)


def test_host_1_dying_fails_its_requests_and_host_0_exits(tmp_path):
    flags = dp_flags()
    h1 = host1(flags, tmp_path)
    h0 = Launch(*flags, tmp_path=tmp_path)
    url = f"http://127.0.0.1:{h0.port}"
    results: list = []

    def long_request(stream: bool):
        body = {"model": MODEL, "prompt": [5, 6, 7, 8] * 8, "max_tokens": 200, "ignore_eos": True,
                "temperature": 0, "stream": stream}
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                results.append((r.status_code, "".join(r.iter_text())))
        except httpx.HTTPError as e:
            results.append(("transport", repr(e)))

    try:
        h0.wait_healthy(expect_procs=1)
        threads = [threading.Thread(target=long_request, args=(s,), daemon=True) for s in (False, True, False, True)]
        for t in threads:
            t.start()
        time.sleep(1.5)  # admitted on both replicas, stepping
        t0 = time.monotonic()
        kill(h1)
        for t in threads:
            t.join(60)
        assert len(results) == 4, results  # nobody left hanging
        failed = [r for r in results if r[0] != 200 or "error" in r[1]]
        # host 1's requests failed: 503 before the body, or an error event in a stream that already began
        assert failed and all(r[0] in (503, 200, "transport") for r in failed), results
        assert any(r[0] == 503 or "error" in r[1] for r in failed), results
        # the server answers 503 a while (serve_cli.GONE_GRACE_S) before it exits, never a refused connection
        r = httpx.post(url + "/v1/completions", timeout=30, json={"model": MODEL, "prompt": [5, 6], "max_tokens": 2})
        assert r.status_code == 503, r.text
        assert httpx.get(url + "/health", timeout=30).status_code == 503
        assert h0.proc.wait(60) == 1  # a remote replica is not restarted: the server gives up
        assert time.monotonic() - t0 < 60
    finally:
        h0.close()
        kill(h1)
