"""The router under a misbehaving replica (a fake one: raw HTTP/1.1 on 127.0.0.1, in a thread):
a replica's own 500-and-close must not get it removed, only repeated real failures do, and a hung
replica's request fails over once, then ends in a 504 OpenAI error object (never bare text)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import pytest
from fastapi.testclient import TestClient

from k3serve.router.proxy import RouterConfig, build_app


class FakeReplica:
    """Answers /health 200 and /kv_events/info {"enabled": false}; POST bodies holding "boom" get a 500
    with keep-alive headers, then the socket is closed (what a replica does after its own 500), bodies
    holding "hang" never get an answer, others get 200 JSON."""

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.posts = 0
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._conn, "127.0.0.1", self.port))
        ready.set()
        self.loop.run_forever()

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                method, path = lines[0].split()[:2]
                length = next((int(h.split(":")[1]) for h in lines if h.lower().startswith("content-length")), 0)
                body = await reader.readexactly(length) if length else b""
                if method == "POST":
                    self.posts += 1
                if b"hang" in body:
                    await asyncio.sleep(3600)
                if b"boom" in body:
                    writer.write(self._answer(500, {"error": {"message": "boom"}}))
                    await writer.drain()
                    # the close comes a moment later, after the client's next request went out on this
                    # connection, which it had every right to reuse: that request is never read
                    await asyncio.sleep(0.3)
                    writer.close()
                    return
                answer = {"enabled": False} if path == "/kv_events/info" else {"ok": True}
                writer.write(self._answer(200, answer))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    @staticmethod
    def _answer(status: int, obj: dict) -> bytes:
        body = json.dumps(obj).encode()
        return (f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
                f"connection: keep-alive\r\n\r\n").encode() + body

    def stop(self) -> None:
        def close() -> None:
            self.server.close()
            for t in asyncio.all_tasks(self.loop):
                t.cancel()
            self.loop.call_soon(self.loop.stop)

        self.loop.call_soon_threadsafe(close)
        self.thread.join(5)


@pytest.fixture
def fakes():
    made: list[FakeReplica] = []

    def make() -> FakeReplica:
        made.append(FakeReplica())
        return made[-1]

    yield make
    for f in made:
        f.stop()


def completion(client: TestClient, word: str):
    return client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1, "user": word})


def test_a_replicas_own_500_and_close_does_not_remove_it(fakes):
    fake = fakes()
    cfg = RouterConfig(replicas=(fake.url,), policy="round_robin", health_interval_s=60)
    with TestClient(build_app(cfg)) as client:
        proxy = client.app.state.proxy
        for _ in range(4):  # a client looping on a request the replica answers 500 and closes
            assert completion(client, "boom").status_code == 500
            ok = completion(client, "fine")
            assert ok.status_code == 200, ok.text
        assert proxy.replicas.routable() == [0]


def test_hung_replica_fails_over_once_then_504_json(fakes):
    a, b = fakes(), fakes()
    cfg = RouterConfig(replicas=(a.url, b.url), policy="round_robin", health_interval_s=60, request_timeout_s=0.5)
    with TestClient(build_app(cfg)) as client:
        r = completion(client, "hang")
        assert r.status_code == 504
        err = r.json()["error"]
        assert err["code"] == "replica_timeout" and err["type"] == "server_error"
        assert a.posts + b.posts == 2  # tried on one, failed over once to the other


def test_only_repeated_failures_remove_a_replica(fakes):
    fake = fakes()
    cfg = RouterConfig(replicas=(fake.url,), policy="round_robin", health_interval_s=60)
    with TestClient(build_app(cfg)) as client:
        reps = client.app.state.proxy.replicas
        reps.report_failure(0, "ReadError")
        reps.report_failure(0, "ReadError")
        reps.report_ok(0)  # an answer in between: the count starts again
        reps.report_failure(0, "ReadError")
        reps.report_failure(0, "ReadError")
        assert reps.routable() == [0]
        reps.report_failure(0, "ReadTimeout")
        assert reps.routable() == [] and "3 requests in a row" in reps.replicas[0].down_reason
