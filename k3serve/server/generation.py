"""Running engine requests at once and merging their steps into one stream: the n choices of one
prompt, or every choice of every prompt of a `/v1/completions` batch.

Each choice is its own engine request, from the engine's one `n` fan-out (`sampling_params.fan_out`, which
the offline `LLM` uses too). Leaving the merged iterator early (client gone, stop string, error) closes every
choice's engine stream, which aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import StreamingResponse

from k3serve.core.errors import error_body
from k3serve.engine.client import EngineBusy, EngineDead
from k3serve.engine.sampling_params import SamplingParams, fan_out
from k3serve.server.choice import ChoiceDecoder

log = logging.getLogger("k3serve.server")
T = TypeVar("T")
_END = object()


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def run_choices(client, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                decoders: Sequence[ChoiceDecoder], *, grammar: str | None = None,
                logit_bias: dict[int, float] | None = None, images: Sequence[Any] = (),
                handoff: Any = None) -> AsyncIterator[tuple[int, Any, list]]:
    """Yield `(choice index, deltas or text, logprobs)` per engine step of any of `sampling.n` choices.
    `handoff` (one choice only): import the prompt's caches from a prefill worker."""
    requests = [(rid, prompt_ids, params) for rid, params in fan_out(request_id, sampling)]
    return run_requests(client, requests, decoders, grammar=grammar, logit_bias=logit_bias, images=images,
                        handoff=handoff)


async def run_requests(client, requests: Sequence[tuple[str, list[int], SamplingParams]],
                       decoders: Sequence[ChoiceDecoder], *, grammar: str | None = None,
                       logit_bias: dict[int, float] | None = None, images: Sequence[Any] = (),
                       handoff: Any = None) -> AsyncIterator[tuple[int, Any, list]]:
    """Run the `(request id, prompt ids, sampling)` requests at once, request j decoded by `decoders[j]`;
    yield `(j, deltas or text, logprobs)` per engine step of any of them. A failing request, or leaving
    early, aborts all of them."""
    n = len(requests)
    if n == 1:
        # one request (the common case): read its stream here, without a merging task and queue,
        # which would cost two more task switches per token
        dec = decoders[0]
        rid, prompt_ids, sampling = requests[0]
        stream = client.generate(rid, prompt_ids, sampling, grammar=grammar, logit_bias=logit_bias, images=images,
                                 handoff=handoff)
        async with contextlib.aclosing(stream):  # see `one` below
            async for out in stream:
                items, lps = dec.push(out)
                yield 0, items, lps
                if dec.done:
                    break
        return
    if handoff is not None:
        raise ValueError("kv_transfer_params: a hand-off carries one choice")
    q: asyncio.Queue = asyncio.Queue()

    async def one(j: int) -> None:
        dec = decoders[j]
        rid, prompt_ids, sampling = requests[j]
        stream = client.generate(rid, prompt_ids, sampling, grammar=grammar, logit_bias=logit_bias, images=images)
        try:
            # aclosing: leaving early (a stop string, the one call of parallel_tool_calls=false)
            # closes the stream now, which aborts the engine request at once, not at garbage collection
            async with contextlib.aclosing(stream):
                async for out in stream:
                    items, lps = dec.push(out)
                    q.put_nowait((j, items, lps))
                    if dec.done:
                        break
        except Exception as e:  # noqa: BLE001 - re-raised in the consumer
            q.put_nowait((j, e, None))
        finally:
            q.put_nowait((j, _END, None))

    tasks = [asyncio.create_task(one(j)) for j in range(n)]
    try:
        remaining = n
        while remaining:
            j, item, lps = await q.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield j, item, lps
    finally:
        for t in tasks:
            t.cancel()


async def until_disconnected(request: Request, work: Awaitable[T], poll_s: float = 0.5) -> T:
    """Run `work`; cancel it (aborting its engine requests) if the client goes away first."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                raise asyncio.CancelledError("client disconnected")
    finally:
        if not task.done():
            task.cancel()


def usage(prompt_tokens: int, completion_tokens: int, *, cached: int = 0, reasoning: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
            "completion_tokens_details": {"reasoning_tokens": reasoning}}


class Timer:
    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None

    def mark_first(self) -> None:
        if self.first is None:
            self.first = time.perf_counter()


SSE_DONE = b"data: [DONE]\n\n"


def stream_error_body(e: Exception) -> dict[str, Any]:
    """The OpenAI error object for an exception that ended a stream after its 200 went out."""
    if isinstance(e, EngineDead):
        return error_body(503, f"the engine is unavailable: {e}", "engine_unavailable")
    if isinstance(e, EngineBusy):
        return error_body(429, f"the server is overloaded: {e}", "rate_limit_exceeded")
    if isinstance(e, ValueError):
        return error_body(400, str(e) or "invalid request", "invalid_request")
    return error_body(500, f"internal error ({type(e).__name__}); the response is incomplete", "internal_error")


def openai_error_frame(e: Exception) -> bytes:
    return sse(stream_error_body(e)) + SSE_DONE


def sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


class EventStream(StreamingResponse):
    """An SSE response that stops generating as soon as the client disconnects, whatever the
    ASGI version: the body runs beside a disconnect listener, and the body iterator is always
    closed, which aborts the engine requests behind it."""

    def __init__(self, body: AsyncIterator[bytes], media_type: str = "text/event-stream",
                 error_frame: Callable[[Exception], bytes] | None = None):
        super().__init__(body, media_type=media_type, headers={"cache-control": "no-cache"})
        self.body = body
        self.error_frame = error_frame or openai_error_frame

    async def __call__(self, scope, receive, send) -> None:
        import anyio

        async def stream() -> None:
            try:
                await send({"type": "http.response.start", "status": self.status_code,
                            "headers": self.raw_headers})
                try:
                    async for chunk in self.body:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                except Exception as e:  # noqa: BLE001 - the 200 is out: the stream must still end legibly
                    # a client cannot tell a closed connection from a network fault (and retries blindly):
                    # whatever went wrong, the stream ends with an error frame (and [DONE])
                    if not isinstance(e, (EngineDead, EngineBusy, ValueError)):
                        log.exception("stream failed")
                    await send({"type": "http.response.body", "body": self.error_frame(e), "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:
                pass
            finally:
                tg.cancel_scope.cancel()

        async def listen() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(stream)
                tg.start_soon(listen)
        finally:
            with contextlib.suppress(Exception):
                await self.body.aclose()
