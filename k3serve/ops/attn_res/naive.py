"""The Block Attention Residuals mix, token by token in Python floats: the reference for ``mix.py``.

Sources ``V = [*blocks, partial]``, each ``[N, d]``; query ``q = norm_weight ⊙ proj_weight`` ``[d]``. For each
token t:  k_s = V_s[t] / sqrt(mean(V_s[t]²) + eps);  p = softmax_s(k_s · q);  out[t] = Σ_s p_s V_s[t]
in the partial sum's dtype. Without completed blocks the mix is the partial sum itself.
"""

from __future__ import annotations

import math

import torch


def naive_attn_res_mix(blocks: list[torch.Tensor], partial: torch.Tensor, proj_weight: torch.Tensor,
                       norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not blocks:
        return partial
    sources = [s.float() for s in (*blocks, partial)]
    q = [a * b for a, b in zip(norm_weight.float().tolist(), proj_weight.float().reshape(-1).tolist())]
    out = []
    for t in range(partial.shape[0]):
        rows = [s[t].tolist() for s in sources]
        scores = [sum(v * w for v, w in zip(r, q)) / math.sqrt(sum(v * v for v in r) / len(r) + eps) for r in rows]
        top = max(scores)
        e = [math.exp(x - top) for x in scores]
        p = [x / sum(e) for x in e]
        out.append([sum(pi * r[i] for pi, r in zip(p, rows)) for i in range(len(q))])
    return torch.tensor(out, dtype=torch.float32).reshape(partial.shape).to(partial.dtype)
