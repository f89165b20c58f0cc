"""The one async client of the engine: spawns the engine-core process (`engine/core.py`), talks to it over
ZMQ (typed messages only, `engine/messages.py`) and routes its outputs to one asyncio queue per request.
The HTTP server is one user, tests another:

    client = EngineClient({"model": "kimi-linear-tiny-random"}); await client.start()
    async for out in client.generate("r1", prompt_ids, SamplingParams(max_tokens=8)):
        out.token_ids        # this step's new ids; text is the caller's (engine/detokenizer.py)
    await client.shutdown()

An engine process that dies or reports a fatal error is noticed within half a second: every
in-flight request fails with `EngineDead` (HTTP 503) and `/health` turns 503; nothing hangs. Then, up to
``max_restarts`` times in the client's life, a new engine process is started on the same sockets (its
caches start empty; `state` reads "restarting" meanwhile); past that the client stays "dead" and
`gave_up` is set, so the server can exit non-zero for its supervisor to act.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence

import msgspec
import zmq
import zmq.asyncio

from k3serve.core.process import compute_env
from k3serve.engine.core import CoreSpec
from k3serve.engine.messages import (
    AbortRequest,
    AddRequest,
    Fatal,
    HandoffSource,
    ImageData,
    Output,
    Outputs,
    Ready,
    Shutdown,
    Stats,
    Wake,
    encode,
    from_engine_decoder,
)
from k3serve.engine.sampling_params import SamplingParams


log = logging.getLogger("k3serve.engine")


class EngineDead(Exception):
    """The engine process is gone (or never started); the request cannot be served."""


class EngineBusy(Exception):
    """Too many requests are queued; the client should retry later."""


class EngineClient:
    def __init__(self, spec_kwargs: dict, *, max_queued_requests: int = 1024, startup_timeout_s: float = 300.0,
                 max_restarts: int = 0):
        self._spec_kwargs = spec_kwargs
        self.max_restarts = max_restarts
        self.restarts = 0
        self.state = "starting"  # starting | ready | restarting | dead
        self.gave_up = asyncio.Event()
        self._ready_seen = asyncio.Event()
        self.max_queued_requests = max_queued_requests
        self.startup_timeout_s = startup_timeout_s
        self.ready: Ready | None = None
        self.stats = Stats()
        self.dead_reason: str | None = None
        self._streams: dict[str, asyncio.Queue[Output | Exception]] = {}
        self._tasks: list[asyncio.Task] = []
        self._proc: subprocess.Popen | None = None
        self._ctx = zmq.asyncio.Context()
        self._dir = tempfile.mkdtemp(prefix="k3serve-")
        self._push = self._ctx.socket(zmq.PUSH)
        self._pull = self._ctx.socket(zmq.PULL)
        self.last_heard = 0.0
        self._aborts: list[str] = []
        self._wake_pending = False  # a Wake to send (engine/dp_sync.py: another lockstep core got a request)
        self._abort_wake = asyncio.Event()
        self._closed = False
        # admission reservations: a request's slots are held from its handler's admission check until the
        # request's task ends (its response fully sent), so a burst cannot pass the check before any of its
        # streams exist and then overflow inside a stream that already answered 200
        self._held: dict[asyncio.Task, int] = {}

    # lifecycle ----------------------------------------------------------------------------------

    def _addresses(self) -> tuple[str, str]:
        """(requests, outputs) addresses this client binds and its engine core connects to."""
        return f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"

    def _bind(self, in_addr: str, out_addr: str) -> None:
        self._push.bind(in_addr)
        self._pull.bind(out_addr)

    async def start(self) -> Ready:
        in_addr, out_addr = self._addresses()
        self._bind(in_addr, out_addr)
        self._spec = CoreSpec(input_addr=in_addr, output_addr=out_addr, **self._spec_kwargs)
        self._spawn()
        deadline = time.monotonic() + self.startup_timeout_s
        while self.ready is None:
            self._check_starting(deadline)
            if await self._pull.poll(200):
                msg = from_engine_decoder.decode(await self._pull.recv())
                if isinstance(msg, Fatal):
                    raise EngineDead(f"the engine failed to start: {msg.message}")
                if isinstance(msg, Ready):
                    self.ready, self.stats = msg, msg.stats
        self.last_heard = time.monotonic()
        self.state = "ready"
        self._tasks = [asyncio.create_task(c) for c in (self._read(), self._watch(), self._flush_aborts())]
        return self.ready

    def _spawn(self) -> None:
        # started from the event loop's thread: the engine gets SIGTERM if this process dies (core/process.py)
        self._proc = subprocess.Popen([sys.executable, "-m", "k3serve.engine.core",
                                       msgspec.json.encode(self._spec).decode()], stdin=subprocess.DEVNULL,
                                      env=compute_env())

    def _check_starting(self, deadline: float) -> None:
        if self._proc.poll() is not None:
            raise EngineDead(f"the engine process exited with code {self._proc.returncode} while starting")
        if time.monotonic() > deadline:
            raise EngineDead(f"the engine did not start within {self.startup_timeout_s:.0f}s")

    async def shutdown(self) -> None:
        """Stop the engine process (idempotent). One still loading cannot read Shutdown: it gets SIGTERM."""
        if self._closed:
            return
        self._closed = True
        for t in self._tasks:
            t.cancel()
        if self._proc is not None and self._proc.poll() is None and self.ready is None:
            self._proc.terminate()
        if self._proc is not None and self._proc.poll() is None:
            # never block here: a PUSH socket whose peer is already gone would wait forever
            with contextlib.suppress(zmq.ZMQError):
                zmq.Socket.shadow(self._push.underlying).send(encode(Shutdown()), flags=zmq.NOBLOCK)
            try:
                await asyncio.wait_for(asyncio.to_thread(self._proc.wait), 10)
            except TimeoutError:
                self._proc.kill()
                self._proc.wait()
        self._mark_dead("the server is shutting down")
        self._ctx.destroy(linger=0)
        for name in ("in", "out"):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self._dir, name))
        with contextlib.suppress(OSError):
            os.rmdir(self._dir)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def alive(self) -> bool:
        return self.ready is not None and self.dead_reason is None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason
        for q in self._streams.values():
            q.put_nowait(EngineDead(self.dead_reason))
        self._streams.clear()

    async def _read(self) -> None:
        while True:
            msg = from_engine_decoder.decode(await self._pull.recv())
            self.last_heard = time.monotonic()
            if isinstance(msg, Outputs):
                self.stats = msg.stats
                for out in msg.items:
                    q = self._streams.get(out.request_id)
                    if q is not None:
                        q.put_nowait(out)
                        if out.finished:
                            del self._streams[out.request_id]
            elif isinstance(msg, Fatal):
                self._mark_dead(f"engine error: {msg.message}")
            elif isinstance(msg, Ready):  # a restarted engine
                self.ready, self.stats = msg, msg.stats
                self._ready_seen.set()

    async def _watch(self) -> None:
        while not self._closed:
            await asyncio.sleep(0.5)
            if self.dead_reason is None and self._proc is not None and self._proc.poll() is not None:
                self._mark_dead(f"the engine process exited (code {self._proc.returncode})")
            if self.dead_reason is None or self._closed:
                continue
            if self.restarts >= self.max_restarts:
                self.state = "dead"
                log.error("engine dead (%s); %d restart(s) allowed, %d used: giving up", self.dead_reason,
                          self.max_restarts, self.restarts)
                self.gave_up.set()
                return
            await self._restart()

    async def _restart(self) -> None:
        """A new engine process on the same sockets; its caches start empty."""
        self.restarts += 1
        self.state = "restarting"
        log.warning("engine dead (%s): restarting it (%d of %d)", self.dead_reason, self.restarts,
                    self.max_restarts)
        if self._proc is not None and self._proc.poll() is None:  # a fatal error left it running
            self._proc.kill()
        if self._proc is not None:
            await asyncio.to_thread(self._proc.wait)  # reaped: no zombie
        self._ready_seen.clear()
        self._spawn()
        deadline = time.monotonic() + self.startup_timeout_s
        while not self._ready_seen.is_set():
            try:
                self._check_starting(deadline)
            except EngineDead as e:
                self.dead_reason = str(e)
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ready_seen.wait(), 0.2)
        self.last_heard = time.monotonic()
        self.dead_reason, self.state = None, "ready"
        log.warning("engine restarted (pid %d)", self._proc.pid)

    # requests -----------------------------------------------------------------------------------

    def check_admission(self, n: int = 1) -> None:
        """Admit ``n`` engine requests for the calling request's task or raise (EngineDead, EngineBusy),
        before any response byte is sent. The slots stay reserved until that task ends; a second check
        in the same task replaces the first reservation."""
        if not self.alive:
            raise EngineDead(self.dead_reason or "the engine is not ready")
        task = asyncio.current_task()
        others = sum(v for t, v in self._held.items() if t is not task)
        # streams started without an admission check (direct users of generate) count too
        load = max(others, len(self._streams) - self._held.get(task, 0))
        if load + n > self.max_queued_requests:
            raise EngineBusy(f"the server already holds {load} requests "
                             f"(--max-queued-requests {self.max_queued_requests})")
        if task is not None:
            if task not in self._held:
                task.add_done_callback(self._release)
            self._held[task] = n

    def _release(self, task: asyncio.Task) -> None:
        self._held.pop(task, None)

    @property
    def num_admitted(self) -> int:
        return sum(self._held.values())

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                       grammar: str | None = None, logit_bias: dict[int, float] | None = None,
                       images: Sequence[ImageData] = (),
                       handoff: HandoffSource | None = None) -> AsyncIterator[Output]:
        """Yield the request's step outputs until it finishes; leaving early aborts it in the engine.
        ``params`` are one sample's (n = 1: ``fan_out`` expands n); ``images`` fill the prompt's media
        placeholder spans; ``handoff`` (decode role) imports the prompt's caches from a prefill worker instead
        of computing them. Raises EngineDead, or ValueError when the engine refuses the request."""
        if not self.alive:
            raise EngineDead(self.dead_reason or "the engine is not ready")
        # admitted requests reserved their slots (check_admission); this only stops unadmitted callers
        if len(self._streams) >= max(self.max_queued_requests, self.num_admitted):
            raise EngineBusy(f"the server already holds {len(self._streams)} requests "
                             f"(--max-queued-requests {self.max_queued_requests})")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        q: asyncio.Queue[Output | Exception] = asyncio.Queue()
        self._streams[request_id] = q
        finished = False
        try:
            await self._push.send(encode(AddRequest(request_id, list(prompt_token_ids), params, grammar,
                                                    dict(logit_bias or {}), list(images), handoff)))
            while not finished:
                item = await q.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                if item.error is not None:
                    raise ValueError(item.error)
                yield item
        finally:
            if not finished:
                self._streams.pop(request_id, None)
                self.abort_soon(request_id)

    def abort_soon(self, request_id: str) -> None:
        """Queue an abort without awaiting (safe inside a cancelled task); a task batches them."""
        if self.alive:
            self._aborts.append(request_id)
            self._abort_wake.set()

    def wake_soon(self) -> None:
        """Queue a ``Wake`` (safe from synchronous code): the engine leaves its idle wait, as a core that steps
        in lockstep with another that just got a request must."""
        if self.alive:
            self._wake_pending = True
            self._abort_wake.set()

    async def _flush_aborts(self) -> None:
        """Send the queued aborts (and a queued wake) from one task."""
        while True:
            await self._abort_wake.wait()
            self._abort_wake.clear()
            ids, self._aborts = self._aborts, []
            if ids:
                await self._push.send(encode(AbortRequest(ids)))
            if self._wake_pending:
                self._wake_pending = False
                await self._push.send(encode(Wake()))
