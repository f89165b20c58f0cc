"""The packed causal short convolution with a hand-written backward, registered as backend "train" of op
"short_conv" (same arguments and results as ``ops/short_conv/conv.py``; x ``[T, C]``, weight ``[C, W]``,
conv_state ``[N, C, W-1]``, cu_seqlens ``[N+1]``).

Each sequence is laid out after its own W-1 state rows in one padded buffer ``P [T + N(W-1), C]``, so every
output row reads only its own segment and no sequence boundary needs fixing up:
  acc[t] = sum_j w[:, j] P[p(t) - (W-1) + j]      (p(t): the padded row of token t)     y = silu(acc)
  backward, with ga = dy silu'(acc) scattered to the padded rows (0 on state rows):
  dP[r] = sum_j w[:, j] ga[r + (W-1) - j]      dx = dP[p(t)]      dw[:, j] = sum_r ga[r] P[r - (W-1) + j]
The forward sums in the serving form's order (same bits). Autograd through the serving form's shifted
slices costs a zero-filled full-size gradient per slice: in a training step its backward ran ~8x its
forward. The state gets no gradient (training sequences start from zeros).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3serve.ops import registry
from k3serve.ops.short_conv.validate import check_conv


def _padded_rows(bounds: list[tuple[int, int]], h: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded rows (sequence after sequence, each after its h state rows) of every token ``[T]``, of every
    state row ``[N * h]`` and of each segment's last h rows ``[N * h]`` (its new state: older state shifted in
    for sequences shorter than h)."""
    tokens, states, lasts, off = [], [], [], 0
    for s, e in bounds:
        end = off + h + e - s
        states.append(torch.arange(off, off + h))
        tokens.append(torch.arange(off + h, end))
        lasts.append(torch.arange(end - h, end))
        off = end
    return torch.cat(tokens), torch.cat(states), torch.cat(lasts)


class _PackedConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, state: torch.Tensor, rows: torch.Tensor,
                state_rows: torch.Tensor, silu: bool) -> tuple[torch.Tensor, torch.Tensor]:
        T, C = x.shape
        W = w.shape[1]
        h = W - 1
        padded = x.new_empty(T + state_rows.numel(), C)
        padded.index_copy_(0, rows, x).index_copy_(0, state_rows, state.transpose(1, 2).reshape(-1, C))
        L = padded.shape[0] - h  # outputs over every padded row that has h rows before it
        acc_all = torch.mul(padded[:L], w[:, 0])
        for j in range(1, W):
            acc_all.addcmul_(padded[j:L + j], w[:, j])
        acc = acc_all.index_select(0, rows - h)
        y = F.silu(acc) if silu else acc
        ctx.save_for_backward(padded, w, acc, rows, state_rows)
        ctx.silu, ctx.h = silu, h
        ctx.mark_non_differentiable(padded)
        return y, padded

    @staticmethod
    def backward(ctx, dy: torch.Tensor, _dpadded: torch.Tensor):
        padded, w, acc, rows, state_rows = ctx.saved_tensors
        h = ctx.h
        # Every pass over a [T, C] tensor counts (a training step is memory-bound here): the fused SiLU
        # gradient, and no zero fill where the rows are written anyway.
        if ctx.silu:
            dy = torch.ops.aten.silu_backward(dy, acc)
        L = padded.shape[0] - h
        ga = dy.new_empty(L, dy.shape[1]).index_copy_(0, rows - h, dy)
        # outputs at the later segments' state rows feed nothing (the first segment's precede every output)
        ga.index_fill_(0, state_rows[h:] - h, 0.0)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dpad = dy.new_empty(padded.shape)
            dpad[:h].zero_()
            torch.mul(ga, w[:, h], out=dpad[h:])
            for j in range(h):
                dpad[j:L + j].addcmul_(ga, w[:, j])
            dx = dpad.index_select(0, rows)
        if ctx.needs_input_grad[1]:
            dw = torch.stack([(ga * padded[j:L + j]).sum(0) for j in range(h + 1)], 1)
        return dx, dw, None, None, None, None


def packed_conv_train(x: torch.Tensor, weight: torch.Tensor, *, conv_state: torch.Tensor | None = None,
                      cu_seqlens: torch.Tensor | None = None, activation: str | None = "silu"
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    w, bounds = check_conv(x, weight, conv_state, cu_seqlens, activation)
    N, C, h = len(bounds), x.shape[1], w.shape[1] - 1
    rows, state_rows, last = (t.to(x.device) for t in _padded_rows(bounds, h))
    state = torch.zeros(N, C, h, device=x.device) if conv_state is None else conv_state.detach().float()
    y, padded = _PackedConv.apply(x.float(), w, state, rows, state_rows, activation == "silu")
    state_dtype = conv_state.dtype if conv_state is not None else x.dtype
    new_state = padded.detach().index_select(0, last).view(N, h, C).transpose(1, 2)
    return y.to(x.dtype), new_state.to(state_dtype).contiguous()


registry.register("short_conv", "train")(packed_conv_train)
