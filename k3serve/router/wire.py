"""Engine wire events (``engine.kv_events``, msgpack) -> the router's ``events`` types.

The engine does not know the router's replica ids; the router stamps them on here. Both sides share
the tag strings, so the conversion is a field-by-field copy plus the router's validation.
"""

from __future__ import annotations

import msgspec

from k3serve.engine import kv_events as wire
from k3serve.router.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    ReplicaState,
    SnapshotRemoved,
    SnapshotStored,
)


def to_event(e: wire.WireEvent) -> KVEvent:
    if isinstance(e, wire.BlockStored):
        return BlockStored(tuple(e.block_hashes), e.parent_hash, e.num_tokens)
    if isinstance(e, wire.BlockRemoved):
        return BlockRemoved(tuple(e.block_hashes))
    if isinstance(e, wire.SnapshotStored):
        return SnapshotStored(e.block_hash, e.depth)
    if isinstance(e, wire.SnapshotRemoved):
        return SnapshotRemoved(e.block_hash)
    if isinstance(e, wire.AllBlocksCleared):
        return AllBlocksCleared()
    raise ValueError(f"not a KV wire event: {e!r}")


def to_batch(replica: int, batch: wire.KVBatch) -> EventBatch:
    return EventBatch(replica, batch.seq, tuple(to_event(e) for e in batch.events), batch.ts)


def decode_batch(replica: int, payload: bytes) -> EventBatch:
    """A PUB payload -> EventBatch (ValueError on anything malformed)."""
    try:
        return to_batch(replica, wire.batch_decoder.decode(payload))
    except (msgspec.DecodeError, ValueError) as e:  # ValidationError is a DecodeError
        raise ValueError(f"bad KV event batch from replica {replica}: {e}") from None


def decode_state(payload: bytes) -> ReplicaState:
    try:
        s = wire.state_decoder.decode(payload)
    except msgspec.DecodeError as e:
        raise ValueError(f"bad KV state reply: {e}") from None
    return ReplicaState(s.seq, tuple(s.block_hashes), tuple((h, d) for h, d in s.snapshots))
