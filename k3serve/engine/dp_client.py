"""Attention data parallelism: D engine replicas (each its own engine-core process, scheduler and caches, and
its own tensor-parallel ranks) behind the ``EngineClient`` interface the HTTP server uses.

    client = DataParallelClient(spec_kwargs, 2, max_queued_requests=1024)   # spec_kwargs as EngineClient's

A new request goes to the replica holding the fewest requests in flight (ties rotate), so load spreads at
once, before any stats arrive. Admission (``check_admission``) is counted over the whole server. A replica
that dies fails its own requests (503) and is restarted like a lone engine; the server serves on from the
others meanwhile, and gives up (``gave_up``) as soon as one replica has used all its restarts.

Plain data parallelism: the replicas share nothing (each is its own torch.distributed world). With the experts
spread over all of them (``spec_kwargs["data_parallel_size"] > 1``, from ``-dp D --enable-expert-parallel``)
the replicas are one world of tp * dp ranks meeting at one master port, and their cores step in lockstep
(``engine/dp_sync.py``): handing a request to one replica wakes the others. Such a world cannot re-form around
one restarted replica, so there a replica's death gives the whole server up (no restarts).

Across hosts (``-dp D --nnodes N``, ``spec_kwargs["dp_nnodes"] = N``): replicas 0 .. D/N - 1 are this host's
children, the others engine cores on hosts 1 .. N-1 reached over TCP (``engine/dp_hosts.py``); a remote replica
is never restarted (its death gives the server up), and the lockstep above works the same over the hosts.
"""

from __future__ import annotations

import asyncio
import itertools

import msgspec

from k3serve.core.process import free_port
from k3serve.engine.client import EngineBusy, EngineClient, EngineDead
from k3serve.engine.dp_hosts import DEFAULT_RPC_PORT, RemoteEngineClient, replicas_per_host, rpc_addrs
from k3serve.engine.messages import Stats


class DataParallelClient:
    def __init__(self, spec_kwargs: dict, dp: int, *, max_queued_requests: int = 1024, **client_kwargs):
        if dp < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {dp}")
        self.max_queued_requests = max_queued_requests
        self.lockstep = spec_kwargs.get("data_parallel_size", 1) > 1
        if self.lockstep:
            if spec_kwargs["data_parallel_size"] != dp:
                raise ValueError(f"data_parallel_size {spec_kwargs['data_parallel_size']} in the engine spec, "
                                 f"but {dp} replicas")
            spec_kwargs = {**spec_kwargs, "master_port": spec_kwargs.get("master_port") or free_port()}
            client_kwargs = {**client_kwargs, "max_restarts": 0}
        self.replicas = [self._replica(spec_kwargs, d, dp, max_queued_requests=max_queued_requests, **client_kwargs)
                         for d in range(dp)]
        self.gave_up = asyncio.Event()
        self._held: dict[asyncio.Task, int] = {}
        self._turn = itertools.count()
        self._watch: asyncio.Task | None = None

    @staticmethod
    def _replica(spec_kwargs: dict, d: int, dp: int, **kwargs) -> EngineClient:
        """Replica ``d``'s client: an engine-core child of this process, or (``-dp D --nnodes N``, replicas past
        host 0's D / N) one on another host, reached over TCP (``engine/dp_hosts.py``)."""
        nnodes = spec_kwargs.get("dp_nnodes", 1)
        if nnodes > 1 and spec_kwargs.get("dp_replicas") != dp:
            raise ValueError(f"dp_replicas {spec_kwargs.get('dp_replicas')} in the engine spec, but {dp} replicas")
        per_host = replicas_per_host(dp, nnodes)
        spec = {**spec_kwargs, "dp_rank": d, "local_replicas": per_host}
        if d < per_host:
            return EngineClient(spec, **kwargs)
        addrs = rpc_addrs(spec_kwargs.get("dp_address", "127.0.0.1"), spec_kwargs.get("dp_rpc_port", DEFAULT_RPC_PORT),
                          d, per_host)
        return RemoteEngineClient(spec, addrs, **kwargs)

    async def start(self):
        try:
            await asyncio.gather(*(r.start() for r in self.replicas))
        except BaseException:
            await self.shutdown()
            raise
        self._watch = asyncio.create_task(self._watch_replicas())
        return self.ready

    async def _watch_replicas(self) -> None:
        await asyncio.wait([asyncio.create_task(r.gave_up.wait()) for r in self.replicas],
                           return_when=asyncio.FIRST_COMPLETED)
        # the server exits now: every replica's requests fail at once, and new ones get 503 until it has gone
        dead = next(r for r in self.replicas if r.gave_up.is_set())
        why = f"data-parallel replica {self.replicas.index(dead)} is gone ({dead.dead_reason}): the server stops"
        for r in self.replicas:
            r._mark_dead(why)
        self.gave_up.set()

    async def shutdown(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        await asyncio.gather(*(r.shutdown() for r in self.replicas))

    # what the server reads ----------------------------------------------------------------------

    @property
    def ready(self):
        return self.replicas[0].ready

    @property
    def alive(self) -> bool:
        return any(r.alive for r in self.replicas)

    @property
    def state(self) -> str:
        states = [r.state for r in self.replicas]
        return "ready" if "ready" in states else states[0]

    @property
    def dead_reason(self) -> str | None:
        return None if self.alive else next((r.dead_reason for r in self.replicas if r.dead_reason), None)

    @property
    def restarts(self) -> int:
        return sum(r.restarts for r in self.replicas)

    @property
    def num_in_flight(self) -> int:
        return sum(r.num_in_flight for r in self.replicas)

    @property
    def stats(self) -> Stats:
        """The replicas' stats summed field by field."""
        fields = msgspec.structs.fields(Stats)
        return Stats(**{f.name: sum(getattr(r.stats, f.name) for r in self.replicas) for f in fields})

    @property
    def pids(self) -> list[int | None]:
        return [r.pid for r in self.replicas]

    # requests -----------------------------------------------------------------------------------

    def check_admission(self, n: int = 1) -> None:
        """As ``EngineClient.check_admission``, over all replicas."""
        if not self.alive:
            raise EngineDead(self.dead_reason or "the engine is not ready")
        task = asyncio.current_task()
        others = sum(v for t, v in self._held.items() if t is not task)
        load = max(others, self.num_in_flight - self._held.get(task, 0))
        if load + n > self.max_queued_requests:
            raise EngineBusy(f"the server already holds {load} requests "
                             f"(--max-queued-requests {self.max_queued_requests})")
        if task is not None:
            if task not in self._held:
                task.add_done_callback(lambda t: self._held.pop(t, None))
            self._held[task] = n

    def pick(self) -> EngineClient:
        """The live replica with the fewest requests in flight; ties rotate."""
        live = [r for r in self.replicas if r.alive]
        if not live:
            raise EngineDead(self.dead_reason or "the engine is not ready")
        start = next(self._turn) % len(live)
        order = live[start:] + live[:start]
        return min(order, key=lambda r: r.num_in_flight)

    def generate(self, request_id: str, prompt_token_ids: list[int], params, **kwargs):
        replica = self.pick()
        if self.lockstep:  # the others must step with it (engine/dp_sync.py): end their idle wait now
            for r in self.replicas:
                if r is not replica:
                    r.wake_soon()
        return replica.generate(request_id, prompt_token_ids, params, **kwargs)
