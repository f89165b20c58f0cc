"""Nacks: a hand-off that the decode side will never import is freed on the prefill side at once, not at its
``--handoff-timeout`` (600 s here, so only a nack can free it within the test). The decode core nacks what it
refuses when it is added (a bad request) or aborts before fetching; the prefill/decode router nacks when the
decode worker answers with an error, when no decode worker takes the request, and when the decode worker dies
before or while answering. A decode answer of 200 is not nacked (the decode side acks what it imports)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from k3serve.engine.core import EngineCore
from k3serve.engine.core_spec import CoreSpec
from k3serve.engine.messages import AddRequest, HandoffSource
from k3serve.engine.pd.transport import ZmqSender
from k3serve.engine.pd.worker import PrefillSide
from k3serve.engine.sampling_params import SamplingParams
from k3serve.router.disagg import DisaggConfig, build_app

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PREFILL, DECODE = "http://prefill.test", "http://decode.test"


@pytest.fixture
def held(tiny, pd):
    """A prefill side holding one hand-off ("r"), its timeout far away."""
    sender = ZmqSender()
    pre = PrefillSide(pd.make_engine(tiny), sender, timeout_s=600)
    prompt = pd.prompts(1, 40, 40, seed=21)[0]
    pd.prefill(pre.engine, "r", prompt, PARAMS)
    pre.pump()
    assert pre.engine.scheduler.held and not pd.pools_full(pre.engine)
    yield pre, prompt
    sender.close()


def _freed(pre: PrefillSide, pd, wait_s: float = 5.0) -> bool:
    """Pump the prefill side (as its core loop would) until its pools are full, for at most ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        pre.pump()
        if pd.pools_full(pre.engine):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


@pytest.fixture
def decode_core():
    spec = CoreSpec("k3-tiny-random", "", "", role="decode", kv_cache_memory=16 * 2**20, max_model_len=256,
                    max_num_seqs=4, max_num_batched_tokens=16, log_stats_interval=0)
    core = EngineCore(spec)
    yield core
    core.pd.close()


def test_decode_core_refusing_at_add_nacks(held, decode_core, pd):
    pre, prompt = held
    ticket = HandoffSource(pre.sender.address, "r")
    too_long = prompt * 8  # over max_model_len: refused before anything is reserved or fetched
    [out] = decode_core.handle(AddRequest("d", too_long, PARAMS, handoff=ticket))
    assert out.finished and out.error
    assert _freed(pre, pd)
    assert pre.counters.transfers == 0 and decode_core.pd.decode.counters.failures == 1


def test_decode_core_aborting_before_the_fetch_nacks(held, decode_core, pd):
    pre, prompt = held
    assert decode_core.handle(AddRequest("d", prompt, PARAMS, handoff=HandoffSource(pre.sender.address, "r"))) == []
    decode_core.pd.abort("d")  # the client went away before this side had room (no pump ran)
    assert _freed(pre, pd) and pd.pools_full(decode_core.engine)


class _Dies(httpx.AsyncByteStream):
    """A decode worker's answer that breaks off: its process was killed."""

    async def __aiter__(self):
        yield b'data: {"choices": []}\n\n'
        raise httpx.ReadError("connection reset")


def _route(pre: PrefillSide, decode, stream: bool) -> tuple[int, bytes, dict]:
    """One request through the P/D router; the prefill worker answers with ``pre``'s held hand-off, the decode
    worker with ``decode(request)``. Returns the router's status, body and ``/router/workers``."""
    def worker(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill.test":
            return httpx.Response(200, json={"choices": [], "kv_transfer_params": {
                "address": pre.sender.address, "request_id": "r"}})
        return decode(request)

    async def main():
        app = build_app(DisaggConfig((PREFILL,), (DECODE,)))
        proxy = app.state.proxy
        await proxy.client.aclose()
        proxy.client = httpx.AsyncClient(transport=httpx.MockTransport(worker))
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://router") as c:
                r = await c.post("/v1/completions", json={"model": "m", "prompt": [1, 2, 3], "stream": stream})
                return r.status_code, r.content, (await c.get("/router/workers")).json()
        finally:
            await proxy.client.aclose()
            proxy.nacker.close()

    return asyncio.run(main())


def _refused(request):
    raise httpx.ConnectError("connection refused", request=request)


@pytest.mark.parametrize("decode, stream, status", [
    (lambda r: httpx.Response(503, json={"error": {"message": "overloaded"}}), False, 503),
    (lambda r: httpx.Response(400, json={"error": {"message": "bad"}}), True, 400),
    (_refused, False, 503),  # no decode worker takes it
    (lambda r: httpx.Response(200, stream=_Dies()), False, 502),  # dies before its JSON answer is complete
    (lambda r: httpx.Response(200, stream=_Dies()), True, 200),  # dies mid-stream (the error is an SSE event)
], ids=["503", "400-stream", "refused", "dies", "dies-mid-stream"])
def test_router_nacks_what_the_decode_side_will_not_import(held, pd, decode, stream, status):
    pre, _ = held
    code, body, workers = _route(pre, decode, stream)
    assert code == status
    if code == 200:
        assert b"worker_failed" in body
    assert workers["nacks"] == 1
    assert _freed(pre, pd)


def test_router_does_not_nack_a_decode_answer(held, pd):
    pre, _ = held
    code, _, workers = _route(pre, lambda r: httpx.Response(200, json={"choices": []}), False)
    assert code == 200 and workers["nacks"] == 0
    assert not _freed(pre, pd, wait_s=0.5)  # held until the decode side acks (or the timeout)
