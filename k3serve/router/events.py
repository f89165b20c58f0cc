"""KV-cache events an engine replica publishes to the router, and per-replica sequence tracking.

An engine sends ``EventBatch``es: a replica id, a sequence number that grows by exactly one per batch,
and a tuple of events. Block identities are the chain hashes of ``k3serve.core.hashing``. A hybrid
(KDA + MLA) hit also needs a KDA state snapshot, so snapshots are events too, keyed by the hash of the
block that ends at the snapshot's depth.

Messages are frozen dataclasses that convert to and from plain dicts (``{"type": ..., ...}``), so any
wire codec (JSON, msgpack) can carry them. ``from_dict`` validates and raises ``ValueError``.

Gap handling (``SequenceTracker``): a batch whose sequence number skips ahead means events were lost;
the replica is marked stale and the batch is not applied. It recovers either by replay (the engine
re-sends batches from ``expected`` on; the first one that arrives in order clears the stale flag) or by a
full resync (``resync(replica, seq)`` after loading the engine's full state).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar


def _int(d: dict[str, Any], key: str, *, minimum: int = 0) -> int:
    v = d.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise ValueError(f"event field '{key}' must be an int >= {minimum}, got {v!r}")
    return v


def _hashes(d: dict[str, Any], key: str) -> tuple[int, ...]:
    v = d.get(key)
    if not isinstance(v, (list, tuple)) or not all(isinstance(h, int) and h >= 0 for h in v):
        raise ValueError(f"event field '{key}' must be a list of non-negative ints")
    return tuple(v)


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Consecutive full blocks were cached; ``parent_hash`` is the block before the first (None: root)."""

    TYPE: ClassVar[str] = "block_stored"
    block_hashes: tuple[int, ...]
    parent_hash: int | None
    num_tokens: int

    def __post_init__(self) -> None:
        if not self.block_hashes:
            raise ValueError("BlockStored.block_hashes must not be empty")
        if self.num_tokens < len(self.block_hashes):
            raise ValueError("BlockStored.num_tokens must be at least one token per block")

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.TYPE, "block_hashes": list(self.block_hashes),
                "parent_hash": self.parent_hash, "num_tokens": self.num_tokens}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BlockStored:
        parent = d.get("parent_hash")
        if parent is not None and (not isinstance(parent, int) or parent < 0):
            raise ValueError(f"event field 'parent_hash' must be null or a non-negative int, got {parent!r}")
        return cls(_hashes(d, "block_hashes"), parent, _int(d, "num_tokens", minimum=1))


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks were evicted."""

    TYPE: ClassVar[str] = "block_removed"
    block_hashes: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.TYPE, "block_hashes": list(self.block_hashes)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BlockRemoved:
        return cls(_hashes(d, "block_hashes"))


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every block and snapshot of the replica is gone (reset, restart)."""

    TYPE: ClassVar[str] = "all_blocks_cleared"

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.TYPE}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AllBlocksCleared:
        return cls()


@dataclass(frozen=True, slots=True)
class SnapshotStored:
    """A KDA state snapshot now exists after ``depth`` tokens; ``block_hash`` is the block ending there."""

    TYPE: ClassVar[str] = "snapshot_stored"
    block_hash: int
    depth: int

    def __post_init__(self) -> None:
        if self.depth <= 0:
            raise ValueError(f"snapshot depth must be positive, got {self.depth}")

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.TYPE, "block_hash": self.block_hash, "depth": self.depth}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SnapshotStored:
        return cls(_int(d, "block_hash"), _int(d, "depth", minimum=1))


@dataclass(frozen=True, slots=True)
class SnapshotRemoved:
    """The KDA snapshot at the end of ``block_hash`` was evicted."""

    TYPE: ClassVar[str] = "snapshot_removed"
    block_hash: int

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.TYPE, "block_hash": self.block_hash}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SnapshotRemoved:
        return cls(_int(d, "block_hash"))


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared | SnapshotStored | SnapshotRemoved
EVENT_TYPES: dict[str, type] = {
    c.TYPE: c for c in (BlockStored, BlockRemoved, AllBlocksCleared, SnapshotStored, SnapshotRemoved)
}


def event_from_dict(d: dict[str, Any]) -> KVEvent:
    if not isinstance(d, dict) or d.get("type") not in EVENT_TYPES:
        kind = d.get("type") if isinstance(d, dict) else type(d).__name__
        raise ValueError(f"unknown KV event type {kind!r}; expected one of {sorted(EVENT_TYPES)}")
    return EVENT_TYPES[d["type"]].from_dict(d)


@dataclass(frozen=True, slots=True)
class EventBatch:
    """Events from one replica, in order; ``seq`` starts at 0 and grows by one per batch."""

    replica: int
    seq: int
    events: tuple[KVEvent, ...]
    ts: float = 0.0

    def __post_init__(self) -> None:
        if self.replica < 0 or self.seq < 0:
            raise ValueError(f"EventBatch replica and seq must be >= 0, got {self.replica}, {self.seq}")

    def to_dict(self) -> dict[str, Any]:
        return {"replica": self.replica, "seq": self.seq, "ts": self.ts,
                "events": [e.to_dict() for e in self.events]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EventBatch:
        events = d.get("events")
        if not isinstance(events, list):
            raise ValueError("EventBatch field 'events' must be a list")
        ts = d.get("ts", 0.0)
        if not isinstance(ts, (int, float)):
            raise ValueError(f"EventBatch field 'ts' must be a number, got {ts!r}")
        return cls(_int(d, "replica"), _int(d, "seq"), tuple(event_from_dict(e) for e in events), float(ts))


@dataclass(frozen=True, slots=True)
class ReplicaState:
    """A replica's full cache content as of batch ``seq`` (-1: before any batch), for a resync."""

    seq: int
    block_hashes: tuple[int, ...]
    snapshots: tuple[tuple[int, int], ...] = ()  # (block hash, depth in tokens)

    def __post_init__(self) -> None:
        if self.seq < -1:
            raise ValueError(f"ReplicaState.seq must be >= -1, got {self.seq}")

    def to_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "block_hashes": list(self.block_hashes),
                "snapshots": [list(s) for s in self.snapshots]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ReplicaState:
        snaps = d.get("snapshots", [])
        if not isinstance(snaps, list) or not all(
            isinstance(s, (list, tuple)) and len(s) == 2 and all(isinstance(x, int) for x in s) for s in snaps
        ):
            raise ValueError("ReplicaState field 'snapshots' must be a list of [block_hash, depth] pairs")
        return cls(_int(d, "seq", minimum=-1), _hashes(d, "block_hashes"), tuple((h, n) for h, n in snaps))


class Delivery(enum.Enum):
    APPLY = "apply"  # in order: apply it
    DUPLICATE = "duplicate"  # already applied (replay overlap): drop it
    GAP = "gap"  # batches were missed: replica is now stale, drop it and recover


@dataclass
class SequenceTracker:
    """Expected next sequence number and stale flag of every replica."""

    expected: dict[int, int] = field(default_factory=dict)
    stale: set[int] = field(default_factory=set)

    def classify(self, replica: int, seq: int) -> Delivery:
        want = self.expected.get(replica, 0)
        if seq < want:
            return Delivery.DUPLICATE
        if seq > want:
            self.stale.add(replica)
            return Delivery.GAP
        self.expected[replica] = seq + 1
        self.stale.discard(replica)
        return Delivery.APPLY

    def resync(self, replica: int, seq: int) -> None:
        """The replica's full state as of batch ``seq`` was loaded: continue from ``seq + 1``."""
        self.expected[replica] = seq + 1
        self.stale.discard(replica)

    def forget(self, replica: int) -> None:
        self.expected.pop(replica, None)
        self.stale.discard(replica)
