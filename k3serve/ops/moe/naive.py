"""Routed-expert combine, naive reference: one token and one routed slot at a time.

u ``[N, D]``, weights / ids ``[N, k]``, w13 ``[E, 2I, D]`` (gate rows then up rows), w2 ``[E, D, I]``;
returns ``Σ_k w_k · W2_e glu(W1_e u, W3_e u)`` ``[N, D]`` in fp32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from k3serve.ops.mx.linear import mxfp4_linear


def naive_expert_combine(u: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                         w2: torch.Tensor, glu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *,
                         w13_t: torch.Tensor | None = None, w2_t: torch.Tensor | None = None) -> torch.Tensor:
    """``w13_t`` / ``w2_t`` (swapped weight copies that faster forms may use) are accepted and ignored."""
    inter = w2.shape[-1]
    out = torch.zeros(u.shape[0], w2.shape[1], dtype=torch.float32)
    for n in range(u.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[n, j])
            h = F.linear(u[n:n + 1], w13[e])
            y = F.linear(glu(h[:, :inter], h[:, inter:]), w2[e])
            out[n] += weights[n, j].float() * y[0].float()  # a tensor, so routing weights get gradients
    return out


def naive_mxfp4_expert_combine(u: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13_packed: torch.Tensor,
                               w13_scale: torch.Tensor, w2_packed: torch.Tensor, w2_scale: torch.Tensor,
                               glu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *,
                               act_quant: str | None = None) -> torch.Tensor:
    """The same per token with MXFP4 experts (``[E, rows, cols/2]`` codes, ``[E, rows, cols/32]`` scales), each
    projection one ``mxfp4_linear`` call (which applies ``act_quant`` to its input)."""
    inter = w2_packed.shape[-1] * 2
    out = torch.zeros(u.shape[0], w2_packed.shape[1], dtype=torch.float32)
    for n in range(u.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[n, j])
            h = mxfp4_linear(u[n:n + 1], w13_packed[e], w13_scale[e], act_quant=act_quant).to(u.dtype)
            a = glu(h[:, :inter], h[:, inter:])
            y = mxfp4_linear(a, w2_packed[e], w2_scale[e], act_quant=act_quant).to(u.dtype)
            out[n] += weights[n, j].float() * y[0].float()  # a tensor, so routing weights get gradients
    return out
