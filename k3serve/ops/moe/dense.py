"""Routed-expert combine that runs every expert on every token: for small batches (decode steps).

Shapes as in ``naive.py``: u ``[N, D]``, weights / ids ``[N, k]``, w13 ``[E, 2I, D]``, w2 ``[E, D, I]``.
  h = u · [W13_0 | .. | W13_E-1]ᵀ        one GEMM over the stacked experts  ``[N, E, 2I]``
  a_e = c_e · glu(h_e)                    c_e = the token's routing weight for e, 0 for experts it did not pick
  out = Σ_e a_e · W2_eᵀ                   one bmm over experts, then a sum over them  ``[N, D]`` fp32
E/k times the FLOPs of the routed work, but two well-shaped GEMMs and no routing layout: with a few dozen
tokens the grouped form's padding, index bookkeeping and per-op overhead cost more than the extra FLOPs.
``expert_combine`` picks this form up to DENSE_MAX_ROWS token-expert rows, the padded grouped one above, and
from SEGMENTED_MIN_TOKENS tokens on the per-expert segmented one (``segmented.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3serve.ops.moe.grouped import Glu, grouped_expert_combine
from k3serve.ops.moe.segmented import segmented_expert_combine

# Token x expert rows (N·E) up to which the dense form is used: on one CPU core with E = 16, k = 4, D = 128,
# I = 64 it is ~1.5x faster at 8 tokens and breaks even near 32.
DENSE_MAX_ROWS = 384
# Tokens from which the unpadded per-expert GEMMs beat the padded bmm (same setting: even near 256, ~1.3x
# at 1024, 2-3x at 2048, where padding and its copies dominate).
SEGMENTED_MIN_TOKENS = 256


def dense_expert_combine(u: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                         w2: torch.Tensor, glu: Glu) -> torch.Tensor:
    N, D = u.shape
    E, two_i, _ = w13.shape
    inter = two_i // 2
    # each GEMM runs in the weights' dtype with its result cast back to u's, as in the grouped form
    h = F.linear(u.to(w13.dtype), w13.reshape(E * two_i, D)).view(N, E, two_i).to(u.dtype)
    coef = torch.zeros(N, E, 1, dtype=torch.float32, device=u.device).scatter_(1, ids[..., None],
                                                                                weights[..., None].float())
    a = glu(h[..., :inter], h[..., inter:]).float() * coef
    # experts a token did not pick contribute exactly 0 (also if their activation overflowed: inf·0 is NaN)
    a.masked_fill_(coef == 0, 0.0)
    y = torch.bmm(a.transpose(0, 1).to(w2.dtype), w2.transpose(1, 2))  # [E, N, D]
    return y.float().sum(0)


def expert_combine(u: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                   w2: torch.Tensor, glu: Glu, *, w13_t: torch.Tensor | None = None,
                   w2_t: torch.Tensor | None = None) -> torch.Tensor:
    """The dense form for small batches, the grouped (padded bmm) form for mid-sized ones and the segmented
    (per-expert GEMM) form for large ones; both of those may use the optional swapped weight copies."""
    if u.shape[0] * w13.shape[0] <= DENSE_MAX_ROWS:
        return dense_expert_combine(u, weights, ids, w13, w2, glu)
    if u.shape[0] >= SEGMENTED_MIN_TOKENS:
        return segmented_expert_combine(u, weights, ids, w13, w2, glu, w13_t=w13_t, w2_t=w2_t)
    return grouped_expert_combine(u, weights, ids, w13, w2, glu, w13_t=w13_t, w2_t=w2_t)
