"""Routed-expert combine as two padded batched GEMMs (one per projection) instead of a loop over experts.

Tokens are sorted by expert and laid out as ``[E_hit, max_count, D]`` (zero-padded), multiplied by the hit
experts' stacked weights with ``bmm``, then scattered back with their routing weights. Shapes as in
``naive.py``. Padding costs ``E_hit · max_count`` rows, which stays close to ``N·k`` when routing is balanced.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def grouped_expert_combine(u: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                           w2: torch.Tensor,
                           glu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    N, k = ids.shape
    inter = w2.shape[-1]
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0])
    hit = counts.nonzero().squeeze(1)
    group = torch.repeat_interleave(torch.arange(hit.numel()), counts[hit])  # [N·k] group of each sorted slot
    starts = torch.cumsum(counts[hit], 0) - counts[hit]
    rank = torch.arange(flat.numel()) - starts[group]
    tokens = order // k
    x = u.new_zeros(hit.numel(), int(counts.max()), u.shape[1])
    x[group, rank] = u[tokens]
    h = torch.bmm(x, w13.index_select(0, hit).transpose(1, 2))
    y = torch.bmm(glu(h[..., :inter], h[..., inter:]), w2.index_select(0, hit).transpose(1, 2))
    out = torch.zeros(N, w2.shape[1], dtype=torch.float32)
    out.index_add_(0, tokens, y[group, rank].float() * weights.reshape(-1)[order, None].float())
    return out
