"""Per-request logits processors: the engine's hook for constrained decoding, logit bias and the like.

A processor is attached to one request (``LLMEngine.add_request(..., logits_processor=proc)``) and lives
as long as the request. ``SamplingParams`` stays a plain value object; anything stateful goes here.

In every step in which the request samples a token, the model runner calls, in this order:
  1. ``prepare(output_token_ids)`` *before* the forward pass, with every token generated so far (the
     same list again after a preemption by recompute). Expensive work (a grammar's next-token mask) should
     be started here on another thread, so that it overlaps the forward pass.
  2. ``apply(logits)`` after the forward pass, just before sampling, with the request's row ``[V]`` of
     fp32 logits, to be edited in place (``-inf`` forbids a token). It runs before penalties, ``min_tokens``
     masking, temperature and top-k/p; it must leave at least one finite entry.

Steps that only compute prompt chunks call neither. Logprobs (sampled and top-k, and prompt logprobs) are
always those of the *raw* model distribution, before any processor, penalty or temperature: vLLM's default
``raw_logprobs`` mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class LogitsProcessor(Protocol):
    def prepare(self, output_token_ids: Sequence[int]) -> None:
        """Before the forward pass of a sampling step: catch up on new tokens, start the next mask."""

    def apply(self, logits: torch.Tensor) -> None:
        """Edit this request's fp32 logits row ``[V]`` in place, just before sampling."""
