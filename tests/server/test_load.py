"""Load and robustness (slow): 200 concurrent streaming clients all complete; 1000 clients that
disconnect mid-stream leave the engine's pools full; schemathesis finds no 5xx in /openapi.json."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess

import httpx
import pytest

from tests.server.conftest import API_KEY, MODEL
from tests.server.test_lifecycle import metric

pytestmark = pytest.mark.slow
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def load_server(server_factory):
    return server_factory("--api-contract", "openai", "--max-num-seqs", "64", "--max-queued-requests", "4096")


async def _stream(client: httpx.AsyncClient, url: str, max_tokens: int, stop_after: int | None = None) -> dict:
    body = {"model": MODEL, "messages": USER, "max_tokens": max_tokens, "stream": True,
            "thinking": {"type": "disabled"}, "stream_options": {"include_usage": True}}
    frames = []
    async with client.stream("POST", url, json=body, headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                frames.append(line[6:])
                if stop_after is not None and len(frames) >= stop_after:
                    return {"frames": frames}  # leaving the context closes the connection mid-stream
    return {"frames": frames}


def test_200_concurrent_streams_complete(load_server):
    url = load_server.url + "/v1/chat/completions"

    async def main():
        limits = httpx.Limits(max_connections=250)
        async with httpx.AsyncClient(timeout=900, limits=limits) as c:
            return await asyncio.gather(*(_stream(c, url, 4) for _ in range(200)))

    results = asyncio.run(main())
    for res in results:
        assert res["frames"][-1] == "[DONE]"
        usage = json.loads(res["frames"][-2])["usage"]
        assert usage["completion_tokens"] == 4


def test_1000_disconnects_leave_pools_full(load_server):
    url = load_server.url + "/v1/chat/completions"

    async def main():
        async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=100)) as c:
            sem = asyncio.Semaphore(100)

            async def one():
                async with sem:
                    return await _stream(c, url, 500, stop_after=2)

            return await asyncio.gather(*(one() for _ in range(1000)))

    results = asyncio.run(main())
    assert len(results) == 1000
    from tests.server.test_lifecycle import wait_idle

    wait_idle(load_server, timeout=300)  # engine holds nothing: every block and KDA slot is free again
    assert metric(load_server, "vllm:num_requests_running") == 0


@pytest.mark.skipif(shutil.which("schemathesis") is None, reason="schemathesis is not installed")
def test_schemathesis_no_server_errors(server_factory, tmp_path):
    # a short context keeps fuzzed generations short (any max_tokens is capped by the context)
    s = server_factory("--api-contract", "openai", "--max-model-len", "160")
    cmd = ["schemathesis", "run", s.url + "/openapi.json", "--checks", "not_a_server_error",
           "--max-examples", "20", "-H", f"Authorization: Bearer {API_KEY}", "--request-timeout", "300",
           "--exclude-path", "/metrics"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=tmp_path)  # its cache dir
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert httpx.get(s.url + "/health").status_code == 200
