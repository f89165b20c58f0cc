"""The two ends of a hand-off inside an engine-core process (``engine/core.py``), driven by its loop.

``PrefillSide`` (role prefill): every prefill-only request that reached its first token is held with a
deadline; a ``Fetch`` is answered with its manifest, an ``Ack`` (or the deadline) releases its slot and blocks.

``DecodeSide`` (role decode or both): an ``AddRequest`` that names a hand-off source waits until a running slot
and the prompt's blocks can be reserved, then fetches (naming the blocks its prefix cache already holds);
the manifest is verified and imported, the request decodes from the next step, and the sender is acked. A
refusal, a failed check or no answer within the timeout ends the request with an error. Whatever this side
will not import (refused when added, aborted, failed) is acked negatively, so the sender frees it at once.

Both count what ``/metrics`` shows: bytes and time of transfers, and how long requests queued or were held.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from k3serve.engine.logits_processor import LogitsProcessor
from k3serve.engine.multimodal import ImageInput, check_images
from k3serve.engine.pd.handoff import export, held_hashes, import_manifest, reserve
from k3serve.engine.pd.manifest import HandoffError, Manifest
from k3serve.engine.pd.transport import Ack, Fetch, Receiver, Refusal, Sender
from k3serve.engine.sampling_params import SamplingParams

log = logging.getLogger("k3serve.engine")


@dataclass
class HandoffCounters:
    transfers: int = 0  # manifests sent (prefill) or imported (decode)
    failures: int = 0  # refused, corrupt, timed out
    bytes: int = 0  # manifest bytes sent (prefill) or received (decode)
    transfer_s: float = 0.0  # prefill: export + send; decode: fetch sent -> imported
    queue_s: float = 0.0  # prefill: first token -> released (held); decode: added -> fetch sent (no room yet)
    cached_tokens: int = 0  # prompt positions whose latents did not cross: the decode side's prefix-cache hit


class PrefillSide:
    def __init__(self, engine, sender: Sender, *, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.engine, self.sender, self.timeout_s, self.clock = engine, sender, timeout_s, clock
        self.held_since: dict[str, float] = {}
        self.counters = HandoffCounters()

    def pump(self) -> None:
        """Start the clock on newly held requests, answer fetches and acks, release what timed out."""
        now = self.clock()
        sched = self.engine.scheduler
        for rid, req in sched.held.items():
            if req.prefill_only and rid not in self.held_since:
                self.held_since[rid] = now
        for peer, msg in self.sender.receive():
            if isinstance(msg, Fetch):
                self._answer(peer, msg)
            else:
                if not msg.ok:
                    log.warning("hand-off %s: the decode side gave up: %s", msg.request_id, msg.error)
                self._release(msg.request_id, "handoff")
        for rid, since in list(self.held_since.items()):
            if now - since > self.timeout_s:
                log.warning("hand-off %s: no ack within %.0fs; releasing its slot and blocks", rid, self.timeout_s)
                self.counters.failures += 1
                self._release(rid, "handoff timeout")

    def _answer(self, peer: bytes, msg: Fetch) -> None:
        t0 = time.perf_counter()
        try:
            manifest, payloads = export(self.engine, msg.request_id, msg.held_hashes, msg.block_size)
        except Exception as e:  # noqa: BLE001 - a failed export fails this hand-off, not the process
            if not isinstance(e, HandoffError):
                log.exception("hand-off %s: export failed", msg.request_id)
            self.counters.failures += 1
            self.sender.refuse(peer, msg.request_id, str(e) if isinstance(e, HandoffError)
                               else f"export failed: {type(e).__name__}: {e}")
            return
        self.counters.bytes += self.sender.send(peer, manifest, payloads)
        self.counters.cached_tokens += manifest.start
        self.counters.transfers += 1
        self.counters.transfer_s += time.perf_counter() - t0

    def _release(self, rid: str, reason: str) -> None:
        since = self.held_since.pop(rid, None)
        if since is not None:
            self.counters.queue_s += self.clock() - since
        req = self.engine.scheduler.held.get(rid)
        if req is not None and req.prefill_only:
            self.engine.scheduler.finish(req, reason)


@dataclass
class _Pending:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    address: str  # the sender's
    remote_id: str  # the request's id on the sender
    added: float
    fetched: float = 0.0
    images: tuple[ImageInput, ...] = ()
    processor: LogitsProcessor | None = field(default=None, repr=False)


class DecodeSide:
    def __init__(self, engine, receiver: Receiver, *, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.engine, self.receiver, self.timeout_s, self.clock = engine, receiver, timeout_s, clock
        self.waiting: deque[_Pending] = deque()  # no room reserved yet
        self.fetching: dict[str, _Pending] = {}  # by remote id: reserved, fetch sent
        self.counters = HandoffCounters()

    def __contains__(self, request_id: str) -> bool:
        return any(p.request_id == request_id for p in (*self.waiting, *self.fetching.values()))

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, address: str,
            remote_id: str, *, images=(), logits_processor: LogitsProcessor | None = None) -> None:
        """Queue an import. ``images``: the request's, as the prefill side got them (they key its blocks);
        ``logits_processor``: its grammar / logit_bias, fresh (it consumes the hand-off's first token first)."""
        if request_id in self.engine.scheduler.requests or request_id in self:
            raise ValueError(f"request_id: {request_id!r} is already in the engine")
        self.engine.validate_prompt(prompt_token_ids, params)
        checked = check_images(images, prompt_token_ids, self.engine.model_config)
        self.waiting.append(_Pending(request_id, list(prompt_token_ids), params, address, remote_id, self.clock(),
                                     images=checked, processor=logits_processor))

    def nack(self, address: str, remote_id: str, error: str) -> None:
        """Tell a sender to free a hand-off this side will not fetch (refused at add time, aborted before its
        fetch): its slot and blocks come back now, not at its timeout."""
        self.receiver.ack(address, Ack(remote_id, False, error))

    def abort(self, request_id: str) -> None:
        for p in [p for p in self.waiting if p.request_id == request_id]:  # never fetched: the sender is told now
            self.waiting.remove(p)
            self.nack(p.address, p.remote_id, "aborted on the decode side")
        for remote, p in list(self.fetching.items()):
            if p.request_id == request_id:  # the late manifest is refused on arrival; the sender is told now
                del self.fetching[remote]
                self.receiver.ack(p.address, Ack(p.remote_id, False, "aborted on the decode side"))
                self.engine.abort_request(request_id)

    def pump(self) -> list[tuple[str, object]]:
        """Reserve and fetch what fits, import what arrived, fail what timed out. Returns ``(request id,
        RequestOutput | error message)`` for every request that got its first token or failed."""
        out: list[tuple[str, object]] = []
        while self.waiting:
            p = self.waiting[0]
            req = reserve(self.engine, p.request_id, p.prompt_token_ids, p.params, images=p.images,
                          logits_processor=p.processor)
            if req is None:
                break
            self.waiting.popleft()
            p.fetched = self.clock()
            self.counters.queue_s += p.fetched - p.added
            self.fetching[p.remote_id] = p
            self.receiver.fetch(p.address, Fetch(p.remote_id, held_hashes(req), self.engine.blocks.block_size))
        for address, msg, payloads in self.receiver.receive():
            p = self.fetching.get(msg.request_id)
            if p is None or p.address != address:  # aborted meanwhile (the sender was told then), or unasked
                continue
            del self.fetching[msg.request_id]
            out.append((p.request_id, self._finish(p, msg, payloads)))
        now = self.clock()
        while self.waiting and now - self.waiting[0].added > self.timeout_s:
            p = self.waiting.popleft()  # never a hang: no room within the timeout fails the request
            out.append((p.request_id, self._fail(p, f"hand-off {p.remote_id}: no room for its caches within "
                                                    f"{self.timeout_s:.0f}s", reserved=False)))
        for remote, p in list(self.fetching.items()):
            if now - p.fetched > self.timeout_s:
                del self.fetching[remote]
                out.append((p.request_id, self._fail(p, f"hand-off {remote}: no manifest from {p.address} "
                                                        f"within {self.timeout_s:.0f}s")))
        return out

    def _finish(self, p: _Pending, msg: Manifest | Refusal, payloads: list) -> object:
        if isinstance(msg, Refusal):
            return self._fail(p, f"the prefill worker refused the hand-off: {msg.error}", ack=False)
        req = self.engine.scheduler.held.get(p.request_id)
        try:
            first = import_manifest(self.engine, req, msg, payloads)
        except Exception as e:  # noqa: BLE001 - a failed import fails this request, not the process
            if not isinstance(e, HandoffError):
                log.exception("hand-off of %s: import failed", p.request_id)
            return self._fail(p, str(e) if isinstance(e, HandoffError)
                              else f"import failed: {type(e).__name__}: {e}")
        self.receiver.ack(p.address, Ack(p.remote_id, True))
        self.counters.transfers += 1
        self.counters.bytes += sum(len(x) for x in payloads)
        self.counters.cached_tokens += msg.start
        self.counters.transfer_s += self.clock() - p.fetched
        return first

    def _fail(self, p: _Pending, error: str, *, ack: bool = True, reserved: bool = True) -> str:
        log.warning("hand-off of %s failed: %s", p.request_id, error)
        self.counters.failures += 1
        if ack:  # the sender frees its copy now, not at its own timeout
            self.receiver.ack(p.address, Ack(p.remote_id, False, error))
        if reserved:
            self.engine.abort_request(p.request_id)
        return error
