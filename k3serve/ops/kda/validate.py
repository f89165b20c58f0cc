"""Argument checks shared by the KDA ops; each failure is one ValueError naming the argument.

Prefill inputs: q, k, g `[B, T, H, K]`, v `[B, T, H, V]`, beta `[B, T, H]`, initial_state `[N, H, K, V]`
fp32, cu_seqlens `[N+1]` int (then B must be 1 and T holds N packed sequences; else N = B).
"""

from __future__ import annotations

import torch


def _shape(name: str, t: torch.Tensor, want: tuple[int, ...], what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != want:
        raise ValueError(f"{name} must have shape {what} = {list(want)}, got {list(t.shape)}")


def seq_bounds(cu_seqlens: torch.Tensor | None, batch: int, seqlen: int) -> list[tuple[int, int]]:
    """The (start, end) token range of every sequence on the flattened `[B*T]` token axis."""
    if cu_seqlens is None:
        return [(b * seqlen, (b + 1) * seqlen) for b in range(batch)]
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be a 1-D integer tensor [N+1] with N >= 1")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
    if batch != 1:
        raise ValueError(f"cu_seqlens needs batch size 1 (packed sequences), got B={batch}")
    cu = [int(x) for x in cu_seqlens.tolist()]
    if cu[0] != 0 or cu[-1] != seqlen or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must start at 0, never decrease and end at T={seqlen}, got {cu}")
    return list(zip(cu, cu[1:]))


def check_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
) -> list[tuple[int, int]]:
    """Validate a prefill call; return the per-sequence token ranges on the flattened token axis."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q must be a 4-D tensor [B, T, H, K], got {getattr(q, 'shape', type(q).__name__)}")
    B, T, H, K = q.shape
    _shape("k", k, (B, T, H, K), "[B, T, H, K]")
    _shape("g", g, (B, T, H, K), "[B, T, H, K]")
    if not isinstance(v, torch.Tensor) or v.dim() != 4 or tuple(v.shape[:3]) != (B, T, H):
        got = list(getattr(v, "shape", []))
        raise ValueError(f"v must have shape [B, T, H, V] with B, T, H = {B, T, H}, got {got}")
    _shape("beta", beta, (B, T, H), "[B, T, H]")
    check_log_decay(g)
    bounds = seq_bounds(cu_seqlens, B, T)
    check_state("initial_state", initial_state, (len(bounds), H, K, v.shape[-1]))
    return bounds


def check_log_decay(g: torch.Tensor) -> None:
    # A positive g would let the chunked form's exp(Gamma_r - Gamma_j) factors overflow.
    top = g.amax().item() if g.numel() else 0.0
    if top > 0:
        raise ValueError(f"g must be a log decay <= 0, got a maximum of {top:.3g}")


def check_state(name: str, state: torch.Tensor | None, want: tuple[int, ...]) -> None:
    if state is None:
        return
    _shape(name, state, want, "[N, H, K, V]")
    if state.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got {state.dtype}")


def default_scale(scale: float | None, head_dim: int) -> float:
    if scale is None:
        return head_dim**-0.5
    if not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale must be a positive number, got {scale!r}")
    return float(scale)
