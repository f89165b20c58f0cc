"""The routing decision: prefix index + load counters + policy -> replica.

``Router`` owns no I/O. The live proxy calls ``route`` per request, ``apply`` per event batch and
``on_first_token`` / ``on_finished`` as responses stream back; the trace simulator calls the very same
methods from its event loop.

Between routing a request and the engine's events for its blocks there is a window (the whole queueing
plus prefill time) in which the index does not yet show them; the router fills it with the blocks and
snapshots it *expects* (``PrefixIndex.add_pending``, snapshots placed by the engines' ``SnapshotRule``)
until the first token comes back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from k3serve.core.kv_events import EventBatch, ReplicaState
from k3serve.router.load import LoadTracker
from k3serve.router.policy import Policy, ReplicasView, RequestView
from k3serve.router.prefix_index import PrefixIndex, SnapshotRule
from k3serve.router.sequence import Delivery


@dataclass(frozen=True, slots=True)
class Decision:
    replica: int
    overlap_blocks: int  # usable cached prefix blocks the index predicted on that replica


class Router:
    def __init__(
        self, policy: Policy, num_replicas: int, block_size: int, snapshot_rule: SnapshotRule = SnapshotRule()
    ) -> None:
        self.policy = policy
        self.snapshot_rule = snapshot_rule
        self.index = PrefixIndex(block_size)
        self.load = LoadTracker(num_replicas)
        self._all = np.arange(num_replicas)
        self._cached = np.zeros(num_replicas, dtype=np.int64)

    def apply(self, replica: int, batch: EventBatch) -> Delivery:
        """Feed one replica's event batch to the index (GAP: the replica needs replay or ``resync``)."""
        if not 0 <= replica < len(self._all):
            raise ValueError(f"event batch from unknown replica {replica}")
        outcome = self.index.apply(replica, batch)
        self._cached[replica] = self.index.num_blocks(replica)
        return outcome

    def resync(self, replica: int, state: ReplicaState) -> None:
        if not 0 <= replica < len(self._all):
            raise ValueError(f"resync of unknown replica {replica}")
        self.index.resync(replica, state)
        self._cached[replica] = self.index.num_blocks(replica)

    def remove_replica(self, replica: int) -> None:
        """Forget a replica's cache (it died or restarted); its load counters drain as requests end."""
        if not 0 <= replica < len(self._all):
            raise ValueError(f"unknown replica {replica}")
        self.index.remove_replica(replica)
        self._cached[replica] = 0

    def route(
        self,
        request_id: object,
        block_hashes: Sequence[int],
        prompt_blocks: int,
        decode_blocks: int,
        session: str | None = None,
        routable: Sequence[int] | None = None,
    ) -> Decision:
        """Pick a replica for a request and count it there at once.

        ``block_hashes``: chain hashes of the prompt's cacheable blocks; ``prompt_blocks``: blocks to
        prefill on a miss; ``decode_blocks``: KV blocks the request holds while decoding;
        ``routable``: healthy replica ids (default: all).
        """
        if prompt_blocks <= 0 or prompt_blocks < len(block_hashes):
            raise ValueError(f"prompt_blocks must be positive and cover the {len(block_hashes)} hashed blocks, "
                             f"got {prompt_blocks}")
        if self.load.is_inflight(request_id):
            raise ValueError(f"request {request_id!r} is already in flight")
        ids = self._all if routable is None else np.asarray(routable, dtype=np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() >= len(self._all)):
            raise ValueError(f"routable replica ids must be in [0, {len(self._all)})")
        depths = self.index.match_depths(block_hashes)
        overlap = np.zeros(len(ids), dtype=np.int64)
        mla_overlap = np.zeros(len(ids), dtype=np.int64)
        if depths and routable is None:
            for r, (mla, usable) in depths.items():
                mla_overlap[r], overlap[r] = mla, usable
        elif depths:
            for pos, r in enumerate(ids.tolist()):
                mla_overlap[pos], overlap[pos] = depths.get(r, (0, 0))
        load = self.load
        if routable is None:  # every replica: the counters themselves, no copies (policies only read)
            pending, decode, cached = load.pending_prefill_blocks, load.decode_blocks, self._cached
        else:
            pending, decode, cached = load.pending_prefill_blocks[ids], load.decode_blocks[ids], self._cached[ids]
        view = ReplicasView(ids, overlap, mla_overlap, pending, decode, cached)
        replica = self.policy.choose(RequestView(prompt_blocks, session), view)
        mla, hit = depths.get(replica, (0, 0))
        load.on_routed(request_id, replica, prompt_blocks - hit, decode_blocks)
        self.index.add_pending(
            request_id, replica, block_hashes, self.snapshot_rule.depths(len(block_hashes), mla)
        )
        return Decision(replica, hit)

    def on_first_token(self, request_id: object) -> None:
        """Prefill done: its blocks are now reported by the engine's own events."""
        self.index.drop_pending(request_id)
        self.load.on_first_token(request_id)

    def on_finished(self, request_id: object) -> None:
        self.index.drop_pending(request_id)
        self.load.on_finished(request_id)
