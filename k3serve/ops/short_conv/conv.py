"""Depthwise causal short convolution, vectorised over packed sequences, plus its one-token decode step.

`causal_conv1d`: x `[T_total, C]` packing N sequences (cu_seqlens `[N+1]`, or one sequence when None),
weight `[C, W]` or `[C, 1, W]` (weight[c, W-1] multiplies the current token), conv_state `[N, C, W-1]` =
each sequence's last W-1 pre-conv inputs (None = zeros, a fresh sequence). Returns y `[T_total, C]` in x's
dtype, after SiLU when activation="silu", and the new conv_state `[N, C, W-1]`: the last W-1 inputs of
each sequence, older state shifted in when a sequence is shorter than W-1.

`causal_conv1d_update`: one token per sequence, x `[N, C]`, same weight and conv_state.
Both compute in fp32; the state keeps conv_state's dtype (x's when conv_state is None).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3serve.ops.short_conv.validate import ACTIVATIONS, check_conv, conv_weight


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    conv_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    w, bounds = check_conv(x, weight, conv_state, cu_seqlens, activation)
    T, C = x.shape
    W, N, dev = w.shape[1], len(bounds), x.device
    h = W - 1
    xf = x.float()
    starts = torch.tensor([s for s, _ in bounds], device=dev)
    lens = torch.tensor([e - s for s, e in bounds], device=dev)
    state = (torch.zeros(N * h, C, device=dev) if conv_state is None
             else conv_state.float().transpose(1, 2).reshape(N * h, C))

    def window(q: torch.Tensor) -> torch.Tensor:
        """Rows at positions q ``[N, m]`` of each sequence's [state_i (h rows), x_i] -> ``[N, m, C]``."""
        from_x = xf.index_select(0, (starts[:, None] + q - h).clamp(0, T - 1).flatten())
        from_state = state.index_select(0, (torch.arange(N, device=dev)[:, None] * h + q.clamp(max=h - 1)).flatten())
        return torch.where((q < h).flatten()[:, None], from_state, from_x).view(*q.shape, C)

    # An output row at least h rows into its sequence reads only that sequence's inputs, so W shifted
    # multiply-adds over the packed x give every such row (no copy of x into a padded buffer). The first h
    # rows of each sequence, which read its state, are redone on small [state_i, x_i[:h]] windows and put
    # back; the products are summed in the same order either way, so the result does not depend on which.
    acc = torch.empty(T, C, dtype=torch.float32, device=dev)
    if T > h:
        if torch.is_grad_enabled():  # out= is not recorded by autograd: copy, then multiply in place
            acc[h:].copy_(xf[: T - h]).mul_(w[:, 0])
        else:
            torch.mul(xf[: T - h], w[:, 0], out=acc[h:])
        for j in range(1, W):
            acc[h:].addcmul_(xf[j: T - h + j], w[:, j])
    head = window(torch.arange(2 * h, device=dev).expand(N, 2 * h))
    head_acc = head[:, :h] * w[:, 0]
    for j in range(1, W):
        head_acc.addcmul_(head[:, j: j + h], w[:, j])
    r = torch.arange(h, device=dev)
    inside = (r < lens[:, None]).flatten()  # sequences shorter than h have fewer head rows
    acc.index_copy_(0, (starts[:, None] + r).flatten()[inside], head_acc.view(N * h, C)[inside])
    y = F.silu(acc, inplace=True) if activation == "silu" else acc
    state_dtype = conv_state.dtype if conv_state is not None else x.dtype
    # the new state: the last h rows of [state_i, x_i], older state shifted in for short sequences
    new_state = window(lens[:, None] + r).transpose(1, 2).to(state_dtype).contiguous()
    return y.to(x.dtype), new_state


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    *,
    activation: str | None = "silu",
    out_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token per sequence: x `[N, C]`; returns y `[N, C]` and the shifted state
    `[N, C, W-1]`, written into `out_state` when given (it may be `conv_state` itself)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D tensor [N, C], got {getattr(x, 'shape', type(x).__name__)}")
    N, C = x.shape
    w = conv_weight(weight, C)
    h = w.shape[1] - 1
    if not isinstance(conv_state, torch.Tensor) or tuple(conv_state.shape) != (N, C, h):
        got = list(getattr(conv_state, "shape", []))
        raise ValueError(f"conv_state must have shape [N, C, W-1] = {[N, C, h]}, got {got}")
    if out_state is not None and (not isinstance(out_state, torch.Tensor) or out_state.shape != conv_state.shape):
        raise ValueError(f"out_state must have shape [N, C, W-1] = {[N, C, h]}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    xf, st = x.float(), conv_state.float()
    # W multiply-adds over [N, C] (a sum over the tiny last dim of the state is several times slower)
    acc = st[:, :, 0] * w[:, 0] if h else torch.zeros_like(xf)
    for j in range(1, h):
        acc.addcmul_(st[:, :, j], w[:, j])
    acc.addcmul_(xf, w[:, h])
    y = F.silu(acc, inplace=True) if activation == "silu" else acc
    new_state = torch.cat([conv_state[:, :, 1:], x[:, :, None].to(conv_state.dtype)], -1)
    if out_state is None:
        return y.to(x.dtype), new_state
    out_state.copy_(new_state)
    return y.to(x.dtype), out_state
