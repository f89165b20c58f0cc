"""Block pool and KDA state pool bookkeeping: refcounts, hash registration, LRU eviction order."""

from __future__ import annotations

import pytest

from k3serve.engine.block_pool import BlockPool
from k3serve.engine.state_pool import StatePool


def test_block_refcounts_and_free_list():
    pool = BlockPool(4, block_size=2)
    a = pool.allocate(3)
    assert pool.num_free == 1 and pool.num_used == 3
    pool.acquire([a[0]])
    pool.release(a)
    assert pool.num_free == 3 and pool.ref_count[a[0]] == 1
    pool.release([a[0]])
    assert pool.num_free == 4
    with pytest.raises(RuntimeError):
        pool.release([a[0]])
    with pytest.raises(RuntimeError):
        pool.allocate(5)


def test_cached_blocks_survive_release_and_are_evicted_lru_tail_first():
    pool = BlockPool(4, block_size=2)
    table = pool.allocate(3)
    for b, h in zip(table, (11, 12, 13)):
        assert pool.register(b, h)
    pool.release(table)  # tail first: block of hash 13 becomes the least recently used
    assert pool.match([11, 12, 13, 14]) == table and pool.num_free == 4
    got = pool.allocate(2)  # the plain free block, then the LRU cached one (hash 13)
    assert table[2] in got and pool.match([11, 12, 13]) == table[:2]
    pool.acquire(table[:1])  # a hit takes the block out of the LRU queue
    assert pool.num_free == 1
    pool.allocate(1)
    assert pool.match([11, 12]) == table[:1]


def test_duplicate_registration_keeps_the_first_block():
    pool = BlockPool(3, block_size=2)
    a, b = pool.allocate(2)
    assert pool.register(a, 5) and not pool.register(b, 5)
    pool.release([a, b])
    assert pool.match([5]) == [a] and pool.num_cached == 1
    pool.clear_cache()
    assert pool.match([5]) == [] and pool.num_free == 3


def test_state_pool_running_slots_never_evict_snapshots():
    pool = StatePool(max_running=2, num_snapshot_slots=2)
    r = [pool.allocate_running(), pool.allocate_running()]
    with pytest.raises(RuntimeError):
        pool.allocate_running()
    s1, s2 = pool.allocate_snapshot(), pool.allocate_snapshot()
    assert len({*r, s1, s2}) == 4
    assert pool.publish(s1, key=100) and pool.publish(s2, key=200)
    pool.acquire(s1)  # referenced: not evictable
    s3 = pool.allocate_snapshot()  # evicts the only unreferenced snapshot, key 200
    assert s3 is not None and pool.lookup(200) is None and pool.lookup(100) == s1
    assert pool.allocate_snapshot() is None  # s1 referenced, s3 pending
    assert not pool.publish(s3, key=100)  # duplicate key: slot handed back
    pool.release(s1)
    for slot in r:
        pool.free_running(slot)
    pool.clear_cache()
    assert pool.num_free == 4 and pool.num_snapshots == 0


def test_state_pool_lru_order_follows_lookups():
    pool = StatePool(max_running=1, num_snapshot_slots=2)
    a, b = pool.allocate_snapshot(), pool.allocate_snapshot()
    pool.publish(a, 1)
    pool.publish(b, 2)
    pool.lookup(1)  # touch: key 2 is now least recent
    assert pool.allocate_snapshot() is not None
    assert pool.lookup(2) is None and pool.lookup(1) == a
