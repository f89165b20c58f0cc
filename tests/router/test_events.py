import json

import pytest

from k3serve.router.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Delivery,
    EventBatch,
    ReplicaState,
    SequenceTracker,
    SnapshotRemoved,
    SnapshotStored,
    event_from_dict,
)

ALL = (
    BlockStored((1, 2, 3), None, 1536),
    BlockStored((4,), 3, 512),
    BlockRemoved((1, 2)),
    AllBlocksCleared(),
    SnapshotStored(3, 1536),
    SnapshotRemoved(3),
)


def test_every_event_round_trips_through_json():
    batch = EventBatch(replica=2, seq=7, events=ALL, ts=1.5)
    again = EventBatch.from_dict(json.loads(json.dumps(batch.to_dict())))
    assert again == batch
    assert [type(e) for e in again.events] == [type(e) for e in ALL]


@pytest.mark.parametrize("bad", [
    {"type": "nope"},
    {"type": "block_stored", "block_hashes": [1], "parent_hash": -1, "num_tokens": 512},
    {"type": "block_stored", "block_hashes": "12", "parent_hash": None, "num_tokens": 512},
    {"type": "block_stored", "block_hashes": [], "parent_hash": None, "num_tokens": 512},
    {"type": "snapshot_stored", "block_hash": 1, "depth": 0},
    {"type": "block_removed", "block_hashes": [1.5]},
    [1, 2],
])
def test_malformed_events_raise_value_error(bad):
    with pytest.raises(ValueError):
        event_from_dict(bad)


def test_malformed_batch_and_state():
    with pytest.raises(ValueError):
        EventBatch.from_dict({"replica": 0, "seq": -1, "events": []})
    with pytest.raises(ValueError):
        EventBatch.from_dict({"replica": 0, "seq": 0, "events": {}})
    with pytest.raises(ValueError):
        ReplicaState.from_dict({"seq": 0, "block_hashes": [1], "snapshots": [[1]]})
    state = ReplicaState(3, (1, 2), ((2, 1024),))
    assert ReplicaState.from_dict(json.loads(json.dumps(state.to_dict()))) == state


def test_tracker_in_order_duplicate_gap_replay_resync():
    t = SequenceTracker()
    assert t.classify(0, 0) is Delivery.APPLY
    assert t.classify(0, 1) is Delivery.APPLY
    assert t.classify(0, 1) is Delivery.DUPLICATE
    assert t.classify(0, 3) is Delivery.GAP  # 2 was lost
    assert 0 in t.stale
    assert t.classify(0, 4) is Delivery.GAP  # still missing 2: nothing applies out of order
    assert t.classify(0, 2) is Delivery.APPLY  # replay from the expected seq heals it
    assert 0 not in t.stale and t.expected[0] == 3
    assert t.classify(1, 5) is Delivery.GAP  # a replica first heard of mid-stream is stale
    t.resync(1, 9)
    assert 1 not in t.stale
    assert t.classify(1, 9) is Delivery.DUPLICATE
    assert t.classify(1, 10) is Delivery.APPLY
