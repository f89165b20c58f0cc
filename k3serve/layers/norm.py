"""The norm modules: ``KimiRMSNorm`` (the decoder's RMSNorm) and ``GatedRMSNorm`` (the KDA output norm).

They hold the weights; the math is the registry's "rms_norm" and "gated_rms_norm" ops (``ops/norm/``).
"""

from __future__ import annotations

import torch
from torch import nn

from k3serve.ops import registry


class KimiRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return registry.get("rms_norm")(x, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """Shared-weight RMSNorm over the last dim (one head), gated by ``sigmoid(z)``; fp32 math.

    x, z: ``[..., K]``; weight ``[K]`` (kept fp32, as in the checkpoint)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.weight.keep_fp32 = True
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return registry.get("gated_rms_norm")(x, z, self.weight, self.eps)
