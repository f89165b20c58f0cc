"""SIGKILL one tensor-parallel rank of a real ``k3serve serve -tp 2`` mid-run: requests in flight all get an
answer (503, or an error event on a stream that already began), new requests get 503 at once, the rank set is
restarted per --max-engine-restarts, and past the last restart the server and every process it started exit
(code 1, no hang)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.test_process_lifetime import Launch, alive, descendants

pytestmark = pytest.mark.slow  # two rank-set start-ups: tens of seconds on a loaded 2-core machine


def worker_pids(pid: int) -> list[int]:
    out = []
    for p in descendants(pid):
        try:
            if b"k3serve.engine.worker" in Path(f"/proc/{p}/cmdline").read_bytes():
                out.append(p)
        except OSError:
            pass
    return out


def in_flight(url: str, results: list, stream: bool) -> threading.Thread:
    body = {"model": "k3-tiny-random", "prompt": [5, 6, 7, 8] * 8, "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": stream}

    def go():
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                text = "".join(r.iter_text())
                results.append((r.status_code, text))
        except httpx.HTTPError as e:
            results.append(("transport", repr(e)))

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def test_killed_worker_fails_requests_then_restarts_then_gives_up(tmp_path):
    s = Launch("k3-tiny-random", "-tp", "2", "--max-engine-restarts", "1", "--max-model-len", "512",
               tmp_path=tmp_path)
    url = f"http://127.0.0.1:{s.port}"
    try:
        s.wait_healthy(expect_procs=2)  # rank 0 (the engine core) and rank 1
        worker, = worker_pids(s.proc.pid)
        results: list = []
        threads = [in_flight(url, results, stream) for stream in (False, True, False)]
        time.sleep(2.0)  # admitted and stepping
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while True:  # the dead rank set is noticed within a second or so
            code = httpx.post(url + "/v1/completions", json={"model": "k3-tiny-random", "prompt": [1, 2, 3],
                                                            "max_tokens": 2}, timeout=30).status_code
            if code == 503:
                break
            assert time.monotonic() < deadline, f"still answering {code} after the rank died"
            time.sleep(0.2)
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a request in flight was left without an answer"
        by_kind = sorted(results, key=lambda r: str(r[0]))
        assert len(by_kind) == 3
        for status, text in by_kind:
            if status == 200:  # the stream had begun: it ends with an error event, not silently
                events = [json.loads(x[6:]) for x in text.split("\n\n") if x.startswith("data: {")]
                assert any("error" in e for e in events), text[-500:]
            else:
                assert status == 503, (status, text[-500:])
        s.wait_healthy(expect_procs=2)  # restarted once (empty caches), a new rank 1
        worker2, = worker_pids(s.proc.pid)
        assert worker2 != worker
        seen = descendants(s.proc.pid)
        os.kill(worker2, signal.SIGKILL)  # past the last restart: the server exits for its supervisor
        assert s.proc.wait(60) == 1
        deadline = time.monotonic() + 10
        while alive(seen) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(seen), "processes left behind"
        assert "exited with code -9" in s.err.read_text()
    finally:
        s.close()
