"""RMSNorm and the gated RMSNorm, one row at a time in Python floats: the reference for ``rms.py``.

For a row x of d values (the last dim; any leading dims are rows):
  rms_norm(x, w, eps):          y_i = w_i · cast(x_i / sqrt(Σ_j x_j² / d + eps))   cast = to x's dtype, before w
  gated_rms_norm(x, z, w, eps): y_i = cast(x_i / sqrt(Σ_j x_j² / d + eps) · w_i · sigmoid(z_i))   all fp32 first
The Kimi convention casts the normalised row back to the input dtype *before* the weight multiply
(``rms_norm``); the gated form of the KDA output keeps everything in fp32 and casts once at the end.
"""

from __future__ import annotations

import math

import torch


def _inv_rms(row: list[float], eps: float) -> float:
    return 1.0 / math.sqrt(sum(v * v for v in row) / len(row) + eps)


def _sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v)) if v >= 0 else math.exp(v) / (1.0 + math.exp(v))


def naive_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rows = x.float().reshape(-1, x.shape[-1]).tolist()
    normed = torch.tensor([[v * _inv_rms(r, eps) for v in r] for r in rows], dtype=torch.float32)
    return weight * normed.reshape(x.shape).to(x.dtype)


def naive_gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    d = x.shape[-1]
    w = weight.float().tolist()
    out = []
    for r, g in zip(x.float().reshape(-1, d).tolist(), z.float().reshape(-1, d).tolist()):
        s = _inv_rms(r, eps)
        out.append([v * s * wi * _sigmoid(gi) for v, wi, gi in zip(r, w, g)])
    return torch.tensor(out, dtype=torch.float32).reshape(x.shape).to(x.dtype)
