"""Overload: admission reserves a request's engine slots until its response ends, so requests beyond
capacity get 429 before any byte; a stream that fails after its 200 still ends with an error frame and
[DONE] (never a bare close, which a client cannot tell from a network fault)."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.testclient import TestClient

from k3serve.engine.client import EngineBusy, EngineClient, EngineDead
from k3serve.server.generation import EventStream


def idle_client(limit: int) -> EngineClient:
    client = EngineClient({}, max_queued_requests=limit)
    client.ready = object()  # admission only looks at liveness and counts; no engine process needed
    return client


def test_admission_holds_slots_until_the_request_task_ends():
    async def main():
        client = idle_client(2)
        gate = asyncio.Event()

        async def request(n: int):
            client.check_admission(n)  # the handler's check, before its stream has started any engine request
            await gate.wait()

        first = asyncio.create_task(request(2))
        await asyncio.sleep(0)
        try:
            with pytest.raises(EngineBusy):  # the burst's second request: refused before any body, not mid-stream
                client.check_admission(1)
        finally:
            gate.set()
        await first
        await asyncio.sleep(0)
        assert client.num_admitted == 0  # the first request's slots came back when its task ended
        await asyncio.create_task(request(1))

    asyncio.run(main())


def test_second_check_in_one_request_replaces_its_reservation():
    async def main():
        client = idle_client(2)
        client.check_admission(1)
        client.check_admission(2)  # the batch size, known later in the same handler: not 1 + 2
        assert client.num_admitted == 2

    asyncio.run(main())


def frames(body: bytes) -> list[str]:
    return [f.removeprefix("data: ") for f in body.decode().split("\n\n") if f]


@pytest.mark.parametrize("exc, kind", [(EngineBusy("full"), "rate_limit_exceeded"),
                                       (EngineDead("gone"), "service_unavailable"), (RuntimeError("bug"), "server_error")])
def test_a_stream_failing_after_its_200_ends_with_an_error_frame_and_done(exc, kind):
    async def body():
        yield b'data: {"choices": []}\n\n'
        raise exc

    app = Starlette(routes=[Route("/s", lambda _r: EventStream(body()), methods=["GET"])])
    with TestClient(app) as c:
        r = c.get("/s")
    got = frames(r.content)
    assert r.status_code == 200 and got[-1] == "[DONE]"
    err = json.loads(got[-2])["error"]
    assert err["type"] == kind and err["message"] and "Traceback" not in r.text


@pytest.mark.parametrize("exc, kind", [(EngineBusy("full"), "rate_limit_error"), (EngineDead("gone"), "overloaded_error"),
                                       (RuntimeError("bug"), "api_error"), (ValueError("x: bad"), "invalid_request_error")])
def test_a_messages_stream_failing_after_its_200_ends_with_an_anthropic_error_event(exc, kind):
    from k3serve.server.anthropic import anthropic_error_frame

    async def body():
        yield b'event: message_start\ndata: {"type": "message_start"}\n\n'
        raise exc

    app = Starlette(routes=[Route("/s", lambda _r: EventStream(body(), error_frame=anthropic_error_frame),
                                  methods=["GET"])])
    with TestClient(app) as c:
        r = c.get("/s")
    last = r.content.decode().rstrip("\n").split("\n\n")[-1]
    assert r.status_code == 200 and last.startswith("event: error\ndata: ") and "[DONE]" not in r.text
    err = json.loads(last.split("data: ", 1)[1])
    assert err["type"] == "error" and err["error"]["type"] == kind and err["error"]["message"]
