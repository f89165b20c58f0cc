"""The MLA block pool: fixed-size blocks of compressed latents, reference counts, and a hash-chained cache.

A block is in exactly one of three states:
  * in use      ``ref_count > 0`` (held by running requests; a cached block may be shared by several);
  * cached free ``ref_count == 0`` with a hash: its contents are still valid for prefix hits and it sits in
    an LRU queue; it is evicted (hash dropped) only when an allocation needs it;
  * free        ``ref_count == 0``, no hash.

Block hashes are ``core.hashing`` chain hashes, so a hash names the whole prefix up to the block's end.
"""

from __future__ import annotations

from collections import OrderedDict, deque


class BlockPool:
    events = None  # a kv_events.KVEventRecorder when someone listens (set by kv_events.attach)

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self._free: deque[int] = deque(range(num_blocks))
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached free blocks, least recent first

    @property
    def num_free(self) -> int:
        """Blocks an allocation can get (free plus evictable cached ones)."""
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self.hash_to_block)

    def match(self, hashes: list[int]) -> list[int]:
        """Blocks of the longest cached prefix of the hash chain ``hashes`` (not acquired)."""
        blocks = []
        for h in hashes:
            b = self.hash_to_block.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def acquire(self, blocks: list[int]) -> None:
        """Take a reference on cached blocks (a prefix hit)."""
        for b in blocks:
            if self.ref_count[b] == 0:
                self._lru.pop(b)
            self.ref_count[b] += 1

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"cannot allocate {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._lru.popitem(last=False)
                del self.hash_to_block[self.block_hash[b]]
                if self.events is not None:
                    self.events.block_removed(self.block_hash[b])
                self.block_hash[b] = None
            self.ref_count[b] = 1
            out.append(b)
        return out

    def release(self, blocks: list[int]) -> None:
        """Drop one reference per block. Pass a block table in order: it is released tail first, so that
        longer prefixes are evicted before the shorter ones they extend."""
        for b in reversed(blocks):
            self.ref_count[b] -= 1
            if self.ref_count[b] < 0:
                raise RuntimeError(f"block {b} released more often than acquired")
            if self.ref_count[b] == 0:
                if self.block_hash[b] is None:
                    self._free.append(b)
                else:
                    self._lru[b] = None

    def register(self, block: int, block_hash: int, parent: int | None = None) -> bool:
        """Offer a full, computed, in-use block to the cache under ``block_hash``.

        Returns False when another block already holds that prefix (the request keeps its own copy, which
        returns to the free list when released). ``parent``: the previous block's hash, for KV events."""
        if self.ref_count[block] == 0:
            raise RuntimeError(f"block {block} is not in use")
        if block_hash in self.hash_to_block or self.block_hash[block] is not None:
            return self.hash_to_block.get(block_hash) == block
        self.block_hash[block] = block_hash
        self.hash_to_block[block_hash] = block
        if self.events is not None:
            self.events.block_stored(block_hash, parent)
        return True

    def clear_cache(self) -> None:
        """Drop every cached-free block from the cache (blocks in use keep their hashes)."""
        while self._lru:
            b, _ = self._lru.popitem(last=False)
            del self.hash_to_block[self.block_hash[b]]
            if self.events is not None:
                self.events.block_removed(self.block_hash[b])
            self.block_hash[b] = None
            self._free.append(b)
