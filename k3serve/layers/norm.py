"""RMSNorm in the Kimi convention, and the gated RMSNorm of the KDA output.

``KimiRMSNorm``: normalise in fp32, cast back to the input dtype, *then* multiply by the weight (the order
matters for bf16 bit-parity with the reference). ``GatedRMSNorm``: per head over its K channels,
``RMSNorm(o)·w · sigmoid(z)`` entirely in fp32, cast at the end.
"""

from __future__ import annotations

import torch
from torch import nn

from k3serve.ops import registry


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x²) + eps)`` over the last dim, in fp32."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


@registry.register("rms_norm", "torch")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * rms_normalize(x, eps).to(x.dtype)


@registry.register("gated_rms_norm", "torch")
def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return (rms_normalize(x, eps) * weight.float() * torch.sigmoid(z.float())).to(x.dtype)


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
