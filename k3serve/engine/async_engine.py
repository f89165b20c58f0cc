"""Asyncio API for the server: submit a request, stream its deltas, abort it, read engine stats.

The engine core (``LLMEngine``) runs in one background thread and talks to the asyncio side only through
typed messages: ``AddRequest`` / ``AbortRequest`` go in through a thread-safe queue, ``RequestOutput`` deltas
come back and are routed to the request's ``asyncio.Queue`` on the caller's event loop. The messages are
plain dataclasses (ints, strings, lists; image tensors and logits-processor objects stay in this process:
the server's own process boundary, ``server/messages.py``, carries images as bytes).

``n > 1`` runs n engine requests ``<id>-<k>`` (the k-th with ``params.for_sample(k)``, as ``LLM`` does) and
merges their deltas into one stream; each delta's ``index`` says which sample it belongs to.

    engine = AsyncLLM(LLMEngine("kimi-linear-tiny-random"))
    async for delta in engine.generate(prompt_ids, SamplingParams(max_tokens=32)):
        print(delta.delta_text, end="")
    await engine.abort(request_id); engine.stats(); engine.shutdown()
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace

from k3serve.engine.engine import LLMEngine
from k3serve.engine.logits_processor import LogitsProcessor
from k3serve.engine.multimodal import ImageInput
from k3serve.engine.outputs import RequestOutput
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.stats import EngineStats

log = logging.getLogger("k3serve.engine")


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    images: tuple[ImageInput, ...] = ()
    logits_processor: LogitsProcessor | None = None


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class Shutdown:
    pass


EngineMessage = AddRequest | AbortRequest | Shutdown


class EngineCoreThread:
    """Runs ``LLMEngine`` in a thread: drains messages, steps while there is work, publishes outputs."""

    def __init__(self, engine: LLMEngine, publish):
        self.engine = engine
        self._publish = publish  # called from this thread with each list of RequestOutput
        self.inbox: queue.Queue[EngineMessage] = queue.Queue()
        self.stats = engine.stats()
        self._thread = threading.Thread(target=self._loop, name="k3serve-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            msgs = [] if self.engine.has_unfinished_requests() else [self.inbox.get()]  # idle: wait for work
            while not self.inbox.empty():
                msgs.append(self.inbox.get_nowait())
            outputs: list[RequestOutput] = []
            for msg in msgs:
                if isinstance(msg, Shutdown):
                    return
                outputs += self._handle(msg)
            if self.engine.has_unfinished_requests():
                outputs += self._step()
            self.stats = self.engine.stats()
            if outputs:
                self._publish(outputs)

    def _handle(self, msg: EngineMessage) -> list[RequestOutput]:
        if isinstance(msg, AbortRequest):
            out = self.engine.abort_request(msg.request_id)
            return [out] if out is not None else []
        try:
            self.engine.add_request(msg.request_id, msg.prompt_token_ids, msg.params, images=msg.images,
                                    logits_processor=msg.logits_processor)
        except ValueError as e:
            return [RequestOutput(msg.request_id, msg.prompt_token_ids, [], "", finished=True,
                                  finish_reason="error", stop_reason=str(e))]
        return []

    def _step(self) -> list[RequestOutput]:
        try:
            return self.engine.step()
        except Exception:  # a failed step must not kill the loop silently: fail every live request
            log.exception("engine step failed; aborting all requests")
            ids = list(self.engine.scheduler.requests)
            return [o for rid in ids if (o := self.engine.abort_request(rid)) is not None]

    def shutdown(self) -> None:
        self.inbox.put(Shutdown())
        self._thread.join()


class AsyncLLM:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        # engine request id -> (caller's loop, its queue, sample index)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput], int]] = {}
        self._groups: dict[str, list[str]] = {}  # caller's request id -> its engine request ids (n > 1)
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.core = EngineCoreThread(engine, self._route)

    def _route(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            with self._lock:
                stream = self._streams.get(out.request_id)
                if out.finished:
                    self._streams.pop(out.request_id, None)
            if stream is None:
                continue
            loop, q, index = stream
            try:
                loop.call_soon_threadsafe(q.put_nowait, replace(out, index=index) if index else out)
            except RuntimeError:  # the caller's event loop is gone: nobody is listening any more
                self.core.inbox.put(AbortRequest(out.request_id))

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       *, images: Sequence[ImageInput] = (),
                       logits_processor: LogitsProcessor | None = None) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its deltas (of all ``params.n`` samples, each with its ``index``) until
        every sample finished; closing the iterator aborts what is still running."""
        n = params.n
        if n > 1 and logits_processor is not None:
            raise ValueError("logits_processor: a processor holds one sequence's state; it needs n = 1")
        self.engine.validate_prompt(prompt_token_ids, params.for_sample(0) if n > 1 else params)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        subs = [rid] if n == 1 else [f"{rid}-{k}" for k in range(n)]
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        with self._lock:
            taken = [s for s in (rid, *subs) if s in self._streams or s in self._groups]
            if taken:
                raise ValueError(f"request_id: {taken[0]!r} is already streaming")
            self._streams.update((s, (loop, q, k)) for k, s in enumerate(subs))
            if n > 1:
                self._groups[rid] = subs
        for k, sub in enumerate(subs):
            self.core.inbox.put(AddRequest(sub, list(prompt_token_ids), params.for_sample(k) if n > 1 else params,
                                           tuple(images), logits_processor))
        live = set(subs)
        try:
            while live:
                out = await q.get()
                if out.finished:
                    live.discard(out.request_id)
                if out.finish_reason == "error":
                    raise ValueError(out.stop_reason)
                yield out
        finally:
            with self._lock:
                self._groups.pop(rid, None)
            for sub in live:
                await self.abort(sub)

    async def abort(self, request_id: str) -> None:
        """Abort a request (all n samples of it)."""
        with self._lock:
            subs = self._groups.pop(request_id, [request_id])
            for sub in subs:
                self._streams.pop(sub, None)
        for sub in subs:
            self.core.inbox.put(AbortRequest(sub))

    def stats(self) -> EngineStats:
        return self.core.stats

    def shutdown(self) -> None:
        self.core.shutdown()
