"""Block Attention Residuals (K3) mix, torch form (spec: ``naive.py``): depth-wise softmax over completed
blocks and the running partial sum.

Sources ``V = [b_0 (embedding), b_1, …, b_n, partial]``, each ``[N, d]``; with a learned pseudo-query
``w = norm.weight ⊙ proj.weight`` ``[d]`` (the norm weight folded into the query):
  k_i = V_i / sqrt(mean(V_i²) + eps);  p = softmax_i(k_i · w);  mix = Σ_i p_i V_i
all in fp32, cast back to the sources' dtype. Sources themselves are never normalised.
"""

from __future__ import annotations

import torch


def attn_res_mix(blocks: list[torch.Tensor], partial: torch.Tensor, proj_weight: torch.Tensor,
                 norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Mix ``blocks + [partial]`` (each ``[N, d]``) with the query ``proj_weight [1, d] ⊙ norm_weight [d]``."""
    if not blocks:
        return partial
    v = torch.stack([*blocks, partial]).float()  # [S, N, d]
    k = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    query = norm_weight.float() * proj_weight.float().reshape(-1)
    p = torch.softmax((k * query).sum(-1), dim=0)  # [S, N]
    return (p.unsqueeze(-1) * v).sum(0).to(partial.dtype)
