"""Argument checks shared by the short-conv ops; each failure is one ValueError naming the argument."""

from __future__ import annotations

import torch

ACTIVATIONS = ("silu", None)


def conv_weight(weight: torch.Tensor, channels: int) -> torch.Tensor:
    """`[C, W]` or the checkpoint's nn.Conv1d layout `[C, 1, W]` -> fp32 `[C, W]`, W >= 1."""
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight[:, 0]
    if weight.dim() != 2 or weight.shape[0] != channels or weight.shape[1] < 1:
        raise ValueError(f"weight must have shape [C, W] or [C, 1, W] with C = {channels}, got {list(weight.shape)}")
    return weight.float()


def check_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    activation: str | None,
) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Validate a packed prefill call; return the fp32 `[C, W]` weight and each sequence's token range."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D tensor [T_total, C], got {getattr(x, 'shape', type(x).__name__)}")
    T, C = x.shape
    w = conv_weight(weight, C)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    if cu_seqlens is None:
        bounds = [(0, T)]
    else:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens must be a 1-D integer tensor [N+1] with N >= 1")
        if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or cu_seqlens.dtype == torch.bool:
            raise ValueError(f"cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
        cu = [int(c) for c in cu_seqlens.tolist()]
        if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens must start at 0, never decrease and end at T_total={T}, got {cu}")
        bounds = list(zip(cu, cu[1:]))
    want = (len(bounds), C, w.shape[1] - 1)
    if conv_state is not None and (not isinstance(conv_state, torch.Tensor) or tuple(conv_state.shape) != want):
        got = list(getattr(conv_state, "shape", []))
        raise ValueError(f"conv_state must have shape [N, C, W-1] = {list(want)}, got {got}")
    return w, bounds
