"""Logs a newcomer can read: one access line per request (4xx included) and a periodic engine stats
line while the engine works; both can be turned off."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from k3serve.engine.messages import Stats
from k3serve.engine.stats_log import StatsLogger, stats_line
from k3serve.server.access_log import AccessLog
from tests.server.conftest import MODEL


def test_stats_line_rates_and_usage():
    prev = Stats(num_blocks=100, num_admitted_tokens=100, num_prefix_hit_tokens=10, num_computed_tokens=500,
                 num_generated_tokens=50, num_slots=8, num_free_slots=8, num_steps=10)
    cur = Stats(num_running=3, num_waiting=1, num_blocks=100, num_blocks_used=25, num_admitted_tokens=300,
                num_prefix_hit_tokens=110, num_computed_tokens=900, num_generated_tokens=150, num_slots=8,
                num_free_slots=6, num_steps=30)
    line = stats_line(prev, cur, 2.0)
    # 400 tokens fed, 100 of them generated: 300 prompt tokens in 2 s; 100 of 200 admitted tokens hit
    assert line == ("Avg prompt throughput: 150.0 tokens/s, Avg generation throughput: 50.0 tokens/s, "
                    "Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, KDA slot usage: 25.0%, "
                    "Prefix cache hit rate: 50.0%")


def test_stats_logger_only_on_activity_and_interval():
    idle = Stats(num_steps=5)
    logger = StatsLogger(10.0, idle, now=0.0)
    assert logger.update(Stats(num_steps=6, num_running=1), now=5.0) is None  # not due yet
    assert "Running: 1 reqs" in logger.update(Stats(num_steps=9, num_running=1), now=10.0)
    assert "Running: 0 reqs" in logger.update(Stats(num_steps=12), now=20.0)  # the last busy interval
    assert logger.update(Stats(num_steps=12), now=30.0) is None  # idle: quiet
    assert logger.update(Stats(num_steps=12), now=100.0) is None
    assert StatsLogger(0.0, idle, now=0.0).update(Stats(num_steps=99), now=50.0) is None  # disabled


def test_access_log_middleware_logs_every_response(caplog):
    async def app(scope, receive, send):
        status = 404 if scope["path"] == "/missing" else 200
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"x"})

    async def fail(scope, receive, send):
        raise RuntimeError("boom")

    async def main():
        async def send(_m):
            pass

        log = logging.getLogger("test.access")
        for path, asgi in (("/v1/models", app), ("/missing", app), ("/boom", fail)):
            scope = {"type": "http", "method": "GET", "path": path, "query_string": b"", "client": ("1.2.3.4", 5)}
            try:
                await AccessLog(asgi, log)(scope, None, send)
            except RuntimeError:
                pass

    caplog.set_level(logging.INFO, logger="test.access")
    asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(" ms")[0].rsplit(" ", 1)[0] for line in lines] == [
        '1.2.3.4:5 "GET /v1/models" 200', '1.2.3.4:5 "GET /missing" 404', '1.2.3.4:5 "GET /boom" 500']
    assert all(line.endswith(" ms") for line in lines)


def _traffic(server) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 8}
    assert server.post("/v1/completions", body).status_code == 200
    assert server.post("/v1/completions", {**body, "max_tokens": -1}).status_code == 400
    assert httpx.post(server.url + "/v1/completions", json=body).status_code == 401
    assert httpx.get(server.url + "/nope", headers=server.headers).status_code == 404


def _log_after(server, needle: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while needle not in server.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    return server.log.read_text()


def test_server_logs_requests_and_engine_stats(server_factory):
    server = server_factory("--api-contract", "openai", "--log-stats-interval", "1")
    _traffic(server)
    text = _log_after(server, "Avg prompt throughput", 15)
    access = [line for line in text.splitlines() if "k3serve.access" in line]
    for request, status in (("POST /v1/completions", 200), ("POST /v1/completions", 400),
                            ("POST /v1/completions", 401), ("GET /nope", 404)):
        assert any(f'"{request}" {status} ' in line and line.endswith(" ms") for line in access), (request, text)
    stats = [line for line in text.splitlines() if "Avg prompt throughput" in line]
    assert stats and "Running:" in stats[0] and "KDA slot usage" in stats[0] and "Prefix cache hit rate" in stats[0]
    assert "Traceback" not in text


def test_server_logs_can_be_turned_off(server_factory):
    server = server_factory("--api-contract", "openai", "--log-stats-interval", "1", "--disable-access-log",
                            "--disable-log-stats")
    _traffic(server)
    time.sleep(2.5)  # two stats intervals
    text = server.log.read_text()
    assert "k3serve.access" not in text and "Avg prompt throughput" not in text, text
