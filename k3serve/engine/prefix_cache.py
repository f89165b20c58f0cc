"""Hybrid prefix cache over MLA blocks and KDA state snapshots, behind one small interface.

Match rule: a hit of depth P (a multiple of the block size) needs the MLA blocks of the whole prefix
``[0, P)`` *and* a KDA snapshot taken exactly at P. Both are keyed by the ``core.hashing`` chain hash of the
block ending at P (a block overlapping an image also hashes the image's content: ``multimodal.chain_hashes``),
so one walk of the hash chain finds the longest MLA prefix and then, right to left, the deepest snapshot
inside it. A hit always leaves at least one token to compute (the step that samples needs
its logits), so P <= num_tokens - 1.

``PrefixCache`` is the contract; ``HybridPrefixCache`` implements it over ``BlockPool`` + ``StatePool``;
``NoPrefixCache`` is the naive variant (caching off) used to check that hits never change outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from k3serve.engine.block_pool import BlockPool
from k3serve.engine.multimodal import chain_hashes
from k3serve.engine.request import Request
from k3serve.engine.state_pool import StatePool


@dataclass(frozen=True)
class PrefixMatch:
    num_tokens: int = 0
    blocks: tuple[int, ...] = ()
    snapshot_slot: int | None = None


class PrefixCache(Protocol):
    enabled: bool

    def match(self, req: Request) -> PrefixMatch:
        """The deepest usable hit for ``req``'s tokens; nothing is acquired (the caller acquires what it uses)."""

    def cache_blocks(self, req: Request) -> None:
        """Offer the request's full, computed blocks to the cache (idempotent, call after every step)."""

    def snapshot_key(self, req: Request, position: int) -> int:
        """The key a KDA snapshot of ``req`` at block-aligned ``position`` is published under."""


def update_block_hashes(req: Request, block_size: int, key: bytes = b"") -> list[int]:
    """Extend ``req.block_hashes`` to cover every full block of ``req.token_ids`` (hashed with ``key``)."""
    n_have = len(req.block_hashes)
    if (n_have + 1) * block_size <= req.num_tokens:
        parent = req.block_hashes[-1] if req.block_hashes else None
        # blocks overlapping an image also hash its content; text-only runs are one hash_blocks call
        req.block_hashes += chain_hashes(req.token_ids, n_have, block_size, parent, req.images, key)
    return req.block_hashes


class HybridPrefixCache:
    enabled = True
    events = None  # a kv_events.KVEventRecorder when someone listens (set by kv_events.attach)

    def __init__(self, blocks: BlockPool, states: StatePool, hash_key: bytes = b""):
        self.blocks = blocks
        self.states = states
        self.block_size = blocks.block_size
        self.hash_key = hash_key  # EngineConfig.hash_key: what the KV events' subscribers hash with too

    def match(self, req: Request) -> PrefixMatch:
        hashes = update_block_hashes(req, self.block_size, self.hash_key)[: (req.num_tokens - 1) // self.block_size]
        mla = self.blocks.match(hashes)
        for j in range(len(mla), 0, -1):
            slot = self.states.lookup(hashes[j - 1])
            if slot is not None:
                return PrefixMatch(j * self.block_size, tuple(mla[:j]), slot)
        return PrefixMatch()

    def cache_blocks(self, req: Request) -> None:
        hashes = update_block_hashes(req, self.block_size, self.hash_key)
        full = min(req.num_computed_tokens // self.block_size, len(hashes))
        for i in range(req.num_registered_blocks, full):
            self.blocks.register(req.block_ids[i], hashes[i], hashes[i - 1] if i else None)
        req.num_registered_blocks = max(req.num_registered_blocks, full)

    def snapshot_key(self, req: Request, position: int) -> int:
        if position <= 0 or position % self.block_size:
            raise ValueError(f"snapshot position {position} is not a positive multiple of {self.block_size}")
        key = update_block_hashes(req, self.block_size, self.hash_key)[position // self.block_size - 1]
        if self.events is not None:  # the state pool publishes keys only; the router wants the depth too
            self.events.note_snapshot_depth(key, position)
        return key


class NoPrefixCache:
    enabled = False

    def match(self, req: Request) -> PrefixMatch:
        return PrefixMatch()

    def cache_blocks(self, req: Request) -> None:
        pass

    def snapshot_key(self, req: Request, position: int) -> int:
        raise RuntimeError("prefix caching is off")
