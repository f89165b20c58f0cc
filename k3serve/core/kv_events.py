"""KV-cache events: the one vocabulary in which an engine tells a router what entered and left its prefix cache.

The engine publishes these messages (``engine.kv_events``), the router applies them (``router``); both import
them from here. Block identities are the chain hashes of ``core.hashing`` (u64). A hybrid (KDA + MLA) hit
also needs a KDA state snapshot, so snapshots are events too, keyed by the hash of the block that ends at the
snapshot's depth.

Messages are msgspec structs; an event is tagged by its ``"type"`` field. On the wire (msgpack):

    EventBatch(seq, events, ts)   seq grows by one per batch, per engine process, from 0
    ReplicaState(seq, block_hashes, snapshots)   the full cache content as of batch ``seq`` (for a resync)

An engine sends every batch on a ZMQ PUB socket as the multipart ``[TOPIC, seq (8 bytes big-endian),
msgpack(EventBatch)]`` and answers ``[SNAPSHOT_REQUEST]`` on a ROUTER socket with ``msgpack(ReplicaState)``;
``KVEventsInfo`` (served at ``/kv_events/info``) says where. With a secret (``core.kv_auth``) the
hashes are keyed and both sockets are CURVE-encrypted and admit only the router's derived key. The engine does not know the router's replica
ids: the router says which replica a batch came from when it applies it. ``decode_batch`` and
``decode_state`` validate and raise ``ValueError`` on anything malformed.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

TOPIC = b"kv"
SNAPSHOT_REQUEST = b"snapshot"

Hash = Annotated[int, msgspec.Meta(ge=0)]
Count = Annotated[int, msgspec.Meta(ge=1)]


class BlockStored(msgspec.Struct, tag="block_stored", frozen=True):
    """Consecutive full blocks were cached: a chain, each block's parent the one before it;
    ``parent_hash`` is the parent of the first (None: it starts the sequence)."""

    block_hashes: tuple[Hash, ...]
    parent_hash: Hash | None
    num_tokens: Count

    def __post_init__(self) -> None:
        if not self.block_hashes:
            raise ValueError("BlockStored.block_hashes must not be empty")
        if self.num_tokens < len(self.block_hashes):
            raise ValueError("BlockStored.num_tokens must be at least one token per block")


class BlockRemoved(msgspec.Struct, tag="block_removed", frozen=True):
    """Blocks were evicted."""

    block_hashes: tuple[Hash, ...]


class AllBlocksCleared(msgspec.Struct, tag="all_blocks_cleared", frozen=True):
    """Every block and snapshot of the engine is gone (reset, restart)."""


class SnapshotStored(msgspec.Struct, tag="snapshot_stored", frozen=True):
    """A KDA state snapshot now exists after ``depth`` tokens; ``block_hash`` is the block ending there."""

    block_hash: Hash
    depth: int

    def __post_init__(self) -> None:
        if self.depth <= 0:
            raise ValueError(f"snapshot depth must be positive, got {self.depth}")


class SnapshotRemoved(msgspec.Struct, tag="snapshot_removed", frozen=True):
    """The KDA snapshot at the end of ``block_hash`` was evicted."""

    block_hash: Hash


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared | SnapshotStored | SnapshotRemoved


class EventBatch(msgspec.Struct, frozen=True):
    """Events of one engine, in order; ``seq`` starts at 0 and grows by one per batch."""

    seq: int
    events: tuple[KVEvent, ...]
    ts: float = 0.0

    def __post_init__(self) -> None:
        if self.seq < 0:
            raise ValueError(f"EventBatch.seq must be >= 0, got {self.seq}")


class ReplicaState(msgspec.Struct, frozen=True):
    """An engine's full cache content as of batch ``seq`` (-1: before any batch), for a resync."""

    seq: int
    block_hashes: tuple[Hash, ...]
    snapshots: tuple[tuple[Hash, Count], ...] = ()  # (block hash, depth in tokens)

    def __post_init__(self) -> None:
        if self.seq < -1:
            raise ValueError(f"ReplicaState.seq must be >= -1, got {self.seq}")


class KVEventsInfo(msgspec.Struct, frozen=True):
    """Where an engine publishes (ports on ``host``, the address it bound), the block size it hashes with,
    and, when the events are keyed (``core.kv_auth``), its CURVE server public key (z85)."""

    block_size: int
    pub_port: int
    snapshot_port: int
    host: str = ""
    server_key: str | None = None


_batch_decoder = msgspec.msgpack.Decoder(EventBatch)
_state_decoder = msgspec.msgpack.Decoder(ReplicaState)


def decode_batch(payload: bytes) -> EventBatch:
    """A PUB payload -> EventBatch (ValueError on anything malformed)."""
    try:
        return _batch_decoder.decode(payload)
    except msgspec.DecodeError as e:  # ValidationError (bad fields, __post_init__) is a DecodeError
        raise ValueError(f"bad KV event batch: {e}") from None


def decode_state(payload: bytes) -> ReplicaState:
    """A snapshot reply -> ReplicaState (ValueError on anything malformed)."""
    try:
        return _state_decoder.decode(payload)
    except msgspec.DecodeError as e:
        raise ValueError(f"bad KV state reply: {e}") from None
