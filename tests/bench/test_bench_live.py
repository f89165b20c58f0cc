"""`k3serve bench` against a live `k3serve serve` of a tiny random model (acceptance 2): a small run whose JSON
aggregates agree with a recomputation from its raw timestamps. The server is always stopped."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from k3serve.cli import main

MODEL = "kimi-linear-tiny-random"  # vocabulary of 2048 ids, the bench's default id range
STARTUP_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # uvicorn's graceful shutdown also stops the engine process
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the session this test started
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def live_server(tmp_path_factory):
    pytest.importorskip("k3serve.server.app", reason="k3serve serve is not available in this build")
    port = free_port()
    log = tmp_path_factory.mktemp("live") / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "k3serve", "serve", MODEL, "--host", "127.0.0.1", "--port", str(port),
             "--max-num-seqs", "4", "--max-model-len", "512"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"k3serve serve exited with {proc.returncode}:\n{log.read_text()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=1.0, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"k3serve serve not healthy after {STARTUP_S} s:\n{log.read_text()[-2000:]}")
            time.sleep(0.3)
        yield url
    finally:
        _stop(proc)


def test_bench_against_live_server(live_server, tmp_path, recompute):
    out = tmp_path / "live.json"
    rc = main(["bench", "--base-url", live_server, "--num-prompts", "2", "--input-len", "16", "--output-len", "3",
               "--max-concurrency", "2", "--metric-percentiles", "50,99", "--goodput", "e2el:60000",
               "--disable-tqdm", "--result-file", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["model_id"] == MODEL and res["completed"] == 2 and res["failed"] == 0
    for key, value in recompute(res, {"e2el": 60000}).items():
        assert res[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    for r in res["requests"]:
        # token-id prompts: the server's usage counts exactly our ids; ignore_eos gives exactly max_tokens
        assert r["input_tokens"] == 16 and r["output_tokens"] == 3 and r["output_tokens_from"] == "usage"
        # a chunk per token, even one that decodes to no text: TTFT is the first token's arrival
        assert len(r["chunk_s"]) == 3 and r["send_s"] < r["chunk_s"][0] <= r["end_s"]
    assert res["total_input_tokens"] == 32 and res["total_output_tokens"] == 6
    assert 1 <= res["max_concurrent_requests"] <= 2
