"""Depthwise causal short convolution, token by token: the reference for `conv.py`.

Per channel c and token t of one sequence, with kernel width W and `window` = the W-1 previous inputs
(from conv_state at the sequence start, zeros for a fresh sequence) followed by x_t:
    y_t[c] = act( sum_{j<W} weight[c, j] * window[j][c] ),   weight[c, W-1] multiplies x_t.
x `[T_total, C]` packs N sequences along tokens (cu_seqlens `[N+1]`, or one sequence when None); weight
`[C, W]` or `[C, 1, W]`; conv_state `[N, C, W-1]` holds the last W-1 pre-conv inputs of each sequence.
Returns y `[T_total, C]` in x's dtype and the new conv_state `[N, C, W-1]` (conv_state's dtype, else x's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3serve.ops.short_conv.validate import check_conv


def naive_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    conv_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    w, bounds = check_conv(x, weight, conv_state, cu_seqlens, activation)
    C, W = w.shape
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    new_state = torch.empty(len(bounds), C, W - 1, dtype=torch.float32, device=x.device)
    for n, (start, end) in enumerate(bounds):
        window = [torch.zeros(C, dtype=torch.float32, device=x.device) for _ in range(W - 1)]
        if conv_state is not None:
            window = [conv_state[n, :, j].float() for j in range(W - 1)]
        for t in range(start, end):
            window.append(x[t].float())
            acc = sum(w[:, j] * window[j] for j in range(W))
            y[t] = F.silu(acc) if activation == "silu" else acc
            window.pop(0)
        for j in range(W - 1):
            new_state[n, :, j] = window[j]
    out_dtype = conv_state.dtype if conv_state is not None else x.dtype
    return y.to(x.dtype), new_state.to(out_dtype)


def naive_causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    *,
    activation: str | None = "silu",
    out_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token per sequence (x ``[N, C]``): the recurrence above over N one-token sequences; the new
    state is written into ``out_state`` when given."""
    cu = torch.arange(x.shape[0] + 1)
    y, new_state = naive_causal_conv1d(x, weight, conv_state=conv_state, cu_seqlens=cu, activation=activation)
    if out_state is not None:
        new_state = out_state.copy_(new_state)
    return y, new_state
