"""The KV event vocabulary (``core.kv_events``): every message survives the msgpack wire, and anything
malformed is refused at decode with a ValueError (the router logs it and moves on)."""

import msgspec
import pytest

from k3serve.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    ReplicaState,
    SnapshotRemoved,
    SnapshotStored,
    decode_batch,
    decode_state,
)

ALL = (
    BlockStored((1, 2, 3), None, 1536),
    BlockStored((4,), 3, 512),
    BlockRemoved((1, 2)),
    AllBlocksCleared(),
    SnapshotStored(3, 1536),
    SnapshotRemoved(3),
)
_ENC = msgspec.msgpack.Encoder()


def test_every_event_round_trips_through_msgpack():
    batch = EventBatch(seq=7, events=ALL, ts=1.5)
    again = decode_batch(_ENC.encode(batch))
    assert again == batch
    assert [type(e) for e in again.events] == [type(e) for e in ALL]
    state = ReplicaState(3, (1, 2), ((2, 1024),))
    assert decode_state(_ENC.encode(state)) == state


def test_wire_layout_is_maps_tagged_by_type():
    raw = msgspec.msgpack.decode(_ENC.encode(EventBatch(0, (BlockStored((5,), None, 16), AllBlocksCleared()))))
    assert raw == {"seq": 0, "ts": 0.0, "events": [
        {"type": "block_stored", "block_hashes": [5], "parent_hash": None, "num_tokens": 16},
        {"type": "all_blocks_cleared"}]}


@pytest.mark.parametrize("bad", [
    {"type": "nope"},
    {"type": "block_stored", "block_hashes": [1], "parent_hash": -1, "num_tokens": 512},
    {"type": "block_stored", "block_hashes": "12", "parent_hash": None, "num_tokens": 512},
    {"type": "block_stored", "block_hashes": [], "parent_hash": None, "num_tokens": 512},
    {"type": "block_stored", "block_hashes": [1, 2], "parent_hash": None, "num_tokens": 1},
    {"type": "snapshot_stored", "block_hash": 1, "depth": 0},
    {"type": "block_removed", "block_hashes": [1.5]},
    [1, 2],
])
def test_malformed_events_raise_value_error(bad):
    with pytest.raises(ValueError, match="bad KV event batch"):
        decode_batch(_ENC.encode({"seq": 0, "ts": 0.0, "events": [bad]}))


def test_malformed_batch_and_state():
    with pytest.raises(ValueError):
        decode_batch(_ENC.encode({"seq": -1, "events": []}))
    with pytest.raises(ValueError):
        decode_batch(_ENC.encode({"seq": 0, "events": {}}))
    with pytest.raises(ValueError):
        decode_batch(b"\xc1")  # not msgpack at all
    with pytest.raises(ValueError, match="bad KV state"):
        decode_state(_ENC.encode({"seq": 0, "block_hashes": [1], "snapshots": [[1]]}))
    with pytest.raises(ValueError):
        decode_state(_ENC.encode({"seq": -2, "block_hashes": []}))
    with pytest.raises(ValueError):  # direct construction checks the same rules as decoding
        BlockStored((), None, 16)
