"""Gated activations of the MLPs and experts, torch forms computed in fp32 and cast back (spec: ``naive.py``).

``silu_and_mul(gate, up) = silu(gate) · up``.
``situ_and_mul(gate, up) = β·tanh(gate/β)·sigmoid(gate) · u'`` with ``u' = β_lin·tanh(up/β_lin)`` when β_lin is
set (else ``u' = up``): SiTU is a SiLU soft-capped at β, used by K3 (β = 4, β_lin = 25).
"""

from __future__ import annotations

import torch


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g, u = gate.float(), up.float()
    return (torch.nn.functional.silu(g) * u).to(gate.dtype)


def situ_and_mul(gate: torch.Tensor, up: torch.Tensor, beta: float = 1.0,
                 linear_beta: float | None = None) -> torch.Tensor:
    g, u = gate.float(), up.float()
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (a * u).to(gate.dtype)
