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
    # One buffer [state_0, x_0, state_1, x_1, ...]: every sequence's window is then a contiguous run, so the
    # whole packed batch is W shifted multiply-adds.
    lens = torch.tensor([e - s for s, e in bounds], device=dev)
    starts = torch.tensor([s for s, _ in bounds], device=dev)
    seq_id = torch.repeat_interleave(torch.arange(N, device=dev), lens)
    x_pos = torch.arange(T, device=dev) + h * (seq_id + 1)
    hist = torch.arange(h, device=dev)
    state_pos = (starts + h * torch.arange(N, device=dev))[:, None] + hist
    buf = torch.empty(T + N * h, C, dtype=torch.float32, device=dev)
    buf[x_pos] = x.float()
    if conv_state is None:
        buf[state_pos.flatten()] = 0.0
    else:
        buf[state_pos.flatten()] = conv_state.float().transpose(1, 2).reshape(N * h, C)
    acc = buf[: buf.shape[0] - h] * w[:, 0]
    for j in range(1, W):
        acc.addcmul_(buf[j : buf.shape[0] - h + j], w[:, j])
    y = acc[x_pos - h]
    if activation == "silu":
        y = F.silu(y, inplace=True)
    ends = starts + lens
    new_pos = (ends + h * torch.arange(N, device=dev))[:, None] + hist
    state_dtype = conv_state.dtype if conv_state is not None else x.dtype
    new_state = buf[new_pos.flatten()].view(N, h, C).transpose(1, 2).to(state_dtype).contiguous()
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
