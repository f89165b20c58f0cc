"""Gated activations of the MLPs and experts, torch forms computed in fp32 and cast back (spec: ``naive.py``).

``silu_and_mul(gate, up) = silu(gate) · up``.
``situ_and_mul(gate, up) = β·tanh(gate/β)·sigmoid(gate) · u'`` with ``u' = β_lin·tanh(up/β_lin)`` when β_lin is
set (else ``u' = up``): SiTU is a SiLU soft-capped at β, used by K3 (β = 4, β_lin = 25).
``GatedActivation`` is the ``(gate, up) -> act`` callable a config's ``hidden_act`` names, carrying its name and
constants so a fused kernel (``ops/moe/triton_mxfp4.py``) can compute the same activation itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3serve.ops import registry


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


@dataclass(frozen=True)
class GatedActivation:
    """``silu`` (``silu_and_mul``) or ``situ`` (the registry's ``situ_and_mul``, so the trainer's form is used when
    forced) with its constants."""
    name: str
    beta: float = 1.0
    linear_beta: float | None = None

    def __post_init__(self) -> None:
        if self.name not in ("silu", "situ"):
            raise ValueError(f"unsupported hidden_act {self.name!r}")

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.name == "silu":
            return silu_and_mul(gate, up)
        return registry.get("situ_and_mul")(gate, up, self.beta, self.linear_beta)
