"""Two "hosts" on 127.0.0.1: ``k3serve serve -tp 2 --nnodes 2 --node-rank 0`` serves HTTP with rank 0, a second
``--node-rank 1`` command runs rank 1 only (no HTTP); they meet at --master-addr/--master-port, answer greedy
completions, and when host 0 stops, host 1's rank is told to stop through the step broadcast and exits 0."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from k3serve.engine.ranks import free_port
from tests.server.test_process_lifetime import Launch

pytestmark = pytest.mark.slow  # two model loads


def test_node_rank_1_runs_the_other_rank_and_stops_with_host_0(tmp_path):
    port = str(free_port())
    flags = ["k3-tiny-random", "-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port,
             "--max-model-len", "256"]
    host1 = subprocess.Popen([sys.executable, "-m", "k3serve", "serve", *flags, "--node-rank", "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    (tmp_path / "h0").mkdir()
    host0 = Launch(*flags, tmp_path=tmp_path / "h0")
    try:
        host0.wait_healthy(expect_procs=1)  # rank 0 only: rank 1 is host 1's
        r = httpx.post(f"http://127.0.0.1:{host0.port}/v1/completions", timeout=120,
                       json={"model": "k3-tiny-random", "prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        host0.proc.send_signal(2)  # SIGINT: a graceful stop, engine and its ranks included
        assert host0.proc.wait(60) == 130
        out = host1.communicate(timeout=60)[0]
        assert host1.returncode == 0, out[-2000:]
        assert "host 1 runs tensor-parallel ranks 1" in out
    finally:
        host0.close()
        if host1.poll() is None:
            host1.kill()
            host1.wait()
