"""Routed-expert combine for a handful of tokens with no host-side counts: the static decode step's form.

Shapes as in ``naive.py``: u ``[N, D]``, weights / ids ``[N, k]``, w13 ``[E, 2I, D]``, w2 ``[E, D, I]``.
Each (token, slot) pair gathers its own expert's weights, so the work is exactly the routed work and every
shape is fixed by ``N`` and ``k`` alone (no per-expert counts read back, no sort, no grouping):
  W13_j = w13[ids_j], W2_j = w2[ids_j]       ``[N·k, 2I, D]`` / ``[N·k, D, I]`` (index_select on the device)
  h_j = W13_j u_{token(j)};  a_j = glu(h_j);  y_j = W2_j a_j     two batched matrix-vector products
  out_n = Σ_slot w_{n,slot} · y_{n,slot}       ``[N, D]`` fp32
The gather moves N·k experts' weights per layer: meant for decode buckets (tens of tokens), where the grouped
and segmented forms need counts on the host. MXFP4 experts gather their codes and scales and dequantise only
those (``fp4_dequant_rows`` is a table gather); ``act_quant`` fake-quantises u as ``mxfp4_linear`` does.
"""

from __future__ import annotations

import torch

from k3serve.ops.moe.grouped import Glu
from k3serve.ops.mx.quant import fp4_dequant_rows, mxfp8_fake_quant


def _pairs(u: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert id per (token, slot) pair ``[N·k]``, that token's input ``[N·k, D]``)."""
    N, k = ids.shape
    return ids.reshape(-1), u[:, None, :].expand(N, k, u.shape[1]).reshape(N * k, u.shape[1])


def _weighted_sum(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    N, k = weights.shape
    return (y.float() * weights.reshape(-1, 1).float()).view(N, k, -1).sum(1)


def gathered_expert_combine(u: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                            w2: torch.Tensor, glu: Glu, **_: object) -> torch.Tensor:
    """Dense experts; the optional swapped copies the other forms take are ignored."""
    inter = w2.shape[-1]
    flat, x = _pairs(u, ids)
    # each GEMM in the weights' dtype with its result cast back to u's, as in the other forms
    h = torch.bmm(w13.index_select(0, flat), x.to(w13.dtype)[..., None])[..., 0].to(u.dtype)
    a = glu(h[:, :inter], h[:, inter:])
    y = torch.bmm(w2.index_select(0, flat), a.to(w2.dtype)[..., None])[..., 0]
    return _weighted_sum(y, weights)


def _dequant(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered codes ``[n, rows, cols/2]`` and scales ``[n, rows, cols/32]`` -> ``[n, rows, cols]``."""
    n, rows, half = packed.shape
    return fp4_dequant_rows(packed.reshape(n * rows, half), scale.reshape(n * rows, -1), dtype).view(n, rows, 2 * half)


def gathered_mxfp4_expert_combine(u: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                                  w13_packed: torch.Tensor, w13_scale: torch.Tensor, w2_packed: torch.Tensor,
                                  w2_scale: torch.Tensor, glu: Glu, *, act_quant: str | None = None) -> torch.Tensor:
    inter = w2_packed.shape[-1] * 2
    flat, x = _pairs(u, ids)
    # as mxfp4_linear: bfloat16 inputs compute in bfloat16, others in float32 (both hold the weights exactly)
    compute = torch.bfloat16 if u.dtype == torch.bfloat16 else torch.float32
    if act_quant is not None:
        x = mxfp8_fake_quant(x, act_quant)
    w13 = _dequant(w13_packed.index_select(0, flat), w13_scale.index_select(0, flat), compute)
    h = torch.bmm(w13, x.to(compute)[..., None])[..., 0].to(u.dtype)
    a = glu(h[:, :inter], h[:, inter:])
    if act_quant is not None:
        a = mxfp8_fake_quant(a, act_quant)
    w2 = _dequant(w2_packed.index_select(0, flat), w2_scale.index_select(0, flat), compute)
    y = torch.bmm(w2, a.to(compute)[..., None])[..., 0].to(u.dtype)
    return _weighted_sum(y, weights)
