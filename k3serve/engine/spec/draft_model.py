"""``DraftModelDrafter``: a second, small model sharing the target's tokenizer proposes k tokens greedily.

The draft model has its own caches: per request it drafts for, one KDA slot and a contiguous run of MLA blocks
(``max_requests`` of them; the least recently used request gives its seat up), plus one scratch KDA slot.
A proposal for a request whose tokens are ``t[:L]`` (its last one just sampled by the target):
  1. feed ``t[fed:L]`` into the request's slot (the tokens committed since its last proposal; all of ``t`` the
     first time, or when ``t`` no longer extends what was fed): the slot then holds the state after ``t[:L]``
     exactly, and the argmax at the last position is draft 1;
  2. copy that state to the scratch slot and run drafts 1 .. k-1 there, one token per forward; each argmax is
     the next draft. Their MLA latents land past position L in the request's own blocks, where the next feed
     overwrites them before anything reads them.
Rejected drafts never touch the committed state, so the draft model's rollback is "re-run from the accepted
prefix": the accepted drafts are fed again (as a chunk) on the next proposal. Drafts only cost speed, never
correctness: the target verifies every one.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from k3serve.core.context import ForwardContext, forward_context
from k3serve.models.cache import allocate_caches, cache_spec


class DraftModelDrafter:
    def __init__(self, model: nn.Module, *, max_requests: int, max_len: int, max_drafts: int,
                 block_size: int = 16, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.model = model
        self.device = torch.device(device)
        self.max_len = max_len  # the most tokens a request may hold when it asks for drafts
        per_seq = (max_len + max_drafts + block_size - 1) // block_size
        self.caches = allocate_caches(cache_spec(model, dtype), num_blocks=max_requests * per_seq,
                                      block_size=block_size, num_slots=max_requests + 1, device=device)
        self.tables = torch.arange(max_requests * per_seq, device=self.device).view(max_requests, per_seq)
        self.capacity = per_seq * block_size
        self.scratch = max_requests  # the slot drafts run in
        self.seats: OrderedDict[str, tuple[int, list[int]]] = OrderedDict()  # request -> (seat, tokens fed)
        self.free = list(range(max_requests))

    def _forward(self, seat: int, slot: int, cached: int, tokens: list[int]) -> int:
        """Feed ``tokens`` at positions ``cached..`` of ``seat``'s blocks with KDA state in ``slot``; the
        argmax after the last one."""
        ctx = ForwardContext(cu_seqlens=torch.tensor([0, len(tokens)], device=self.device), cached_lens=[cached],
                             state_slots=torch.tensor([slot], device=self.device),
                             block_tables=self.tables[seat:seat + 1], caches=self.caches)
        with forward_context(ctx):
            hidden = self.model(torch.tensor(tokens, dtype=torch.long, device=self.device), ctx)
            return int(self.model.compute_logits(hidden[-1:]).argmax(-1))

    def _seat(self, key: str, token_ids: list[int]) -> tuple[int, int]:
        """(seat, tokens already fed) for ``key``, taking the least recently used seat when none is free."""
        if key in self.seats:
            seat, fed = self.seats.pop(key)
            if len(fed) < len(token_ids) and token_ids[:len(fed)] == fed:
                return seat, len(fed)
            return seat, 0  # the tokens changed under us: start over
        seat = self.free.pop() if self.free else self.seats.popitem(last=False)[1][0]
        return seat, 0

    def propose_for(self, req, k: int) -> list[int]:
        """Up to ``k`` drafts to follow ``req``'s tokens (``req``: an ``engine.request.Request``)."""
        return self.draft(req.request_id, req.token_ids, k)

    @torch.inference_mode()
    def draft(self, key: str, token_ids: list[int], k: int) -> list[int]:
        L = len(token_ids)
        k = min(k, self.capacity - L)
        if k <= 0 or L > self.max_len:
            return []
        seat, fed = self._seat(key, token_ids)
        drafts = [self._forward(seat, seat, fed, list(token_ids[fed:]))]
        self.seats[key] = (seat, list(token_ids))
        if k > 1:
            for cache in (*self.caches.kda_state.values(), *self.caches.kda_conv.values()):
                cache[self.scratch].copy_(cache[seat])
            for j in range(1, k):
                drafts.append(self._forward(seat, self.scratch, L + j - 1, drafts[-1:]))
        return drafts

    def release(self, key: str) -> None:
        if key in self.seats:
            self.free.append(self.seats.pop(key)[0])
