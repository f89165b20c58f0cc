"""A minimal stateful runner over a model's own caches: the system-level reference for the engine.

Each sequence gets one KDA slot and a contiguous run of MLA blocks; ``step`` feeds any mix of new tokens
(prefill chunks or single decode tokens) as one packed batch and returns the last-position logits of each
sequence. ``greedy_generate`` is the naive generate loop built on it.
"""

from __future__ import annotations

import torch
from torch import nn

from k3serve.core.context import ForwardContext, forward_context
from k3serve.models.cache import allocate_caches, cache_spec


class SimpleRunner:
    def __init__(self, model: nn.Module, *, max_seqs: int, max_len: int, block_size: int = 16,
                 dtype: torch.dtype = torch.float32):
        self.model = model
        self.block_size = block_size
        self.blocks_per_seq = (max_len + block_size - 1) // block_size
        spec = cache_spec(model, dtype)
        self.caches = allocate_caches(spec, num_blocks=max_seqs * self.blocks_per_seq, block_size=block_size,
                                      num_slots=max_seqs)
        self.max_len = max_len
        self.lens: dict[int, int] = {}  # seq id (== slot) -> tokens cached

    def step(self, new_tokens: dict[int, list[int]], image_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Feed ``{seq_id: tokens}``; returns fp32 logits ``[len(new_tokens), vocab]`` in dict order."""
        ids = list(new_tokens)
        cached = [self.lens.get(i, 0) for i in ids]
        for i, c in zip(ids, cached):
            if c + len(new_tokens[i]) > self.max_len:
                raise ValueError(f"sequence {i} would exceed max_len={self.max_len}")
        lens = torch.tensor([0] + [len(new_tokens[i]) for i in ids])
        tables = torch.stack([torch.arange(self.blocks_per_seq) + i * self.blocks_per_seq for i in ids])
        ctx = ForwardContext(cu_seqlens=lens.cumsum(0), cached_lens=cached, state_slots=torch.tensor(ids),
                             block_tables=tables, caches=self.caches)
        input_ids = torch.tensor([t for i in ids for t in new_tokens[i]], dtype=torch.long)
        with torch.inference_mode(), forward_context(ctx):
            kwargs = {"image_embeds": image_embeds} if image_embeds is not None else {}
            hidden = self.model(input_ids, ctx, **kwargs)
            logits = self.model.compute_logits(hidden[ctx.last_token_indices])
        for i in ids:
            self.lens[i] = self.lens.get(i, 0) + len(new_tokens[i])
        return logits

    def release(self, seq_id: int) -> None:
        self.lens.pop(seq_id, None)


def greedy_generate(model: nn.Module, prompts: list[list[int]], max_new_tokens: int,
                    eos_ids: tuple[int, ...] = ()) -> list[list[int]]:
    runner = SimpleRunner(model, max_seqs=len(prompts), max_len=max(map(len, prompts)) + max_new_tokens)
    logits = runner.step({i: p for i, p in enumerate(prompts)})
    outs: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    for _ in range(max_new_tokens):
        nxt = logits.argmax(-1).tolist()
        for i, t in zip(live, nxt):
            outs[i].append(t)
        live = [i for i, t in zip(live, nxt) if t not in eos_ids]
        if not live or len(outs[live[0]]) >= max_new_tokens:
            break
        logits = runner.step({i: [outs[i][-1]] for i in live})
    return outs
