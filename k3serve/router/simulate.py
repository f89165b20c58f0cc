"""Trace-driven router simulator: the live routing code against a model of N replicas.

Each arrival goes through ``Router.route`` (prefix index + load counters + policy, unchanged from the
live router). Each replica is a FIFO prefill server in front of a decode pool, with a ``ReplicaCache``
whose KV events feed the router's index, so the router only knows what a live one would know.

Service model (per replica; constants are flags, defaults are round numbers for one 8-GPU K3 replica,
meant for comparing policies, not for predicting absolute latency):
  * prefill: one request at a time, FIFO; the cache hit is taken when the request *starts* (so a
    request queued behind one with the same prefix reuses its blocks), and it takes
    ``prefill_overhead_s + uncached_tokens / prefill_tokens_per_s``; blocks and snapshots are
    cached (and published) when it ends;
  * TTFT = prefill end - arrival (the prefill forward samples the first token);
  * decode: the request then decodes ``output_tokens`` at ``decode_step_s * (1 + b / decode_knee)``
    seconds per token, b = requests already decoding on that replica when it starts; decode does not
    slow prefill (chunked-prefill interference is not modelled).
Metrics: hit_rate = usable cached prompt blocks / prompt blocks (blocks as in the trace, the partial
last one included); ideal_hit_rate = the same for one infinite cache that sees every request with the
same snapshot rule; load = requests routed per replica (``load_max_over_mean``), with computed
prefill tokens per replica beside it (``prefill_tokens_max_over_mean``).
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import asdict, dataclass

import numpy as np

from k3serve.router.cache_model import ReplicaCache, ideal_hits
from k3serve.router.policy import PolicyConfig, make_policy
from k3serve.router.prefix_index import SnapshotRule
from k3serve.router.router import Router
from k3serve.router.trace import TRACE_BLOCK_TOKENS, TraceRequest


@dataclass(frozen=True, slots=True)
class SimConfig:
    replicas: int
    cache_blocks: int  # per replica, in trace blocks
    state_interval: int = 16  # blocks between periodic KDA snapshots (8k tokens); 0 = none
    branch_snapshots: bool = True
    prefill_tokens_per_s: float = 10_000.0
    prefill_overhead_s: float = 0.02
    decode_step_s: float = 0.03
    decode_knee: float = 64.0
    session_from_first_block: bool = True  # the trace has no sessions: use the first block id as one

    def __post_init__(self) -> None:
        for name in ("replicas", "cache_blocks"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.state_interval < 0:
            raise ValueError(f"state_interval must be >= 0, got {self.state_interval}")
        for name in ("prefill_tokens_per_s", "decode_step_s", "decode_knee"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.prefill_overhead_s >= 0:
            raise ValueError(f"prefill_overhead_s must be >= 0, got {self.prefill_overhead_s}")


@dataclass(frozen=True, slots=True)
class SimResult:
    policy: str
    replicas: int
    requests: int
    hit_rate: float
    ideal_hit_rate: float
    predicted_hit_rate: float  # what the router's index expected at routing time
    load_max_over_mean: float
    prefill_tokens_max_over_mean: float
    ttft_p50_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    requests_per_replica: list[int]
    sim_wall_s: float

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


_PREFILL_DONE, _DECODE_DONE = 0, 1


def simulate(
    requests: list[TraceRequest], config: SimConfig, policy: str = "kv", policy_config: PolicyConfig = PolicyConfig()
) -> SimResult:
    """Replay ``requests`` (sorted by arrival) through ``policy``; see the module docstring."""
    if not requests:
        raise ValueError("no requests to simulate")
    if any(b.arrival_s < a.arrival_s for a, b in zip(requests, requests[1:])):
        raise ValueError("requests must be sorted by arrival time")
    t0 = time.perf_counter()
    n = config.replicas
    bt = TRACE_BLOCK_TOKENS
    rule = SnapshotRule(config.state_interval, config.branch_snapshots)
    router = Router(make_policy(policy, policy_config), n, bt, rule)
    caches = [ReplicaCache(config.cache_blocks, bt) for _ in range(n)]
    queues: list[deque[int]] = [deque() for _ in range(n)]
    busy = [False] * n
    decoding = [0] * n
    ttft = np.zeros(len(requests))
    hit_blocks = predicted = 0
    prefill_tokens = np.zeros(n, dtype=np.int64)
    events: list[tuple[float, int, int, int]] = []  # (time, kind, request index, replica)
    snapshots_of: dict[int, list[int]] = {}  # request index -> snapshot depths its prefill will leave

    def start_prefill(r: int, i: int, now: float) -> None:
        nonlocal hit_blocks
        req = requests[i]
        mla, usable = caches[r].lookup(req.block_ids)
        hit_blocks += usable
        uncached = max(1, req.input_tokens - usable * bt)
        prefill_tokens[r] += uncached
        busy[r] = True
        done = now + config.prefill_overhead_s + uncached / config.prefill_tokens_per_s
        snapshots_of[i] = rule.depths(len(req.block_ids), mla)
        heapq.heappush(events, (done, _PREFILL_DONE, i, r))

    def advance(until: float) -> None:
        while events and events[0][0] <= until:
            now, kind, i, r = heapq.heappop(events)
            if kind == _DECODE_DONE:
                decoding[r] -= 1
                router.on_finished(i)
                continue
            req = requests[i]
            router.apply(r, caches[r].insert(req.block_ids, snapshots_of.pop(i), now))
            router.on_first_token(i)
            ttft[i] = now - req.arrival_s
            tpot = config.decode_step_s * (1 + decoding[r] / config.decode_knee)
            decoding[r] += 1
            heapq.heappush(events, (now + req.output_tokens * tpot, _DECODE_DONE, i, r))
            busy[r] = False
            if queues[r]:
                start_prefill(r, queues[r].popleft(), now)

    for i, req in enumerate(requests):
        advance(req.arrival_s)
        n_blocks = len(req.block_ids)
        session = str(req.block_ids[0]) if config.session_from_first_block else None
        decision = router.route(i, req.block_ids, n_blocks, n_blocks + -(-req.output_tokens // bt), session)
        predicted += decision.overlap_blocks
        if busy[decision.replica]:
            queues[decision.replica].append(i)
        else:
            start_prefill(decision.replica, i, req.arrival_s)
    advance(float("inf"))

    total_blocks = sum(len(r.block_ids) for r in requests)
    ideal, _ = ideal_hits([r.block_ids for r in requests], rule)
    routed = router.load.routed_requests
    return SimResult(
        policy=policy,
        replicas=n,
        requests=len(requests),
        hit_rate=hit_blocks / total_blocks,
        ideal_hit_rate=ideal / total_blocks,
        predicted_hit_rate=predicted / total_blocks,
        load_max_over_mean=float(routed.max() / routed.mean()),
        prefill_tokens_max_over_mean=float(prefill_tokens.max() / prefill_tokens.mean()),
        ttft_p50_s=float(np.percentile(ttft, 50)),
        ttft_p99_s=float(np.percentile(ttft, 99)),
        ttft_mean_s=float(ttft.mean()),
        requests_per_replica=[int(x) for x in routed],
        sim_wall_s=time.perf_counter() - t0,
    )
