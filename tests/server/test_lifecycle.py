"""Process layout behaviour: disconnects abort engine requests, a full queue answers 429 with
Retry-After, a dead engine process gives 503 (health and requests) instead of a hang."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from tests.server.conftest import MODEL, children

USER = [{"role": "user", "content": "Tell me a long story."}]
LONG = {"model": MODEL, "messages": USER, "max_tokens": 1500, "stream": True, "thinking": {"type": "disabled"}}


def metric(server, name: str) -> float:
    for line in httpx.get(server.url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def wait_idle(server, timeout: float = 60.0) -> None:
    """Until the engine holds no request and every KV block and KDA running slot is free."""
    deadline = time.monotonic() + timeout
    while True:
        values = [metric(server, n) for n in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                                              "vllm:kv_cache_usage_perc", "k3serve:requests_in_flight")]
        slots = metric(server, "k3serve:kda_state_slots")
        if values == [0, 0, 0, 0] and slots > 0 and metric(server, "k3serve:kda_state_slots_free") == slots:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle: {values}")
        time.sleep(0.5)


def open_stream(client: httpx.Client, server, body=LONG):
    cm = client.stream("POST", server.url + "/v1/chat/completions", json=body, headers=server.headers, timeout=120)
    r = cm.__enter__()
    assert r.status_code == 200
    lines = r.iter_lines()
    got = [next(lines) for _ in range(4)]  # role frame + a few tokens: the engine is generating
    assert got[0].startswith("data: ")
    return cm, lines


@pytest.fixture(scope="module")
def small_server(server_factory):
    return server_factory("--api-contract", "openai", "--max-queued-requests", "2", "--max-num-seqs", "8",
                          "--max-engine-restarts", "0")


def test_disconnect_aborts_in_engine(small_server):
    with httpx.Client() as c:
        cm, _ = open_stream(c, small_server)
        assert metric(small_server, "k3serve:requests_in_flight") == 1
        cm.__exit__(None, None, None)
    wait_idle(small_server)


def test_queue_full_is_429_with_retry_after(small_server):
    with httpx.Client() as c:
        streams = [open_stream(c, small_server) for _ in range(2)]
        r = small_server.post("/v1/chat/completions", {**LONG, "stream": False, "max_tokens": 1})
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        for cm, _ in streams:
            cm.__exit__(None, None, None)
    wait_idle(small_server)


def test_engine_death_without_restarts_ends_streams_then_exits_1(small_server):
    assert small_server.engine_pids
    with httpx.Client() as c:
        cm, lines = open_stream(c, small_server)
        os.kill(small_server.engine_pids[0], signal.SIGKILL)
        rest = "\n".join(lines)  # the open stream ends with an error frame
        cm.__exit__(None, None, None)
        assert '"error"' in rest and "[DONE]" in rest
    # --max-engine-restarts 0: the server exits non-zero for its supervisor (no 503s forever)
    assert small_server.proc.wait(30) == 1


def wait_health(server, status: str, timeout: float = 60.0) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(server.url + "/health", timeout=10)
        if r.json().get("status", r.json().get("error", {}).get("code")) in (status, f"engine_{status}"):
            return r
        assert time.monotonic() < deadline, r.text
        time.sleep(0.3)


def test_dead_engine_is_restarted_then_given_up(server_factory):
    srv = server_factory("--api-contract", "openai", "--max-engine-restarts", "1")
    first = children(srv.proc.pid)
    with httpx.Client() as c:
        cm, lines = open_stream(c, srv)
        os.kill(first[0], signal.SIGKILL)
        rest = "\n".join(lines)
        cm.__exit__(None, None, None)
        assert '"error"' in rest and "[DONE]" in rest  # the request in flight failed; it is not resumed
    r = wait_health(srv, "ready")
    assert r.status_code == 200 and r.json()["engine_restarts"] == 1
    second = children(srv.proc.pid)
    assert second and first[0] not in second  # a new engine process; the old one reaped (no zombie child)
    ok = srv.post("/v1/chat/completions", {**LONG, "stream": False, "max_tokens": 2})
    assert ok.status_code == 200
    os.kill(second[0], signal.SIGKILL)  # the one restart is spent: exit 1
    assert srv.proc.wait(30) == 1
