"""Engine-side prefix cache model for the simulator: one LRU of blocks per replica, KDA snapshots, events.

Blocks are the trace's 512-token blocks, identified by their prefix-chain ids. A request can resume at
depth d (blocks) only if its first d blocks are cached AND a KDA state snapshot exists at d (hybrid
rule). Where snapshots are taken (``SnapshotRule``), after prefilling a prompt of n blocks whose
cached MLA prefix was m blocks:
  * at n, the end of the prompt (an exact repeat, or a continuation, resumes there);
  * at m when 0 < m < n, the branch point where this prompt left a cached one (Marconi's
    "speculative insertion", vLLM's shared-prefix junction checkpoint): the engine's prefill passes
    through m anyway, and the next request sharing that prefix can stop there;
  * every ``interval`` blocks (0 = never), the coarse "linear-layer caching interval".
A snapshot lives and dies with its block; its memory is not charged separately (one K3 snapshot is the
size of ~37 blocks of MLA KV, so a memory-true model would hold far fewer; see engine_router.md §2.4).

Every change is published as an ``EventBatch`` (``core.kv_events``) with the cache's next sequence
number, exactly what an engine sends the live router.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from k3serve.core.kv_events import BlockRemoved, BlockStored, EventBatch, KVEvent, SnapshotRemoved, SnapshotStored
from k3serve.router.prefix_index import SnapshotRule


def usable_depth(block_ids: Sequence[int], cached: object, snaps: set[int]) -> tuple[int, int]:
    """(MLA prefix depth, usable depth = deepest snapshot within it) of ``block_ids`` in a cache."""
    usable = 0
    depth = 0
    for h in block_ids:
        if h not in cached:
            break
        depth += 1
        if h in snaps:
            usable = depth
    return depth, usable


class ReplicaCache:
    """LRU block cache of one replica that reports its changes as KV events."""

    def __init__(self, capacity_blocks: int, block_tokens: int) -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"cache capacity must be positive, got {capacity_blocks}")
        self.capacity = capacity_blocks
        self.block_tokens = block_tokens
        self._lru: OrderedDict[int, None] = OrderedDict()  # first = least recently used
        self._snaps: set[int] = set()
        self._seq = 0

    def __len__(self) -> int:
        return len(self._lru)

    def lookup(self, block_ids: Sequence[int]) -> tuple[int, int]:
        """(MLA match, usable depth) for a request about to be prefilled; marks the used blocks recent."""
        mla, usable = usable_depth(block_ids, self._lru, self._snaps)
        self._touch(block_ids[:usable])
        return mla, usable

    def insert(self, block_ids: Sequence[int], snapshots: Sequence[int], now: float) -> EventBatch:
        """Cache a prefilled prompt's blocks and snapshots (depths in blocks); evict LRU blocks to fit."""
        block_ids = block_ids[: self.capacity]
        lru = self._lru
        events: list[KVEvent] = []
        run: list[int] = []
        parent: int | None = None
        for i, h in enumerate(block_ids):
            if h in lru:
                if run:
                    events.append(self._stored(run, parent))
                    run = []
            else:
                if not run:
                    parent = block_ids[i - 1] if i else None
                run.append(h)
                lru[h] = None
        if run:
            events.append(self._stored(run, parent))
        self._touch(block_ids)
        for d in snapshots:
            h = block_ids[d - 1] if d <= len(block_ids) else None
            if h is not None and h not in self._snaps:
                self._snaps.add(h)
                events.append(SnapshotStored(h, d * self.block_tokens))
        evicted: list[int] = []
        while len(lru) > self.capacity:
            h, _ = lru.popitem(last=False)
            evicted.append(h)
            if h in self._snaps:
                self._snaps.discard(h)
                events.append(SnapshotRemoved(h))
        if evicted:
            events.append(BlockRemoved(tuple(evicted)))
        batch = EventBatch(self._seq, tuple(events), now)
        self._seq += 1
        return batch

    def _stored(self, run: list[int], parent: int | None) -> BlockStored:
        return BlockStored(tuple(run), parent, len(run) * self.block_tokens)

    def _touch(self, block_ids: Sequence[int]) -> None:
        # deepest first, so the first block ends most recent: LRU then evicts chain tails before roots
        move = self._lru.move_to_end
        for h in reversed(block_ids):
            move(h)


def ideal_hits(requests_blocks: Sequence[Sequence[int]], rule: SnapshotRule) -> tuple[int, int]:
    """(usable blocks, total blocks) of one infinite cache that sees every request, same snapshot rule."""
    cached: set[int] = set()
    snaps: set[int] = set()
    hit = total = 0
    for ids in requests_blocks:
        mla, usable = usable_depth(ids, cached, snaps)
        hit += usable
        total += len(ids)
        cached.update(ids)
        snaps.update(ids[d - 1] for d in rule.depths(len(ids), mla))
    return hit, total
