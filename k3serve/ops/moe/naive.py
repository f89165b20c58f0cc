"""Routed-expert combine, naive reference: one expert at a time over the tokens routed to it.

u ``[N, D]``, weights / ids ``[N, k]``, w13 ``[E, 2I, D]`` (gate rows then up rows), w2 ``[E, D, I]``;
returns ``Σ_k w_k · W2_e glu(W1_e u, W3_e u)`` ``[N, D]`` in fp32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def naive_expert_combine(u: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                         w2: torch.Tensor, glu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    inter = w2.shape[-1]
    out = torch.zeros(u.shape[0], w2.shape[1], dtype=torch.float32)
    for n in range(u.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[n, j])
            h = F.linear(u[n:n + 1], w13[e])
            y = F.linear(glu(h[:, :inter], h[:, inter:]), w2[e])
            out[n] += float(weights[n, j]) * y[0].float()
    return out
