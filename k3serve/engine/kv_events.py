"""KV-cache events of one engine: what entered and left its prefix cache, for a KV-aware router.

``KVEventRecorder`` is the only thing the cache code touches: ``BlockPool``, ``StatePool`` and
``HybridPrefixCache`` hold an ``events`` attribute that is None unless a recorder is attached
(``attach``), so with events off a hook costs one attribute test. With a recorder each hook appends
one tuple; ``take()`` turns them into ``core.kv_events`` messages, merging runs of chained blocks.

``KVEventPublisher`` (engine-core process) sends every batch on a ZMQ PUB socket, an empty batch after a
quiet second (so a subscriber notices a lost trailing batch), and answers full-state requests on a ROUTER
socket; the messages and the framing are ``core.kv_events``'s. Given a ``core.kv_auth.KVEventsKey`` both
sockets are CURVE servers behind a ZAP handler that admits only the key's client (the router); the engine
must then also hash its blocks with ``key.hash_key`` (``EngineConfig.hash_key``).
"""

from __future__ import annotations

import socket
import time
from typing import Any

import msgspec

from k3serve.core.kv_auth import KVEventsKey, make_server, start_authenticator
from k3serve.core.kv_events import (
    SNAPSHOT_REQUEST,
    TOPIC,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    KVEventsInfo,
    ReplicaState,
    SnapshotRemoved,
    SnapshotStored,
)

_STORED, _REMOVED, _CLEARED, _SNAP_STORED, _SNAP_REMOVED = range(5)
_MAX_DEPTH_HINTS = 4096
_encoder = msgspec.msgpack.Encoder()


class KVEventRecorder:
    """Collects cache changes between two ``take()`` calls; also keeps the depth of every live snapshot
    (the state pool stores keys only) so a full-state reply can carry depths."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._log: list[tuple[int, int, Any]] = []
        self._depth_hint: dict[int, int] = {}  # snapshot key -> depth, noted when the key is computed
        self.snapshot_depth: dict[int, int] = {}  # published snapshot key -> depth

    # hooks (called by the cache code) ----------------------------------------------------------------

    def block_stored(self, block_hash: int, parent: int | None) -> None:
        self._log.append((_STORED, block_hash, parent))

    def block_removed(self, block_hash: int) -> None:
        self._log.append((_REMOVED, block_hash, None))

    def all_cleared(self) -> None:
        self._log.append((_CLEARED, 0, None))

    def note_snapshot_depth(self, key: int, depth: int) -> None:
        hints = self._depth_hint
        hints[key] = depth
        if len(hints) > _MAX_DEPTH_HINTS:  # keys planned but never published; the map is a pure function
            del hints[next(iter(hints))]

    def snapshot_stored(self, key: int) -> None:
        depth = self._depth_hint.pop(key, None)
        if depth is not None:  # unknown depth cannot happen today (keys are noted just before publishing)
            self.snapshot_depth[key] = depth
            self._log.append((_SNAP_STORED, key, depth))

    def snapshot_removed(self, key: int) -> None:
        if self.snapshot_depth.pop(key, None) is not None:
            self._log.append((_SNAP_REMOVED, key, None))

    # reading -----------------------------------------------------------------------------------------

    def take(self) -> list[KVEvent]:
        """The events recorded since the last call, in order; consecutive chained stores (and consecutive
        removals) become one event."""
        log, self._log = self._log, []
        out: list[KVEvent] = []
        run: list[int] = []
        run_parent: int | None = None
        removed: list[int] = []

        def flush() -> None:
            nonlocal run, removed
            if run:
                out.append(BlockStored(tuple(run), run_parent, len(run) * self.block_size))
                run = []
            if removed:
                out.append(BlockRemoved(tuple(removed)))
                removed = []

        for kind, key, extra in log:
            if kind == _STORED:
                if removed or (run and run[-1] != extra):
                    flush()
                if not run:
                    run_parent = extra
                run.append(key)
            elif kind == _REMOVED:
                if run:
                    flush()
                removed.append(key)
            else:
                flush()
                if kind == _SNAP_STORED:
                    out.append(SnapshotStored(key, extra))
                elif kind == _SNAP_REMOVED:
                    out.append(SnapshotRemoved(key))
                else:
                    out.append(AllBlocksCleared())
        flush()
        return out


def attach(engine: Any) -> KVEventRecorder:
    """Hook a new recorder into an ``LLMEngine``'s block pool, state pool and prefix cache. Attach before
    the first request so that every live snapshot's depth is known."""
    rec = KVEventRecorder(engine.blocks.block_size)
    engine.blocks.events = rec
    engine.states.events = rec
    engine.scheduler.cache.events = rec
    return rec


def full_state(engine: Any, rec: KVEventRecorder, seq: int) -> ReplicaState:
    snaps = tuple((k, rec.snapshot_depth[k]) for k in engine.states.snapshot_of if k in rec.snapshot_depth)
    return ReplicaState(seq, tuple(engine.blocks.hash_to_block), snaps)


def _bind_host(host: str) -> str:
    try:
        return socket.gethostbyname(host) if host not in ("*", "0.0.0.0") else "0.0.0.0"
    except OSError:
        raise ValueError(f"cannot bind KV event sockets on host {host!r}") from None


class KVEventPublisher:
    """The engine-core side: a PUB socket for batches and a ROUTER socket for full-state requests, both on
    free TCP ports of ``host``. Single-threaded: the engine loop calls ``pump`` after each iteration."""

    HEARTBEAT_S = 1.0

    def __init__(self, engine: Any, host: str, key: KVEventsKey | None = None) -> None:
        import zmq

        self._zmq = zmq
        self.engine = engine
        bind = _bind_host(host)
        if engine.config.hash_key != (key.hash_key if key is not None else b""):
            raise ValueError("the engine must hash its blocks with the KV events key (EngineConfig.hash_key)")
        self.recorder = attach(engine)
        self.seq = -1
        self._ctx = zmq.Context()
        self._auth = start_authenticator(self._ctx, key) if key is not None else None
        self.pub = self._ctx.socket(zmq.PUB)
        self.requests = self._ctx.socket(zmq.ROUTER)
        if key is not None:
            make_server(self.pub, key)
            make_server(self.requests, key)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        pub_port = self.pub.bind_to_random_port(f"tcp://{bind}")
        snap_port = self.requests.bind_to_random_port(f"tcp://{bind}")
        self.info = KVEventsInfo(engine.blocks.block_size, pub_port, snap_port, host=bind,
                                 server_key=key.server_public.decode() if key is not None else None)
        self._last_sent = 0.0

    def pump(self) -> None:
        """Publish what was recorded (or a heartbeat after a quiet second), then answer state requests."""
        events = self.recorder.take()
        now = time.monotonic()
        if events or now - self._last_sent >= self.HEARTBEAT_S:
            self.seq += 1
            payload = _encoder.encode(EventBatch(self.seq, tuple(events), time.time()))
            self.pub.send_multipart([TOPIC, self.seq.to_bytes(8, "big"), payload])
            self._last_sent = now
        zmq = self._zmq
        while True:
            try:
                ident, *frames = self.requests.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            reply = (_encoder.encode(full_state(self.engine, self.recorder, self.seq))
                     if frames == [SNAPSHOT_REQUEST] else b"")
            self.requests.send_multipart([ident, reply], zmq.NOBLOCK)

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
        self._ctx.destroy(linger=0)
