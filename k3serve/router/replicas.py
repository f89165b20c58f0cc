"""The live router's replicas: health checks, KV event subscriptions and resyncs (asyncio, one loop).

Replica ids are the positions of the ``--replica`` URLs. A replica is *routable* once its ``/health``
answers 200 and, when it publishes KV events (``/kv_events/info``), its prefix index has been loaded
from a full-state snapshot. A failed health check (or a connection error the proxy reports) removes it
and drops its index; the next good health check re-admits it after a fresh resync, so a restarted
replica (new ports, empty cache) is picked up with nothing but its URL.

Event path: a ZMQ SUB socket per replica receives ``[b"kv", seq, msgpack(EventBatch)]`` (``core.kv_events``);
batches go to ``Router.apply``. A sequence gap (lost batches, or a replica restarted behind the same URL)
triggers a resync: a DEALER asks the engine's ROUTER socket for its ``ReplicaState``; batches arriving meanwhile are
buffered and replayed on top of it (those at or below the state's seq are dropped as duplicates).

Keyed events (``core.kv_auth``): both sockets connect as CURVE clients with the key derived from the
router's secret. A replica whose ``/kv_events/info`` shows another server key (or none, or events bound to
a loopback address this router cannot reach) is routed by load only, with the reason logged and shown in
``/router/replicas`` (``kv_events_note``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
import zmq
import zmq.asyncio

from k3serve.core.kv_auth import KEY_ENV, KVEventsKey, is_loopback, make_client
from k3serve.core.kv_events import SNAPSHOT_REQUEST, TOPIC, EventBatch, decode_batch, decode_state
from k3serve.router.router import Router
from k3serve.router.sequence import Delivery

log = logging.getLogger("k3serve.router")
RESYNC_TIMEOUT_S = 5.0
HEALTH_TIMEOUT_S = 3.0
HEALTH_MISSES = 3  # consecutive failed checks (timeouts, errors) that remove a replica; refused: at once
REQUEST_FAILURES = 3  # consecutive failed proxied requests (broken connections, timeouts) that remove one
SUB_SETTLE_S = 0.2  # let the SUB connection come up before asking for the state it continues from


@dataclass
class Replica:
    id: int
    url: str
    healthy: bool = False
    events: bool = False  # its KV events feed the index (else it is routed by load only)
    events_note: str | None = None  # why its KV events are not used although it publishes them
    down_reason: str | None = "not checked yet"
    resyncs: int = 0
    misses: int = 0
    failures: int = 0  # consecutive proxied requests that failed; any answer resets it
    epoch: int = 0  # bumped on every removal, so an admission that raced a removal does not resurrect it
    _sub: asyncio.Task | None = None
    _resync: asyncio.Task | None = None
    _buffer: list[EventBatch] | None = None  # batches held while a resync is in flight
    _kv_addr: tuple[str, int] | None = None  # (host, snapshot port)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one resync at a time

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or "127.0.0.1"


@dataclass
class ReplicaSet:
    urls: list[str]
    router: Router
    client: httpx.AsyncClient
    health_interval_s: float = 1.0
    kv_key: KVEventsKey | None = None  # the replicas' KV events key (core.kv_auth); None: unkeyed events
    replicas: list[Replica] = field(init=False)

    def __post_init__(self) -> None:
        self.replicas = [Replica(i, u.rstrip("/")) for i, u in enumerate(self.urls)]
        self._ctx = zmq.asyncio.Context()
        self._loop: asyncio.Task | None = None

    # lifecycle ------------------------------------------------------------------------------------

    async def start(self) -> None:
        await asyncio.gather(*(self._check(r) for r in self.replicas))
        self._loop = asyncio.create_task(self._health_loop())

    async def stop(self) -> None:
        tasks = [self._loop] + [t for r in self.replicas for t in (r._sub, r._resync)]
        for t in tasks:
            if t is not None:
                t.cancel()
        for t in tasks:
            if t is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
        self._ctx.destroy(linger=0)

    def routable(self) -> list[int]:
        return [r.id for r in self.replicas if r.healthy]

    def mark_failed(self, replica_id: int, reason: str) -> None:
        """It cannot serve (refused connections, its engine is gone): take it out now; health checks
        bring it back."""
        self._drop(self.replicas[replica_id], reason)

    def report_failure(self, replica_id: int, reason: str) -> None:
        """A proxied request failed (broken connection, timeout): one bad request, perhaps a client's
        own doing, must not empty the router, so only REQUEST_FAILURES in a row remove the replica."""
        rep = self.replicas[replica_id]
        rep.failures += 1
        if rep.failures >= REQUEST_FAILURES:
            self._drop(rep, f"{rep.failures} requests in a row failed, the last: {reason}")

    def report_ok(self, replica_id: int) -> None:
        self.replicas[replica_id].failures = 0

    # health ---------------------------------------------------------------------------------------

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await asyncio.gather(*(self._check(r) for r in self.replicas))

    async def _check(self, rep: Replica) -> None:
        refused = False
        try:
            resp = await self.client.get(rep.url + "/health", timeout=max(HEALTH_TIMEOUT_S, self.health_interval_s))
            ok, reason = resp.status_code == 200, f"health check answered {resp.status_code}"
        except httpx.HTTPError as e:
            ok, reason, refused = False, f"health check failed: {type(e).__name__}", isinstance(e, httpx.ConnectError)
        if not ok:
            rep.misses += 1
            if refused or rep.misses >= HEALTH_MISSES or not rep.healthy:  # a busy replica may answer late
                self._drop(rep, reason)
            return
        rep.misses = 0
        if not rep.healthy:
            try:
                await self._admit(rep)
            except (httpx.HTTPError, ValueError, TimeoutError, zmq.ZMQError) as e:
                self._drop(rep, f"admission failed: {e}")

    async def _admit(self, rep: Replica) -> None:
        epoch = rep.epoch
        info = (await self.client.get(rep.url + "/kv_events/info", timeout=5.0)).json()
        enabled = bool(info.get("enabled"))
        if enabled and info.get("block_size") != self.router.index.block_size:
            raise ValueError(f"replica {rep.url} hashes {info.get('block_size')}-token blocks, the router "
                             f"{self.router.index.block_size}")
        rep.events_note = self._events_problem(rep, info) if enabled else None
        if enabled and rep.events_note is None:
            rep._kv_addr = (rep.host, int(info["snapshot_port"]))
            rep._buffer = []  # from the first batch on, until the state they continue is loaded
            self._subscribe(rep, int(info["pub_port"]))
            await asyncio.sleep(SUB_SETTLE_S)
            await self._resync_now(rep)
            rep.events = True
        else:
            log.warning("replica %s %s: routed by load only", rep.url,
                        rep.events_note or "publishes no KV events (start it with --kv-events)")
            rep.events = False
        if rep.epoch != epoch:
            raise ValueError("removed while being admitted")
        rep.healthy, rep.down_reason = True, None
        log.info("replica %d (%s) admitted", rep.id, rep.url)  # routine (also after a restart); removal warns

    def _events_problem(self, rep: Replica, info: dict) -> str | None:
        """Why this router cannot use the replica's KV events (a key or address mismatch), or None."""
        theirs = info.get("server_key")
        mine = self.kv_key.server_public.decode() if self.kv_key is not None else None
        if theirs != mine:
            if mine is None:
                return (f"publishes keyed KV events, and this router has no key (give it the replicas' secret: "
                        f"--kv-events-key-file or {KEY_ENV})")
            if theirs is None:
                return "publishes unkeyed KV events, and this router has a key: their block hashes would never match"
            return (f"KV events key mismatch: the replica's server key is {theirs}, this router's secret gives "
                    f"{mine}")
        bound = info.get("host") or ""
        if bound and is_loopback(bound) and not is_loopback(rep.host):
            return (f"binds its KV events to {bound}, which this router cannot reach at {rep.host} (start it "
                    "with --kv-events-host and a key)")
        return None

    def _drop(self, rep: Replica, reason: str) -> None:
        if rep.healthy:
            log.warning("replica %d (%s) removed: %s", rep.id, rep.url, reason)
        rep.healthy, rep.events, rep.down_reason = False, False, reason
        rep.failures = 0
        rep.epoch += 1
        for t in (rep._sub, rep._resync):
            if t is not None:
                t.cancel()
        rep._sub = rep._resync = rep._buffer = rep._kv_addr = None
        self.router.remove_replica(rep.id)

    # events ---------------------------------------------------------------------------------------

    def _subscribe(self, rep: Replica, port: int) -> None:
        sock = self._ctx.socket(zmq.SUB)
        if self.kv_key is not None:
            make_client(sock, self.kv_key)
        sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{rep.host}:{port}")
        rep._sub = asyncio.create_task(self._consume(rep, sock))

    async def _consume(self, rep: Replica, sock: zmq.asyncio.Socket) -> None:
        try:
            while True:
                frames = await sock.recv_multipart()
                if len(frames) != 3:
                    continue
                try:
                    batch = decode_batch(frames[2])
                except ValueError as e:
                    log.warning("replica %d: %s", rep.id, e)
                    continue
                if rep._buffer is not None:
                    rep._buffer.append(batch)
                elif self.router.apply(rep.id, batch) is Delivery.GAP and rep._resync is None:
                    rep._resync = asyncio.create_task(self._resync_task(rep))
        finally:
            sock.close(0)

    async def _resync_task(self, rep: Replica) -> None:
        try:
            await self._resync_now(rep)
        except (ValueError, TimeoutError, zmq.ZMQError) as e:
            self._drop(rep, f"resync failed: {e}")
        finally:
            rep._resync = None

    async def _resync_now(self, rep: Replica, attempts: int = 3) -> None:
        """Load the replica's full state, then the batches that arrived meanwhile; again on a new gap."""
        async with rep._lock:
            epoch = rep.epoch
            for _ in range(attempts):
                if rep._kv_addr is None or rep.epoch != epoch:
                    raise ValueError("the replica was removed")
                if rep._buffer is None:
                    rep._buffer = []
                try:
                    raw = await self._request_state(*rep._kv_addr)
                except BaseException:
                    rep._buffer = None
                    raise
                if rep.epoch != epoch:
                    raise ValueError("the replica was removed")
                self.router.resync(rep.id, decode_state(raw))
                rep.resyncs += 1
                buffered, rep._buffer = rep._buffer, None
                if all(self.router.apply(rep.id, b) is not Delivery.GAP for b in buffered):
                    return
            raise ValueError(f"events kept going missing after {attempts} resyncs")

    async def _request_state(self, host: str, port: int) -> bytes:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.kv_key is not None:
            make_client(sock, self.kv_key)
        try:
            sock.connect(f"tcp://{host}:{port}")
            await sock.send_multipart([SNAPSHOT_REQUEST])
            if not await sock.poll(int(RESYNC_TIMEOUT_S * 1000)):
                # a CURVE handshake that fails (wrong key) is silent on this side: nothing ever arrives
                hint = "KV events key mismatch?" if self.kv_key is not None else "events port unreachable?"
                raise TimeoutError(f"no KV state from {host}:{port} within {RESYNC_TIMEOUT_S:.0f} s ({hint})")
            frames = await sock.recv_multipart()
            if len(frames) != 1 or not frames[0]:
                raise ValueError(f"bad KV state reply from {host}:{port}")
            return frames[0]
        finally:
            sock.close(0)
