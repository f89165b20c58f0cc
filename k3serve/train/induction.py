"""Attention supervision: teach MLA head 0 to attend where an induction head would.

Every copy the tasks ask for (argument values from the request, a record's words, a tool result's value)
is the same step: at position t, the next token is the one after an earlier occurrence of the current
token. Trained from the language-model loss alone, the KDA layers learned that for copies within their
~10-20-token state and MLA attention stayed near uniform (RESULTS.md, "Who copies"), so nothing copies
from farther back. This adds a direct loss on the softmax of head 0 of every MLA layer, at answer
positions t whose next token has such an earlier source:

    targets(t) = { j <= t : ids[j-1] == ids[t] and ids[j] == ids[t+1] }
    loss_t     = -log sum_{j in targets(t)} softmax_j(q_t . k_j * scale)       (causal over j <= t)

For the MLA keys to tell those j apart, the residual at j has to carry ids[j-1]: the gradient reaches
the earlier (KDA) layers through the keys and asks them for that previous-token feature. Only the
attention is supervised; what the head outputs is left to the language-model loss.

Shapes: MLA input x ``[N, d]`` (packed), head-0 queries ``[N, Dn + R]``, keys ``[N, Dn + R]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from k3serve.layers.mla import MLAttention

MAX_SOURCES = 8  # a token with more earlier sources than this (quotes, commas) is not a lookup


def induction_targets(ids: Sequence[int], answers: Sequence[tuple[int, int]],
                      max_sources: int = MAX_SOURCES) -> list[tuple[int, list[int]]]:
    """``(t, sources)`` for each answer token ``ids[t + 1]`` (t = its predecessor, as in the LM loss)
    with 1..``max_sources`` earlier positions j <= t where ``ids[j-1] == ids[t]`` and ``ids[j] == ids[t+1]``."""
    after: dict[int, list[int]] = {}  # token -> positions j whose predecessor is that token, in order
    out: list[tuple[int, list[int]]] = []
    filled = 1
    for a, b in sorted(answers):
        for t in range(a - 1, b - 1):
            while filled <= t:  # positions j <= t become visible to the query at t
                after.setdefault(ids[filled - 1], []).append(filled)
                filled += 1
            nxt = ids[t + 1]
            sources = [j for j in after.get(ids[t], ()) if ids[j] == nxt]
            if 0 < len(sources) <= max_sources:
                out.append((t, sources))
    return out


class MLAInputs:
    """Records the input ``[N, d]`` of every MLA layer during a forward (a context manager)."""

    def __init__(self, model: nn.Module):
        self.layers = [m for m in model.modules() if isinstance(m, MLAttention)]
        self.inputs: list[torch.Tensor] = []
        self._hooks: list = []

    def __enter__(self) -> MLAInputs:
        self.inputs.clear()
        self._hooks = [m.register_forward_pre_hook(lambda mod, args: self.inputs.append(args[0]))
                       for m in self.layers]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def head0_qk(m: MLAttention, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Head 0's queries and keys ``[N, Dn + R]`` of x ``[N, d]``, as the layer scores them (NoPE)."""
    q = m.queries(x)[:, 0].float()
    k = m.keys(m.latents(x))[:, 0].float()
    return q, k


def attention_loss(taps: MLAInputs, lens: Sequence[int],
                   targets: Sequence[list[tuple[int, list[int]]]]) -> tuple[torch.Tensor, int]:
    """Mean over MLA layers and supervised positions of ``-log`` (head-0 attention mass on the sources),
    and the number of supervised positions per layer. ``targets[i]`` are sequence i's (local positions)."""
    total, count = None, sum(len(t) for t in targets)
    if count == 0 or not taps.inputs:
        return torch.zeros(()), 0
    for m, x in zip(taps.layers, taps.inputs):
        q, k = head0_qk(m, x)
        off = 0
        for n, tgt in zip(lens, targets):
            if tgt:
                t = torch.tensor([p for p, _ in tgt], device=q.device)
                scores = (q[off + t] @ k[off:off + n].T) * m.scale  # [A, n]
                visible = torch.arange(n, device=q.device)[None, :] <= t[:, None]
                logp = torch.log_softmax(scores.masked_fill(~visible, float("-inf")), -1)
                hit = torch.zeros_like(visible)
                hit[[r for r, (_, src) in enumerate(tgt) for _ in src], [j for _, src in tgt for j in src]] = True
                mass = torch.logsumexp(logp.masked_fill(~hit, float("-inf")), -1)
                total = -mass.sum() if total is None else total - mass.sum()
            off += n
    return total / (count * len(taps.inputs)), count
