"""Servers for the slow P/D-over-HTTP tests (tests/pd/test_http_*.py): a single `both` server, a 1P1D setup
(`serve --role prefill`, `serve --role decode`, `route --prefill URL --decode URL`) and a 2P2D one
(`serve --prefill-replicas 2 --decode-replicas 2`), all of one model with the same engine flags, on 127.0.0.1
and free ports, always stopped. Plus the comparison of two OpenAI answers (tokens, top-k logprobs)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx

TOL = 1e-5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def cluster(model: str, engine: list[str], log_path, *, two_by_two: bool = True, both: bool = True,
            handoff_timeout: float = 60, timeout: float = 900, role_flags: dict[str, list[str]] | None = None):
    """Yield {"both", "prefill", "decode", "router", "pd22"} URLs ("pd22" only with ``two_by_two``, "both" only
    with ``both``) and, under "procs", the server processes by name. ``role_flags``: more flags for one role's
    server (e.g. {"prefill": ["-tp", "2"]})."""
    log = open(log_path, "wb")
    procs: list[subprocess.Popen] = []

    def start(*args: str) -> None:
        procs.append(subprocess.Popen([sys.executable, "-m", "k3serve", *args], stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True))

    urls: dict[str, str] = {}
    by_name: dict[str, subprocess.Popen] = {}
    try:
        for role in ("both", "prefill", "decode")[0 if both else 1:]:
            port = free_port()
            urls[role] = f"http://127.0.0.1:{port}"
            start("serve", model, "--port", str(port), "--role", role, "--handoff-timeout", str(handoff_timeout),
                  *engine, *(role_flags or {}).get(role, []))
            by_name[role] = procs[-1]
        port = free_port()
        urls["router"] = f"http://127.0.0.1:{port}"
        start("route", "--port", str(port), "--prefill", urls["prefill"], "--decode", urls["decode"])
        if two_by_two:
            port = free_port()
            urls["pd22"] = f"http://127.0.0.1:{port}"
            start("serve", model, "--port", str(port), "--prefill-replicas", "2", "--decode-replicas", "2",
                  "--handoff-timeout", str(handoff_timeout), *engine)
        deadline = time.monotonic() + timeout
        pending = dict(urls)
        while pending:
            assert all(p.poll() is None for p in procs), f"a server exited while starting (log: {log_path})"
            for name, url in list(pending.items()):
                if _healthy(url):
                    del pending[name]
            if "pd22" in urls and "pd22" not in pending and not workers_up(urls["pd22"]):
                pending["pd22"] = urls["pd22"]
            assert time.monotonic() < deadline, f"{sorted(pending)} did not start (log: {log_path})"
            time.sleep(0.5)
        yield urls | {"procs": by_name}
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGINT)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        log.close()


def workers_up(router: str) -> bool:
    """Every worker behind a prefill/decode router answers /health."""
    try:
        workers = httpx.get(router + "/router/workers", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return False
    return all(_healthy(w["url"]) for role in ("prefill", "decode") for w in workers[role])


def prefill_workers(urls: dict[str, str], name: str) -> list[str]:
    if name == "router":
        return [urls["prefill"]]
    return [w["url"] for w in httpx.get(urls[name] + "/router/workers", timeout=10).json()["prefill"]]


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in {url}/metrics")


def pools_back(prefill_urls: list[str], wait_s: float = 20) -> None:
    """Every prefill worker holds nothing any more (every hand-off acked and freed)."""
    deadline = time.monotonic() + wait_s
    for url in prefill_urls:
        while metric(url, "k3serve:handoffs_held") or metric(url, "vllm:kv_cache_usage_perc"):
            assert time.monotonic() < deadline, f"prefill worker {url} still holds hand-offs"
            time.sleep(0.3)


def chat(url: str, body: dict) -> dict:
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def chat_logprobs(answer: dict) -> list[tuple[str, list[tuple[str, float]]]]:
    """(token, [(top token, logprob), ...]) per generated token of a chat answer."""
    return [(c["token"], [(t["token"], t["logprob"]) for t in c["top_logprobs"]])
            for c in answer["choices"][0]["logprobs"]["content"]]


def same_chat(got: dict, want: dict) -> None:
    """The same message (content, reasoning, tool calls), the same tokens, top-k logprobs within ``TOL``."""
    a, b = got["choices"][0], want["choices"][0]
    for key in ("content", "reasoning_content"):
        assert a["message"].get(key) == b["message"].get(key), key
    calls = [[(c["function"]["name"], c["function"]["arguments"]) for c in m["message"].get("tool_calls") or []]
             for m in (a, b)]  # not the call ids: each server makes its own
    assert calls[0] == calls[1]
    assert a["finish_reason"] == b["finish_reason"]
    la, lb = chat_logprobs(got), chat_logprobs(want)
    assert len(la) == len(lb) and la
    for (ta, ka), (tb, kb) in zip(la, lb):
        assert ta == tb and [t for t, _ in ka] == [t for t, _ in kb]
        assert max(abs(x - y) for (_, x), (_, y) in zip(ka, kb)) <= TOL
