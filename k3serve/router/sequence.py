"""Per-replica sequence tracking of KV event batches (``core.kv_events``): in order, duplicate, or a gap.

A batch whose sequence number skips ahead means events were lost; the replica is marked stale and the
batch is not applied. It recovers either by replay (the engine re-sends batches from ``expected`` on; the
first one that arrives in order clears the stale flag) or by a full resync (``resync(replica, seq)`` after
loading the engine's full state).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


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
