from k3serve.router.sequence import Delivery, SequenceTracker


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
