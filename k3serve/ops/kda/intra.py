"""In-chunk decay products for `chunk_kda`, built from matmuls without exponentiating a positive sum.

Inputs are chunks `[M, C, K]` fp32 (M = chunks x heads) of q (already scaled), k and the log decay
g <= 0; Gamma is the in-chunk cumsum of g. `intra_chunk` returns `Intra`:
  a_q `[M, C, C]`  sum_c q_r k_j exp(Gamma_r - Gamma_j) for j <= r, else 0
  a_k `[M, C, C]`  sum_c k_r k_j exp(Gamma_r - Gamma_j) for j < r, else 0
  q_decay, k_decay, k_suffix `[M, C, K]`: q exp(Gamma), k exp(Gamma), k exp(Gamma_C - Gamma)
  chunk_decay `[M, K]`: exp(Gamma_C)

Every decay factor that multiplies only factors <= 1 is floored at exp(-FLOOR). A product that small is
below fp32 resolution of anything it is added to (the error is at most e^-35 ~ 6e-16 of the undecayed
term), and the floor keeps exp's underflow path and denormal operands, each tens of times slower on
CPU, out of every kernel.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FLOOR = 35.0
# Diagonal blocks use one midpoint reference (factors within exp(+-FLOOR)); they are the widest of
# DIAG_BLOCK, 2 * DIAG_BLOCK, ..., C tokens in which every block decays by at most 2 * FLOOR (single
# tokens if even DIAG_BLOCK is too wide). The halving recursion pairs everything across blocks.
DIAG_BLOCK = 8


class Intra(NamedTuple):
    a_q: torch.Tensor
    a_k: torch.Tensor
    q_decay: torch.Tensor
    k_decay: torch.Tensor
    k_suffix: torch.Tensor
    chunk_decay: torch.Tensor


def _decay(exponent: torch.Tensor) -> torch.Tensor:
    """exp(max(x, -FLOOR)) for an exponent x <= 0 (a new tensor)."""
    return exponent.clamp(min=-FLOOR).exp_()


def _diag_width(g: torch.Tensor) -> int:
    """Widest power-of-two block (DIAG_BLOCK..C) in which no block decays past -2 FLOOR; 1 if none."""
    M, C, K = g.shape
    sb = min(DIAG_BLOCK, C)
    totals = g.view(M, C // sb, sb, K).sum(2)
    if sb == 1 or not bool((totals >= -2 * FLOOR).all()):
        return 1
    while 2 * sb <= C:
        totals = totals.view(M, -1, 2, K).sum(2)
        if not bool((totals >= -2 * FLOOR).all()):
            break
        sb *= 2
    return sb


def intra_chunk(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor) -> Intra:
    """Rows r and columns j < r in different diagonal blocks are paired by halving the chunk: at the level
    where r falls in the second half of a 2s-block and j in the first, with m the last position of the
    first half, exp(Gamma_r - Gamma_j) = exp(Gamma_r - Gamma_m) exp(Gamma_m - Gamma_j), both exponents
    <= 0. Each level is one batched matmul. The prefix P (from the start of r's s-block) and exclusive
    suffix S (to the end of j's s-block) grow level by level by adding same-signed block totals, so they
    stay accurate relative to themselves, which a difference of two long prefix sums would not.
    """
    M, C, K = q.shape
    sb = _diag_width(g)
    if sb > 1:
        blocks = g.view(M, C // sb, sb, K).cumsum(2)
        suffix = (blocks[:, :, -1:] - blocks).view(M, C, K)
        prefix = blocks.view(M, C, K)
        a_q, a_k = _diag_blocks(q.view(M, C // sb, sb, K), k.view(M, C // sb, sb, K), blocks)
    else:
        prefix, suffix = g.clone(), torch.zeros_like(g)
        a_q = torch.zeros(M, C, C, dtype=q.dtype, device=q.device)
        a_k = torch.zeros_like(a_q)
        a_q.diagonal(dim1=-2, dim2=-1).copy_((q * k).sum(-1))
    s = sb
    while s < C:
        n = C // (2 * s)
        row_f = _decay(prefix.view(M, n, 2, s, K)[:, :, 1])
        rows = torch.empty(M, n, 2 * s, K, dtype=q.dtype, device=q.device)
        torch.mul(q.view(M, n, 2, s, K)[:, :, 1], row_f, out=rows[:, :, :s])
        torch.mul(k.view(M, n, 2, s, K)[:, :, 1], row_f, out=rows[:, :, s:])
        cols = k.view(M, n, 2, s, K)[:, :, 0] * _decay(suffix.view(M, n, 2, s, K)[:, :, 0])
        prod = rows @ cols.mT
        for dst, part in ((a_q, prod[:, :, :s]), (a_k, prod[:, :, s:])):
            diag = dst.view(M, n, 2 * s, n, 2 * s).diagonal(dim1=1, dim2=3)
            diag[:, s:, :s].copy_(part.permute(0, 2, 3, 1))
        _grow(prefix, suffix, s)
        s *= 2
    gamma_decay = _decay(prefix)
    return Intra(a_q, a_k, q * gamma_decay, k * gamma_decay, k * _decay(suffix), _decay(prefix[:, -1]))


def _grow(prefix: torch.Tensor, suffix: torch.Tensor, s: int) -> None:
    """In place, `[M, C, K]`: prefix/suffix within s-blocks become prefix/suffix within 2s-blocks."""
    M, C, K = prefix.shape
    pre, suf = prefix.view(M, C // (2 * s), 2, s, K), suffix.view(M, C // (2 * s), 2, s, K)
    second_total = pre[:, :, 1, -1:].clone()
    pre[:, :, 1] += pre[:, :, 0, -1:]
    suf[:, :, 0] += second_total


def _diag_blocks(q: torch.Tensor, k: torch.Tensor, prefix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, prefix (in-block cumsum of g) `[M, nb, sb, K]`, every block decaying by at most 2 FLOOR.

    Returns a_q, a_k `[M, C, C]` holding only the diagonal `[sb, sb]` blocks, split at each block's
    half-decay h: exp(P_r - P_j) = exp(P_r - h) exp(h - P_j), both factors within exp(+-FLOOR).
    """
    M, nb, sb, K = q.shape
    e = (prefix - 0.5 * prefix[:, :, -1:]).exp_()
    rows = torch.empty(M, nb, 2 * sb, K, dtype=q.dtype, device=q.device)
    torch.mul(q, e, out=rows[:, :, :sb])
    torch.mul(k, e, out=rows[:, :, sb:])
    prod = rows @ (k / e).mT
    # Entries above the diagonal pair j > r (exponent up to +2 FLOOR, finite); tril drops them.
    if nb == 1:
        return prod[:, 0, :sb].tril(), prod[:, 0, sb:].tril(-1)
    out = []
    for part, diagonal in ((prod[:, :, :sb], 0), (prod[:, :, sb:], -1)):
        full = torch.zeros(M, nb * sb, nb * sb, dtype=q.dtype, device=q.device)
        full.view(M, nb, sb, nb, sb).diagonal(dim1=1, dim2=3).copy_(part.tril(diagonal).permute(0, 2, 3, 1))
        out.append(full)
    return out[0], out[1]
