"""Block Attention Residuals (K3): the learned vectors of one mix and the per-token state along depth.

The mix itself (softmax over completed blocks and the running partial sum) is the registry's "attn_res_mix"
op (``ops/attn_res/``); the decoder and the model call it with these weights and this state.
"""

from __future__ import annotations

import torch
from torch import nn


class AttnResWeights(nn.Module):
    """The two learned vectors of one mix; a separate module only so its checkpoint names stay flat."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d))


class AttnResState:
    """What flows along depth for each token: completed block sums and the current partial sum."""

    def __init__(self, embedding: torch.Tensor):
        self.blocks: list[torch.Tensor] = []
        self.partial: torch.Tensor | None = embedding

    def snapshot(self) -> None:
        """At a block start: the pre-mix partial sum becomes a completed block and the sum restarts."""
        self.blocks.append(self.partial)
        self.partial = None

    def add(self, out: torch.Tensor) -> None:
        self.partial = out if self.partial is None else self.partial + out
