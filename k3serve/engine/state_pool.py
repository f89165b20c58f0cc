"""The KDA state slot pool: one slot per running request plus a bounded set of state snapshots.

A slot holds every KDA layer's recurrent state ``[H, K, V]`` and short-conv window ``[3P, W-1]`` (the
tensors live in ``ModelCaches``; this class only does the bookkeeping over slot indices).

``num_slots = max_running + num_snapshot_slots``. Running requests always find a slot (the scheduler never
runs more than ``max_running``), so snapshots never have to be evicted to admit a request; snapshot slots are
either *pending* (held by a running request, not yet published) or *cached* (keyed by the chain hash of the
last block before the snapshot position, reference-counted, LRU-evicted when unreferenced).
"""

from __future__ import annotations

from collections import OrderedDict, deque


class StatePool:
    events = None  # a kv_events.KVEventRecorder when someone listens (set by kv_events.attach)

    def __init__(self, max_running: int, num_snapshot_slots: int):
        if max_running < 1 or num_snapshot_slots < 0:
            raise ValueError(f"need max_running >= 1 and num_snapshot_slots >= 0, got {max_running}, "
                             f"{num_snapshot_slots}")
        self.max_running = max_running
        self.num_snapshot_slots = num_snapshot_slots
        self.num_slots = max_running + num_snapshot_slots
        self._free: deque[int] = deque(range(self.num_slots))
        self._num_running = 0
        self._num_snapshot_held = 0  # pending + cached
        self.snapshot_of: dict[int, int] = {}  # key (block chain hash) -> slot
        self._key_of: dict[int, int] = {}  # slot -> key
        self._refs: dict[int, int] = {}  # cached slot -> references
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced cached slots, least recent first

    @property
    def num_running_free(self) -> int:
        return self.max_running - self._num_running

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_snapshots(self) -> int:
        return len(self.snapshot_of)

    def allocate_running(self) -> int:
        if self._num_running >= self.max_running:
            raise RuntimeError("no running state slot left")
        self._num_running += 1
        return self._free.popleft()

    def free_running(self, slot: int) -> None:
        self._num_running -= 1
        self._free.append(slot)

    def allocate_snapshot(self) -> int | None:
        """A slot for a new (pending) snapshot, evicting the least recently used cached one if needed;
        None when every snapshot slot is pending or referenced."""
        if self._num_snapshot_held >= self.num_snapshot_slots:
            if not self._lru:
                return None
            self._evict(next(iter(self._lru)))
        self._num_snapshot_held += 1
        return self._free.popleft()

    def free_snapshot(self, slot: int) -> None:
        """Give back a pending (never published) snapshot slot."""
        self._num_snapshot_held -= 1
        self._free.append(slot)

    def publish(self, slot: int, key: int) -> bool:
        """Turn a pending snapshot into a cached one under ``key``; a duplicate key frees the slot instead."""
        if key in self.snapshot_of:
            self.free_snapshot(slot)
            return False
        self.snapshot_of[key] = slot
        self._key_of[slot] = key
        self._refs[slot] = 0
        self._lru[slot] = None
        if self.events is not None:
            self.events.snapshot_stored(key)
        return True

    def lookup(self, key: int) -> int | None:
        slot = self.snapshot_of.get(key)
        if slot is not None and slot in self._lru:
            self._lru.move_to_end(slot)
        return slot

    def acquire(self, slot: int) -> None:
        if self._refs[slot] == 0:
            del self._lru[slot]
        self._refs[slot] += 1

    def release(self, slot: int) -> None:
        self._refs[slot] -= 1
        if self._refs[slot] < 0:
            raise RuntimeError(f"snapshot slot {slot} released more often than acquired")
        if self._refs[slot] == 0:
            self._lru[slot] = None

    def _evict(self, slot: int) -> None:
        key = self._key_of.pop(slot)
        del self._lru[slot], self.snapshot_of[key], self._refs[slot]
        if self.events is not None:
            self.events.snapshot_removed(key)
        self.free_snapshot(slot)

    def clear_cache(self) -> None:
        for slot in list(self._lru):
            self._evict(slot)
