"""Which decode worker continues a prefill/decode hand-off: by load and by what its prefix cache holds.

The ``kv`` policy (``router/policy.py``) over the decode workers, through the same ``Router`` the ordinary
replicas use. Decode workers publish no KV events to the prefill/decode router, so each one's cache is
modelled here (``cache_model.ReplicaCache``: the prompts this router sent it, LRU to ``cache_blocks``).
On a decode worker a cached prefix needs no KDA snapshot (the state at the prompt's end arrives in the
manifest; ``engine/pd/handoff.reserve`` matches MLA blocks only), so every cached block counts: each
prompt is inserted with a snapshot at every depth. A hit saves that many blocks of latents on the wire and
keeps the worker's cache from holding the prefix twice.

The router knows the token ids of token-id completion prompts only; any other prompt (text, chat) is placed
by load alone (no hashes: no overlap anywhere).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from k3serve.core.hashing import hash_blocks
from k3serve.router.cache_model import ReplicaCache
from k3serve.router.policy import KVPolicy, PolicyConfig
from k3serve.router.prefix_index import SnapshotRule
from k3serve.router.router import Router

DEFAULT_CACHE_BLOCKS = 4096  # assumed capacity of a decode worker's prefix cache, in blocks


class DecodeChoice:
    def __init__(self, num_workers: int, *, block_size: int = 16, cache_blocks: int = DEFAULT_CACHE_BLOCKS,
                 policy: PolicyConfig = PolicyConfig()) -> None:
        self.block_size = block_size
        self.router = Router(KVPolicy(policy), num_workers, block_size, SnapshotRule(interval=1, branch=False))
        self.caches = [ReplicaCache(cache_blocks, block_size) for _ in range(num_workers)]

    def pick(self, request_id: object, prompt_ids: Sequence[int] | None, max_tokens: int,
             routable: Sequence[int] | None = None) -> int:
        """The decode worker for a request (counted there until ``finished``); ``prompt_ids`` None: unknown."""
        bs = self.block_size
        ids = list(prompt_ids or ())
        hashes = hash_blocks(ids, bs) if ids else []
        decision = self.router.route(request_id, hashes, max(1, -(-len(ids) // bs)),
                                     -(-(len(ids) + max_tokens) // bs), routable=routable)
        if hashes:  # after the hand-off the worker's cache holds the prompt's full blocks
            w = decision.replica
            batch = self.caches[w].insert(hashes, range(1, len(hashes) + 1), time.monotonic())
            self.router.apply(w, batch)
        return decision.replica

    def started(self, request_id: object) -> None:
        """The worker answered (the hand-off is in): no transfer pending for this request any more."""
        self.router.on_first_token(request_id)

    def finished(self, request_id: object) -> None:
        self.router.on_finished(request_id)
