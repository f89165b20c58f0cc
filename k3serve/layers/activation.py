"""Gated activations of the MLPs and experts, computed in fp32 and cast back.

``silu_and_mul(gate, up) = silu(gate) · up``.
``situ_and_mul(gate, up) = β·tanh(gate/β)·sigmoid(gate) · u'`` with ``u' = β_lin·tanh(up/β_lin)`` when β_lin is
set (else ``u' = up``): SiTU is a SiLU soft-capped at β, used by K3 (β = 4, β_lin = 25).
"""

from __future__ import annotations

from functools import partial

import torch

from k3serve.ops import registry


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g, u = gate.float(), up.float()
    return (torch.nn.functional.silu(g) * u).to(gate.dtype)


@registry.register("situ_and_mul", "torch")
def situ_and_mul(gate: torch.Tensor, up: torch.Tensor, beta: float = 1.0,
                 linear_beta: float | None = None) -> torch.Tensor:
    g, u = gate.float(), up.float()
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (a * u).to(gate.dtype)


def _situ_active(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """SiTU by the op's active backend (training swaps in its own form)."""
    return registry.get("situ_and_mul")(gate, up, beta, linear_beta)


def make_glu(hidden_act: str, beta: float = 1.0, linear_beta: float | None = None):
    """The ``(gate, up) -> act`` function named by a config's ``hidden_act``."""
    if hidden_act == "silu":
        return silu_and_mul
    if hidden_act == "situ":
        return partial(_situ_active, beta=beta, linear_beta=linear_beta)
    raise ValueError(f"unsupported hidden_act {hidden_act!r}")
