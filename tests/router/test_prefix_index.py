import random

from hypothesis import given, settings
from hypothesis import strategies as st

from k3serve.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    ReplicaState,
    SnapshotRemoved,
    SnapshotStored,
)
from k3serve.router.prefix_index import PrefixIndex, SnapshotRule
from k3serve.router.sequence import Delivery

BS = 4


class Feed:
    """Sends events for one replica with consecutive sequence numbers."""

    def __init__(self, index: PrefixIndex, replica: int) -> None:
        self.index, self.replica, self.seq = index, replica, 0

    def send(self, *events) -> Delivery:
        out = self.index.apply(self.replica, EventBatch(self.seq, tuple(events)))
        self.seq += 1
        return out


def stored(hashes, parent=None):
    return BlockStored(tuple(hashes), parent, BS * len(hashes))


def test_usable_overlap_is_capped_at_the_deepest_snapshot_within_the_prefix():
    idx = PrefixIndex(BS)
    a, b = Feed(idx, 0), Feed(idx, 1)
    a.send(stored([10, 11, 12, 13, 14]), SnapshotStored(11, 2 * BS), SnapshotStored(14, 5 * BS))
    b.send(stored([10, 11, 12]), SnapshotStored(10, BS), SnapshotStored(12, 3 * BS))
    # request shares the first 4 blocks with replica 0 and 3 with replica 1
    request = [10, 11, 12, 13, 99]
    assert idx.match_depths(request) == {0: (4, 2), 1: (3, 3)}
    assert idx.match(request) == {0: 2, 1: 3}
    # the full chain of replica 0 is usable up to its end snapshot
    assert idx.match([10, 11, 12, 13, 14, 15]) == {0: 5, 1: 3}
    assert idx.match([99, 10]) == {}
    assert idx.match([]) == {} and idx.match_depths([]) == {}


def test_removal_clear_and_snapshot_removal():
    idx = PrefixIndex(BS)
    a = Feed(idx, 0)
    a.send(stored([1, 2, 3]), SnapshotStored(1, BS), SnapshotStored(3, 3 * BS))
    a.send(SnapshotRemoved(3))
    assert idx.match([1, 2, 3]) == {0: 1}
    a.send(BlockRemoved((1,)))  # the root is gone: nothing below it is reachable
    assert idx.match([1, 2, 3]) == {}
    a.send(stored([1]))  # block back, but its snapshot went with it
    assert idx.match_depths([1, 2, 3]) == {0: (3, 0)}
    a.send(AllBlocksCleared())
    assert idx.match_depths([1, 2, 3]) == {} and idx.num_blocks(0) == 0


def test_misaligned_snapshot_is_ignored():
    idx = PrefixIndex(BS)
    Feed(idx, 0).send(stored([1, 2]), SnapshotStored(2, 2 * BS - 1))
    assert idx.match([1, 2]) == {}


def test_gap_marks_stale_then_resync_restores():
    idx = PrefixIndex(BS)
    a, b = Feed(idx, 0), Feed(idx, 1)
    a.send(stored([1, 2]), SnapshotStored(2, 2 * BS))
    b.send(stored([1]), SnapshotStored(1, BS))
    a.seq += 1  # batch 1 of replica 0 is lost
    assert a.send(BlockRemoved((2,))) is Delivery.GAP
    assert idx.is_stale(0)
    assert idx.match([1, 2]) == {1: 1}  # a stale replica claims no hits
    idx.resync(0, ReplicaState(seq=2, block_hashes=(1, 2, 3), snapshots=((3, 3 * BS),)))
    assert not idx.is_stale(0)
    assert idx.match([1, 2, 3]) == {0: 3, 1: 1}
    assert a.send(BlockRemoved((3,))) is Delivery.APPLY  # seq 3 follows the resynced seq 2
    assert idx.match([1, 2, 3]) == {1: 1}


def test_replay_after_gap_heals_without_resync():
    idx = PrefixIndex(BS)
    idx.apply(0, EventBatch(0, (stored([1]),)))
    assert idx.apply(0, EventBatch(2, (SnapshotStored(1, BS),))) is Delivery.GAP
    assert idx.apply(0, EventBatch(1, (stored([2], 1),))) is Delivery.APPLY
    assert idx.apply(0, EventBatch(2, (SnapshotStored(1, BS),))) is Delivery.APPLY
    assert not idx.is_stale(0) and idx.match([1, 2]) == {0: 1}


def test_pending_blocks_count_until_dropped():
    idx = PrefixIndex(BS)
    idx.add_pending("r1", 3, [5, 6, 7], [3])
    idx.add_pending("r2", 3, [5, 6], [2])
    assert idx.match([5, 6, 7]) == {3: 3}
    idx.drop_pending("r1")
    assert idx.match([5, 6, 7]) == {3: 2}  # r2 still holds 5, 6 (refcounted)
    idx.drop_pending("r2")
    assert idx.match([5, 6, 7]) == {}


def test_snapshot_rule():
    assert SnapshotRule(interval=0, branch=True).depths(5, 2) == [2, 5]
    assert SnapshotRule(interval=2, branch=False).depths(5, 3) == [2, 4, 5]
    assert SnapshotRule(interval=4, branch=True).depths(8, 8) == [4, 8]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31))
def test_match_agrees_with_a_brute_force_model(seed):
    rng = random.Random(seed)
    idx = PrefixIndex(BS)
    feeds = [Feed(idx, r) for r in range(3)]
    blocks = [set() for _ in range(3)]
    snaps = [set() for _ in range(3)]
    # chains: prefix tuples identify blocks, like chain hashes
    universe = [tuple(rng.randrange(3) for _ in range(rng.randrange(1, 6))) for _ in range(12)]
    hid = {}

    def h(prefix):
        return hid.setdefault(prefix, len(hid) + 1)

    for _ in range(30):
        r = rng.randrange(3)
        chain = rng.choice(universe)
        hashes = [h(chain[: i + 1]) for i in range(len(chain))]
        op = rng.random()
        if op < 0.5:
            feeds[r].send(stored(hashes))
            blocks[r].update(hashes)
            d = rng.randrange(1, len(hashes) + 1)
            feeds[r].send(SnapshotStored(hashes[d - 1], d * BS))
            snaps[r].add(hashes[d - 1])
        elif op < 0.8:
            victim = rng.choice(hashes)
            feeds[r].send(BlockRemoved((victim,)))
            blocks[r].discard(victim)
            snaps[r].discard(victim)
        elif op < 0.95:
            victim = rng.choice(hashes)
            feeds[r].send(SnapshotRemoved(victim))
            snaps[r].discard(victim)
        else:
            feeds[r].send(AllBlocksCleared())
            blocks[r].clear()
            snaps[r].clear()
    for chain in universe:
        hashes = [h(chain[: i + 1]) for i in range(len(chain))]
        want = {}
        for r in range(3):
            usable = 0
            for i, x in enumerate(hashes):
                if x not in blocks[r]:
                    break
                if x in snaps[r]:
                    usable = i + 1
            if usable:
                want[r] = usable
        assert idx.match(hashes) == want
