"""The scheduler's side of speculative decoding: how many drafts a decode row gets this step, and from where.

A decode row gets ``k = num_speculative_tokens`` drafts from the drafter, capped so that its window stays
inside the request's limits (``max_tokens``, ``max_model_len``) and the step's token budget. While more than ``max_running`` requests run,
speculation backs off to k = 0: large batches are compute-bound and drafts would only cost. A row with k = 0
still takes the verify path (``rollback.Rollback``); drafts are never a special case.
"""

from __future__ import annotations

from k3serve.engine.request import Request
from k3serve.engine.spec.config import SpeculativeConfig
from k3serve.engine.spec.drafters import make_drafter


class Speculator:
    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.drafter = make_drafter(config.method, prompt_lookup_min=config.prompt_lookup_min,
                                    prompt_lookup_max=config.prompt_lookup_max)
        self.num_backoff_steps = 0  # steps in which the batch size turned speculation off

    def limit(self, req: Request, budget: int, num_running: int) -> int:
        """The most drafts ``req`` (a decode row) may get now."""
        k = self.config.num_speculative_tokens
        if k == 0:
            return 0
        if num_running > self.config.max_running:
            return 0
        # the window appends up to k + 1 tokens: all must fit max_tokens and max_model_len
        k = min(k, req.max_tokens - req.num_output_tokens - 1, req.max_model_len - req.num_tokens - 1, budget - 1)
        return max(k, 0)

    def propose(self, req: Request, k: int) -> list[int]:
        return self.drafter.propose(req.token_ids, k)[:k] if k > 0 else []
