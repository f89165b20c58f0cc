"""Routing policies: pure functions of a request view and a replicas view -> a replica id.

The same objects run inside the live router and the trace simulator; they never touch sockets, clocks
or the index, only the numbers in the views (all counts in KV blocks).

``kv`` (default) extends NVIDIA Dynamo's KV-router cost (lower is better) with a cache term:

    cost = weight * (pending_prefill_blocks + request_blocks - usable_overlap)
         + cache_weight * (request_blocks - mla_overlap)
         + decode_blocks

* The first term is the prefill work queued ahead of this request's first token on that replica plus
  its own uncached prefill: a TTFT estimate in blocks. Counting the queue, not just this request's
  misses, is what keeps a popular prefix from collapsing every request onto one replica (the
  hot-spotting / "death spiral" reports: vllm-project/router#179, SGLang #14305/#14532).
  ``usable_overlap`` obeys the hybrid rule: capped at the deepest KDA snapshot.
* The second term is the number of new blocks the request would write into that replica's cache.
  On a hybrid, MLA blocks past the deepest snapshot save no prefill now, yet placing the request
  where they are still matters: elsewhere it duplicates the prefix (evicting other prefixes), and its
  prefill leaves the branch-point snapshot on a replica that lacks the prefix family's other blocks,
  so the family keeps scattering. (Measured: without this term ``kv`` reaches ~0.8 of the ideal hit
  rate on the Mooncake synthetic trace, with it ~0.98; benchmarks/RESULTS.md has the sweep.)
* ``decode_blocks`` is the KV held by decoding requests (memory pressure, per-token slowdown).

Temperature 0 picks the argmin, ties going to the replica with fewer cached blocks (more free cache),
then at random; temperature T > 0 samples with probability proportional to exp(-c / T) over costs
min-max normalised to [0, 1].
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True, slots=True)
class RequestView:
    """What a policy may know about a request."""

    prompt_blocks: int  # blocks of prompt to prefill if nothing is cached (a partial block counts)
    session: str | None = None  # session-affinity header value, if any


@dataclass(frozen=True, slots=True)
class ReplicasView:
    """Routable replicas and their state; every array is aligned with ``ids``."""

    ids: np.ndarray  # replica ids, int
    overlap: np.ndarray  # usable cached prefix blocks of this request on each replica (hybrid rule applied)
    mla_overlap: np.ndarray  # cached MLA-block prefix, >= overlap (reaches past the deepest snapshot)
    pending_prefill_blocks: np.ndarray
    decode_blocks: np.ndarray
    cached_blocks: np.ndarray  # size of each replica's cache (tie-break: prefer more free cache)

    def __post_init__(self) -> None:
        n = len(self.ids)
        if n == 0:
            raise ValueError("no routable replica")
        for name in ("overlap", "mla_overlap", "pending_prefill_blocks", "decode_blocks", "cached_blocks"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"ReplicasView.{name} has {len(getattr(self, name))} entries, expected {n}")


class Policy(Protocol):
    name: str

    def choose(self, request: RequestView, replicas: ReplicasView) -> int:
        """Return one id out of ``replicas.ids``."""
        ...


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    weight: float = 2.0  # prefill blocks (queued + own uncached) per decode block in the kv cost
    cache_weight: float = 8.0  # per block the request would newly write into the replica's cache
    temperature: float = 0.0  # 0 = argmin; > 0 = softmax sampling over normalised costs
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.weight >= 0:
            raise ValueError(f"weight must be >= 0, got {self.weight}")
        if not self.cache_weight >= 0:
            raise ValueError(f"cache_weight must be >= 0, got {self.cache_weight}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


class KVPolicy:
    name = "kv"

    def __init__(self, config: PolicyConfig = PolicyConfig()) -> None:
        self.config = config
        self._rng = random.Random(config.seed)

    def costs(self, request: RequestView, replicas: ReplicasView) -> np.ndarray:
        c = self.config
        prefill = replicas.pending_prefill_blocks + (request.prompt_blocks - replicas.overlap)
        new_blocks = request.prompt_blocks - replicas.mla_overlap
        return c.weight * prefill + c.cache_weight * new_blocks + replicas.decode_blocks

    def choose(self, request: RequestView, replicas: ReplicasView) -> int:
        cost = self.costs(request, replicas).astype(np.float64)
        if self.config.temperature > 0:
            return int(replicas.ids[_softmax_pick(cost, self.config.temperature, self._rng)])
        best = np.flatnonzero(cost == cost.min())
        if len(best) > 1:
            sizes = replicas.cached_blocks[best]
            best = best[sizes == sizes.min()]
        pos = best[0] if len(best) == 1 else best[self._rng.randrange(len(best))]
        return int(replicas.ids[pos])


class RoundRobin:
    name = "round_robin"

    def __init__(self, config: PolicyConfig = PolicyConfig()) -> None:
        self._next = 0

    def choose(self, request: RequestView, replicas: ReplicasView) -> int:
        pos = self._next % len(replicas.ids)
        self._next += 1
        return int(replicas.ids[pos])


class LeastLoad:
    """Fewest in-flight blocks (queued prefill + decoding KV), cache-blind; ties rotate."""

    name = "least_load"

    def __init__(self, config: PolicyConfig = PolicyConfig()) -> None:
        self._turn = 0

    def choose(self, request: RequestView, replicas: ReplicasView) -> int:
        load = replicas.pending_prefill_blocks + replicas.decode_blocks
        best = np.flatnonzero(load == load.min())
        self._turn += 1
        return int(replicas.ids[best[self._turn % len(best)]])


class SessionAffinity:
    """Requests with the same session value go to the same replica; new or sessionless requests, and
    sessions whose replica is no longer routable, are placed by ``kv`` (and then remembered)."""

    name = "session"

    def __init__(self, config: PolicyConfig = PolicyConfig(), max_sessions: int = 1_000_000) -> None:
        if max_sessions <= 0:
            raise ValueError(f"max_sessions must be positive, got {max_sessions}")
        self.fallback = KVPolicy(config)
        self.max_sessions = max_sessions
        self._bound: OrderedDict[str, int] = OrderedDict()

    def choose(self, request: RequestView, replicas: ReplicasView) -> int:
        key = request.session
        if key is None:
            return self.fallback.choose(request, replicas)
        replica = self._bound.get(key)
        if replica is None or replica not in replicas.ids:
            replica = self.fallback.choose(request, replicas)
        self._bound[key] = replica
        self._bound.move_to_end(key)
        if len(self._bound) > self.max_sessions:
            self._bound.popitem(last=False)
        return replica


POLICIES: dict[str, Callable[[PolicyConfig], Policy]] = {
    "kv": KVPolicy,
    "round_robin": RoundRobin,
    "least_load": LeastLoad,
    "session": SessionAffinity,
}


def make_policy(name: str, config: PolicyConfig = PolicyConfig()) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy '{name}'; choose one of {', '.join(POLICIES)}")
    return POLICIES[name](config)


def _softmax_pick(cost: np.ndarray, temperature: float, rng: random.Random) -> int:
    span = cost.max() - cost.min()
    norm = (cost - cost.min()) / span if span > 0 else np.zeros_like(cost)
    cdf = np.cumsum(np.exp(-norm / temperature))
    pos = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return min(pos, len(cost) - 1)
