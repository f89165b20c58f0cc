"""Global prefix index: which replica holds which prefix blocks and KDA state snapshots.

Fed by ``core.kv_events`` batches from every replica; queried once per request with the request's chain block
hashes. Because a block hash chains its whole prefix, a flat ``hash -> replica bitmask`` dict is enough
(no radix tree): the prefix a replica holds is the run of leading hashes whose mask has its bit set.

Hybrid rule: a KDA/MLA hybrid can resume only where a recurrent-state snapshot exists, so a replica's
usable overlap is the deepest snapshot at or below its MLA-block prefix, never the prefix itself.

Replica ids are small dense ints (bit positions); a live router maps replica names to them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from k3serve.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    ReplicaState,
    SnapshotRemoved,
    SnapshotStored,
)
from k3serve.router.sequence import Delivery, SequenceTracker

MAX_REPLICAS = 4096


@dataclass(frozen=True, slots=True)
class SnapshotRule:
    """Where engines take KDA snapshots while prefilling a prompt of n blocks whose cached MLA prefix was
    m blocks: at n (end of prompt), at m when 0 < m < n (the branch point, which the prefill passes
    through), and every ``interval`` blocks (0 = never). Engines apply it; the router uses it to predict
    the snapshots of requests it has routed but whose events have not arrived yet."""

    interval: int = 16
    branch: bool = True

    def __post_init__(self) -> None:
        if self.interval < 0:
            raise ValueError(f"snapshot interval must be >= 0 blocks, got {self.interval}")

    def depths(self, num_blocks: int, mla_match: int) -> list[int]:
        found = {num_blocks}
        if self.branch and 0 < mla_match < num_blocks:
            found.add(mla_match)
        if self.interval > 0:
            found.update(range(self.interval, num_blocks, self.interval))
        return sorted(found)


class PrefixIndex:
    """Per-replica cached blocks and snapshots, with sequence-gap detection and resync."""

    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self._blocks: dict[int, int] = {}  # block hash -> bitmask of replicas holding it
        self._snaps: dict[int, int] = {}  # block hash -> bitmask of replicas with a snapshot at its end
        self._replica_blocks: dict[int, set[int]] = {}
        self._replica_snaps: dict[int, set[int]] = {}
        self._stale = 0  # bitmask of replicas that missed events
        self._pending = _Pending()
        self.tracker = SequenceTracker()

    def apply(self, replica: int, batch: EventBatch) -> Delivery:
        """Apply ``replica``'s batch if it is the next one from it; on a gap mark the replica stale."""
        _check_replica(replica)
        outcome = self.tracker.classify(replica, batch.seq)
        if outcome is Delivery.APPLY:
            self._ensure(replica)
            for event in batch.events:
                self._apply_event(replica, event)
            self._stale &= ~(1 << replica)
        elif outcome is Delivery.GAP:
            self._stale |= 1 << replica
        return outcome

    def resync(self, replica: int, state: ReplicaState) -> None:
        """Replace everything known about ``replica`` with its full state, and clear its stale flag."""
        _check_replica(replica)
        self._clear(replica)
        self._ensure(replica)
        self._store_blocks(replica, state.block_hashes)
        for block_hash, depth in state.snapshots:
            self._apply_event(replica, SnapshotStored(block_hash, depth))
        self.tracker.resync(replica, state.seq)
        self._stale &= ~(1 << replica)

    def remove_replica(self, replica: int) -> None:
        self._clear(replica)
        self._replica_blocks.pop(replica, None)
        self._replica_snaps.pop(replica, None)
        self._stale &= ~(1 << replica)
        self.tracker.forget(replica)

    def is_stale(self, replica: int) -> bool:
        return replica in self.tracker.stale

    def num_blocks(self, replica: int) -> int:
        return len(self._replica_blocks.get(replica, ()))

    def num_snapshots(self, replica: int) -> int:
        return len(self._replica_snaps.get(replica, ()))

    def match(self, block_hashes: Sequence[int]) -> dict[int, int]:
        """Usable prefix blocks per replica (only replicas with > 0): the longest run of leading blocks the
        replica holds or is about to hold (pending), capped at the deepest snapshot inside that run.
        Stale replicas are left out."""
        return {r: usable for r, (_, usable) in self.match_depths(block_hashes).items() if usable}

    def match_depths(self, block_hashes: Sequence[int]) -> dict[int, tuple[int, int]]:
        """(MLA-block prefix depth, usable depth) per replica with a non-empty prefix."""
        if not block_hashes:
            return {}
        alive = ~self._stale  # all bits but the stale ones; the first block narrows it to a finite mask
        mla: dict[int, tuple[int, int]] = {}
        usable: dict[int, int] = {}
        blocks, snaps = self._blocks, self._snaps
        pblocks, psnaps = self._pending.blocks, self._pending.snaps
        depth = 0
        for h in block_hashes:
            now = alive & (blocks.get(h, 0) | pblocks.get(h, 0))
            gone = alive & ~now if depth else 0
            while gone:
                low = gone & -gone
                r = low.bit_length() - 1
                mla[r] = (depth, usable.get(r, 0))
                gone ^= low
            alive = now
            if not alive:
                break
            depth += 1
            with_snap = alive & (snaps.get(h, 0) | psnaps.get(h, 0))
            while with_snap:
                low = with_snap & -with_snap
                usable[low.bit_length() - 1] = depth
                with_snap ^= low
        while alive:
            low = alive & -alive
            r = low.bit_length() - 1
            mla[r] = (depth, usable.get(r, 0))
            alive ^= low
        return mla

    def add_pending(self, request_id: object, replica: int, block_hashes: Sequence[int],
                    snapshot_depths: Sequence[int]) -> None:
        """Blocks and snapshots a routed request will leave on ``replica`` once prefilled; they count in
        ``match`` until ``drop_pending``, so a burst of requests sharing a new prefix is not scattered
        before the engine's events arrive."""
        _check_replica(replica)
        snap_hashes = [block_hashes[d - 1] for d in snapshot_depths if 0 < d <= len(block_hashes)]
        self._pending.add(request_id, replica, tuple(block_hashes), snap_hashes)

    def drop_pending(self, request_id: object) -> None:
        self._pending.drop(request_id)

    def _ensure(self, replica: int) -> None:
        self._replica_blocks.setdefault(replica, set())
        self._replica_snaps.setdefault(replica, set())

    def _apply_event(self, replica: int, event: KVEvent) -> None:
        bit = 1 << replica
        if isinstance(event, BlockStored):
            self._store_blocks(replica, event.block_hashes)
        elif isinstance(event, BlockRemoved):
            mine, my_snaps = self._replica_blocks[replica], self._replica_snaps[replica]
            for h in event.block_hashes:
                if h in mine:
                    mine.discard(h)
                    _drop_bit(self._blocks, h, bit)
                    if h in my_snaps:  # a snapshot without its KV blocks cannot be resumed from
                        self._drop_snapshot(replica, h)
        elif isinstance(event, SnapshotStored):
            if event.depth % self.block_size:
                return  # not at a block boundary: no block hash names it, unusable at block granularity
            self._snaps[event.block_hash] = self._snaps.get(event.block_hash, 0) | bit
            self._replica_snaps[replica].add(event.block_hash)
        elif isinstance(event, SnapshotRemoved):
            self._drop_snapshot(replica, event.block_hash)
        elif isinstance(event, AllBlocksCleared):
            self._clear(replica)
        else:
            raise ValueError(f"not a KV event: {event!r}")

    def _store_blocks(self, replica: int, block_hashes: Sequence[int]) -> None:
        blocks, bit = self._blocks, 1 << replica
        for h in block_hashes:
            blocks[h] = blocks.get(h, 0) | bit
        self._replica_blocks[replica].update(block_hashes)

    def _drop_snapshot(self, replica: int, block_hash: int) -> None:
        mine = self._replica_snaps[replica]
        if block_hash in mine:
            mine.discard(block_hash)
            _drop_bit(self._snaps, block_hash, 1 << replica)

    def _clear(self, replica: int) -> None:
        bit = 1 << replica
        for h in self._replica_blocks.get(replica, ()):
            _drop_bit(self._blocks, h, bit)
        for h in self._replica_snaps.get(replica, ()):
            _drop_bit(self._snaps, h, bit)
        if replica in self._replica_blocks:
            self._replica_blocks[replica] = set()
            self._replica_snaps[replica] = set()


class _Pending:
    """Reference-counted replica bitmasks of the blocks/snapshots of routed, not yet prefilled requests."""

    def __init__(self) -> None:
        self.blocks: dict[int, int] = {}
        self.snaps: dict[int, int] = {}
        self._block_refs: dict[int, int] = {}  # (hash << 12 | replica) -> count; an int key hashes fast
        self._snap_refs: dict[int, int] = {}
        self._requests: dict[object, tuple[int, tuple[int, ...], list[int]]] = {}

    def add(self, request_id: object, replica: int, blocks: tuple[int, ...], snaps: list[int]) -> None:
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already pending")
        self._requests[request_id] = (replica, blocks, snaps)
        _ref(replica, blocks, self.blocks, self._block_refs)
        _ref(replica, snaps, self.snaps, self._snap_refs)

    def drop(self, request_id: object) -> None:
        entry = self._requests.pop(request_id, None)
        if entry is not None:
            replica, blocks, snaps = entry
            _unref(replica, blocks, self.blocks, self._block_refs)
            _unref(replica, snaps, self.snaps, self._snap_refs)


def _ref(replica: int, hashes: Sequence[int], table: dict[int, int], refs: dict[int, int]) -> None:
    bit = 1 << replica
    for h in hashes:
        key = h << 12 | replica
        n = refs.get(key, 0)
        refs[key] = n + 1
        if not n:
            table[h] = table.get(h, 0) | bit


def _unref(replica: int, hashes: Sequence[int], table: dict[int, int], refs: dict[int, int]) -> None:
    keep = ~(1 << replica)
    for h in hashes:
        key = h << 12 | replica
        n = refs[key] - 1
        if n:
            refs[key] = n
        else:
            del refs[key]
            left = table[h] & keep
            if left:
                table[h] = left
            else:
                del table[h]


def _drop_bit(table: dict[int, int], key: int, bit: int) -> bool:
    """Clear ``bit`` in ``table[key]``; delete the key when no bit is left. Returns whether any remain."""
    left = table.get(key, 0) & ~bit
    if left:
        table[key] = left
        return True
    table.pop(key, None)
    return False


def _check_replica(replica: int) -> None:
    if not 0 <= replica < MAX_REPLICAS:
        raise ValueError(f"replica id must be in [0, {MAX_REPLICAS}), got {replica}")
