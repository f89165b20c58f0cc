import pytest

from k3serve.core.kv_events import BlockStored, EventBatch, SnapshotStored
from k3serve.router.load import LoadTracker
from k3serve.router.policy import KVPolicy, PolicyConfig
from k3serve.router.prefix_index import SnapshotRule
from k3serve.router.router import Decision, Router
from k3serve.router.sequence import Delivery


def test_load_tracker_lifecycle():
    t = LoadTracker(2)
    t.on_routed("a", 1, prefill_blocks=3, decode_blocks=5)
    assert t.pending_prefill_blocks.tolist() == [0, 3] and t.active_requests.tolist() == [0, 1]
    t.on_first_token("a")
    t.on_first_token("a")  # repeated signal is harmless
    assert t.pending_prefill_blocks.tolist() == [0, 0] and t.decode_blocks.tolist() == [0, 5]
    t.on_finished("a")
    t.on_finished("a")
    assert t.decode_blocks.tolist() == [0, 0] and t.active_requests.tolist() == [0, 0]
    assert t.routed_requests.tolist() == [0, 1]
    t.on_routed("b", 0, 2, 2)
    t.on_finished("b")  # failed before its first token
    assert t.pending_prefill_blocks.tolist() == [0, 0]
    with pytest.raises(ValueError):
        t.on_routed("c", 2, 1, 1)


def test_router_counts_a_pick_at_once_and_predicts_its_blocks():
    router = Router(KVPolicy(PolicyConfig(weight=1.0, cache_weight=0.0)), 2, block_size=4,
                    snapshot_rule=SnapshotRule(interval=0))
    d1 = router.route("a", [1, 2, 3], prompt_blocks=3, decode_blocks=4)
    assert d1.overlap_blocks == 0
    assert router.load.pending_prefill_blocks[d1.replica] == 3
    # before any engine event, the same prompt is predicted to hit where "a" went (end-of-prompt snapshot)
    d2 = router.route("b", [1, 2, 3], prompt_blocks=3, decode_blocks=4)
    assert d2.replica == d1.replica and d2.overlap_blocks == 3
    router.on_first_token("a")
    router.on_first_token("b")
    # the engine confirms; predictions are gone, the index now holds the real events
    assert router.index.match([1, 2, 3]) == {}
    assert router.apply(d1.replica, EventBatch(0, (BlockStored((1, 2, 3), None, 12), SnapshotStored(3, 12)))) \
        is Delivery.APPLY
    assert router.index.match([1, 2, 3]) == {d1.replica: 3}
    # "a" and "b" still decode there (8 KV blocks): a cold replica is cheaper than the 3-block hit
    assert router.route("c", [1, 2, 3], 3, 4).replica != d1.replica
    router.on_finished("a")
    router.on_finished("b")
    assert router.route("d", [1, 2, 3], 3, 4) == Decision(d1.replica, 3)


def test_router_respects_routable_and_rejects_bad_input():
    router = Router(KVPolicy(), 3, block_size=4)
    for i in range(5):
        assert router.route(i, [i], 1, 1, routable=[2]).replica == 2
    with pytest.raises(ValueError):
        router.route("x", [1], 1, 1, routable=[5])
    with pytest.raises(ValueError):
        router.route("y", [1], 0, 1)
    with pytest.raises(ValueError):
        router.route("z", [1, 2], 1, 1)  # more hashed blocks than prompt blocks
    with pytest.raises(ValueError):
        router.route(0, [1], 1, 1)  # request 0 is still in flight
    with pytest.raises(ValueError):
        router.apply(7, EventBatch(0, ()))
