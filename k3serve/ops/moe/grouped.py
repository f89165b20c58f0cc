"""Routed-expert combine as two padded batched GEMMs (one per projection) instead of a loop over experts.

Tokens are sorted by expert and laid out as ``[E_hit, max_count, D]`` (zero-padded), multiplied by the hit
experts' stacked weights with ``bmm``; each (token, slot) result is put back in place and the k slots are
summed in slot order (no scatter-add). Shapes as in
``naive.py``. Padding costs ``E_hit · max_count`` rows, which stays close to ``N·k`` when routing is balanced.

Callers may pass ``w13_t`` / ``w2_t``: the same weights with the last two dims swapped and stored contiguous
(``[E, D, 2I]`` / ``[E, I, D]``). On one CPU core (MKL) a bmm against a contiguous right operand is faster
than against a transposed view at every width measured (E = 16, D = 128, I = 64: ~30% at 26 rows per expert,
~4% at 715) and gives bit-identical results, so they are used whenever given.

``mxfp4_expert_combine`` is the same with MXFP4-packed experts (``[E, rows, cols/2]`` codes + ``[E, rows,
cols/32]`` scales): only the experts the batch hits are dequantised, a bounded group of them at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from k3serve.ops.mx.quant import fp4_dequant_rows, mxfp8_fake_quant

Glu = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# Dequantised expert weights held at once by the MXFP4 combine (elements): 16 Mi fp32 = 64 MiB.
_DEQUANT_ELEMENTS = 1 << 24


class Layout(NamedTuple):
    hit: list[int]  # experts with at least one token, ascending
    width: int  # max tokens on one expert
    token_of_row: torch.Tensor  # [E_hit · width] token feeding each padded row (N = padding, a zero row)
    row_of: torch.Tensor  # [N · k] padded row holding assignment token·k + slot


def route_layout(ids: torch.Tensor, num_experts: int) -> Layout:
    N, k = ids.shape
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    all_counts = counts.tolist()
    hit = [e for e, c in enumerate(all_counts) if c]
    width = max(all_counts)
    # sorted assignment j on expert e (the g-th hit expert, whose run starts at start_e) sits at padded row
    # g·width + (j - start_e); the per-expert shift is computed as tensors, not in a Python loop over experts
    shift = ((counts > 0).cumsum(0) - 1) * width - (counts.cumsum(0) - counts)
    dest = torch.arange(flat.numel(), device=ids.device).add_(shift.index_select(0, flat.index_select(0, order)))
    token_of_row = torch.full((len(hit) * width,), N, dtype=torch.long, device=ids.device)
    token_of_row.index_copy_(0, dest, order.div(k, rounding_mode="floor"))
    row_of = torch.empty_like(dest).index_copy_(0, order, dest)
    return Layout(hit, width, token_of_row, row_of)


def _gemms(x: torch.Tensor, w13t: torch.Tensor, w2t: torch.Tensor, glu: Glu,
           act_quant: str | None = None) -> torch.Tensor:
    """x ``[G, width, D]`` through G experts given transposed weights (``[G, D, 2I]``, ``[G, I, D_out]``, any
    strides): ``W2 glu(W13 x)`` -> ``[G, width, D_out]``; each GEMM runs in the weights' dtype and its result
    is cast back to x's, as ``mxfp4_linear`` does."""
    inter = w2t.shape[1]
    h = torch.bmm(x.to(w13t.dtype), w13t).to(x.dtype)
    a = glu(h[..., :inter], h[..., inter:])
    if act_quant is not None:
        a = mxfp8_fake_quant(a, act_quant)
    return torch.bmm(a.to(w2t.dtype), w2t).to(x.dtype)


def _pack_tokens(u: torch.Tensor, lay: Layout) -> torch.Tensor:
    """u ``[N, D]`` -> ``[E_hit, width, D]``: each hit expert's tokens in a row run, zero padding after."""
    padded = torch.cat([u, u.new_zeros(1, u.shape[1])])
    return padded.index_select(0, lay.token_of_row).view(len(lay.hit), lay.width, -1)


def _combine(y: torch.Tensor, lay: Layout, weights: torch.Tensor) -> torch.Tensor:
    """Padded expert outputs ``[E_hit, width, D]`` -> ``Σ_k w_k y_k`` ``[N, D]`` fp32, slots summed in order."""
    N, k = weights.shape
    picked = y.reshape(-1, y.shape[-1]).index_select(0, lay.row_of).float()  # [N·k, D] in token, slot order
    picked.mul_(weights.reshape(-1, 1).float())
    return picked.view(N, k, -1).sum(1)


def grouped_expert_combine(u: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                           w2: torch.Tensor, glu: Glu, *, w13_t: torch.Tensor | None = None,
                           w2_t: torch.Tensor | None = None) -> torch.Tensor:
    lay = route_layout(ids, w13.shape[0])
    if w13_t is not None and w2_t is not None:
        w13t, w2t = w13_t, w2_t
    else:
        w13t, w2t = w13.transpose(1, 2), w2.transpose(1, 2)
    if len(lay.hit) < w13.shape[0]:
        hit = torch.tensor(lay.hit, device=w13.device)
        w13t, w2t = w13t.index_select(0, hit), w2t.index_select(0, hit)
    return _combine(_gemms(_pack_tokens(u, lay), w13t, w2t, glu), lay, weights)


def mxfp4_expert_combine(u: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13_packed: torch.Tensor,
                         w13_scale: torch.Tensor, w2_packed: torch.Tensor, w2_scale: torch.Tensor, glu: Glu, *,
                         act_quant: str | None = None) -> torch.Tensor:
    """As ``grouped_expert_combine`` with MXFP4 experts (what ``mxfp4_linear`` per expert computes): the GEMMs
    run in bfloat16 for bfloat16 ``u``, else float32; ``act_quant`` fake-quantises both GEMM inputs to MXFP8."""
    E, rows13, half_d = w13_packed.shape
    rows2, half_i = w2_packed.shape[1:]
    compute = torch.bfloat16 if u.dtype == torch.bfloat16 else torch.float32
    if act_quant is not None:  # row-wise blocks of 32: quantising u once equals quantising each gathered row
        u = mxfp8_fake_quant(u, act_quant)
    lay = route_layout(ids, E)
    x = _pack_tokens(u, lay)
    y = torch.empty(len(lay.hit), lay.width, rows2, dtype=u.dtype, device=u.device)
    group = max(1, _DEQUANT_ELEMENTS // (rows13 * half_d * 2 + rows2 * half_i * 2))
    for g0 in range(0, len(lay.hit), group):
        sel = torch.tensor(lay.hit[g0:g0 + group], device=w13_packed.device)
        n = sel.numel()
        w13 = fp4_dequant_rows(w13_packed.index_select(0, sel).view(n * rows13, half_d),
                               w13_scale.index_select(0, sel).view(n * rows13, -1), compute)
        w2 = fp4_dequant_rows(w2_packed.index_select(0, sel).view(n * rows2, half_i),
                              w2_scale.index_select(0, sel).view(n * rows2, -1), compute)
        y[g0:g0 + n] = _gemms(x[g0:g0 + n], w13.view(n, rows13, -1).transpose(1, 2),
                               w2.view(n, rows2, -1).transpose(1, 2), glu, act_quant)
    return _combine(y, lay, weights)
