"""Expert placement for expert parallelism: which rank holds which experts, hot experts replicated.

Vocabulary (as in DeepSeek's EPLB and vLLM): E *logical* experts (the checkpoint's), R ranks each with
``slots_per_rank`` *physical* slots; ``E + redundant = R * slots_per_rank``, so ``redundant`` slots hold second
(third, ...) replicas of hot experts. A token routed to a replicated expert is served by one of its replicas,
and every replica holds the same weights, so the output does not depend on which one.

``plan_placement(load, R, redundant)`` is greedy and plain Python over ints:
  1. replicate: each of the ``redundant`` extra replicas goes to the expert whose per-replica load
     (load / replicas) is highest at that moment (never more replicas than ranks);
  2. pack: replicas, heaviest share first, each to the least-loaded rank that still has a free slot,
     preferring ranks that do not hold that expert yet.
``ExpertLoad`` accumulates the router's choices (the EPLB statistics) that the planner takes as ``load``.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch


def split_counts(n: int, parts: int) -> list[int]:
    """``n`` tokens over ``parts`` replicas as evenly as possible (the first ``n % parts`` get one more)."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


@dataclass(frozen=True)
class Placement:
    num_experts: int
    experts_of_rank: tuple[tuple[int, ...], ...]  # [rank][local slot] -> logical expert (phy2log)

    def __post_init__(self) -> None:
        if not self.experts_of_rank:
            raise ValueError("a placement needs at least one rank")
        sizes = {len(r) for r in self.experts_of_rank}
        if len(sizes) != 1 or 0 in sizes:
            raise ValueError(f"every rank must hold the same, non-zero number of expert slots, got {sorted(sizes)}")
        held = {e for r in self.experts_of_rank for e in r}
        if any(not 0 <= e < self.num_experts for e in held):
            raise ValueError(f"expert ids must be in 0..{self.num_experts - 1}")
        if len(held) != self.num_experts:
            missing = sorted(set(range(self.num_experts)) - held)
            raise ValueError(f"experts {missing[:8]} have no replica on any rank")

    @property
    def num_ranks(self) -> int:
        return len(self.experts_of_rank)

    @property
    def slots_per_rank(self) -> int:
        return len(self.experts_of_rank[0])

    @cached_property
    def replicas(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """[expert] -> its (rank, local slot) replicas, in rank order (log2phy)."""
        out: list[list[tuple[int, int]]] = [[] for _ in range(self.num_experts)]
        for r, experts in enumerate(self.experts_of_rank):
            for s, e in enumerate(experts):
                out[e].append((r, s))
        return tuple(tuple(x) for x in out)

    def rank_loads(self, load: Sequence[int]) -> list[int]:
        """Tokens each rank serves when each expert's ``load`` splits evenly over its replicas."""
        out = [0] * self.num_ranks
        for e, reps in enumerate(self.replicas):
            for (r, _), share in zip(reps, split_counts(load[e], len(reps))):
                out[r] += share
        return out


def imbalance(rank_loads: Sequence[int]) -> float:
    """max / mean rank load (1.0 is perfect balance)."""
    mean = sum(rank_loads) / len(rank_loads)
    return max(rank_loads) / mean if mean else 1.0


def block_placement(num_experts: int, num_ranks: int) -> Placement:
    """Contiguous blocks: rank r holds experts [r·E/R, (r+1)·E/R) (the layout without a planner)."""
    if num_experts % num_ranks:
        raise ValueError(f"{num_experts} experts cannot be split over {num_ranks} ranks without redundant slots")
    per = num_experts // num_ranks
    return Placement(num_experts, tuple(tuple(range(r * per, (r + 1) * per)) for r in range(num_ranks)))


def round_robin_placement(num_experts: int, num_ranks: int) -> Placement:
    """Expert e on rank e mod R."""
    if num_experts % num_ranks:
        raise ValueError(f"{num_experts} experts cannot be split over {num_ranks} ranks without redundant slots")
    return Placement(num_experts, tuple(tuple(range(r, num_experts, num_ranks)) for r in range(num_ranks)))


def plan_placement(load: Sequence[int], num_ranks: int, redundant: int = 0) -> Placement:
    """Greedy placement of ``len(load)`` experts plus ``redundant`` extra replicas over ``num_ranks`` ranks that
    keeps the most loaded rank as light as it can (see the module docstring)."""
    E = len(load)
    if num_ranks < 1 or redundant < 0:
        raise ValueError("num_ranks must be >= 1 and redundant >= 0")
    if any(int(x) != x or x < 0 for x in load):
        raise ValueError("expert loads must be non-negative integers")
    if (E + redundant) % num_ranks:
        raise ValueError(f"{E} experts + {redundant} redundant slots cannot be split evenly over {num_ranks} ranks")
    if redundant > E * (num_ranks - 1):
        raise ValueError(f"{redundant} redundant slots exceed one replica of each of {E} experts on every rank")
    slots = (E + redundant) // num_ranks
    reps = [1] * E
    # max-heap on per-replica load; ties go to the lower expert id so plans are deterministic
    heap = [(-load[e], e) for e in range(E)]
    heapq.heapify(heap)
    for _ in range(redundant):
        while True:
            _, e = heapq.heappop(heap)
            if reps[e] < num_ranks:
                break
        reps[e] += 1
        heapq.heappush(heap, (-(load[e] / reps[e]), e))
    items = [(share, e) for e in range(E) for share in split_counts(int(load[e]), reps[e])]
    items.sort(key=lambda it: (-it[0], it[1]))
    rank_load, held = [0] * num_ranks, [[] for _ in range(num_ranks)]
    for share, e in items:
        free = [r for r in range(num_ranks) if len(held[r]) < slots]
        fresh = [r for r in free if e not in held[r]] or free  # a second copy on one rank only as a last resort
        r = min(fresh, key=lambda r: (rank_load[r], len(held[r]), r))
        held[r].append(e)
        rank_load[r] += share
    return Placement(E, tuple(tuple(h) for h in held))


class ExpertLoad:
    """Tokens routed to each expert, accumulated from router choices (``ids`` ``[N, k]``)."""

    def __init__(self, num_experts: int):
        self.counts = torch.zeros(num_experts, dtype=torch.int64, device="cpu")  # not on meta when built there

    def add(self, ids: torch.Tensor) -> None:
        self.counts += torch.bincount(ids.reshape(-1).cpu(), minlength=self.counts.numel())

    def snapshot(self) -> list[int]:
        return self.counts.tolist()

    def reset(self) -> None:
        self.counts.zero_()
