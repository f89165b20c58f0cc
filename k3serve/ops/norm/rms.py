"""RMSNorm in the Kimi convention and the gated RMSNorm of the KDA output, torch forms (spec: ``naive.py``).

``rms_norm``: normalise in fp32, cast back to the input dtype, *then* multiply by the weight (the order
matters for bf16 bit-parity with the reference). ``gated_rms_norm``: per head over its K channels,
``RMSNorm(x)·w · sigmoid(z)`` entirely in fp32, cast at the end. x, z ``[..., d]``; weight ``[d]``.
"""

from __future__ import annotations

import torch


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x²) + eps)`` over the last dim, in fp32."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * rms_normalize(x, eps).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return (rms_normalize(x, eps) * weight.float() * torch.sigmoid(z.float())).to(x.dtype)
