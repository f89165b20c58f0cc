"""The gated activations, one element at a time in Python floats: the reference for ``glu.py``.

  silu_and_mul(gate, up) = gate · sigmoid(gate) · up
  situ_and_mul(gate, up, β, β_lin) = β·tanh(gate/β) · sigmoid(gate) · u',  u' = β_lin·tanh(up/β_lin) (else up)
gate, up ``[..., I]`` of one dtype; the result is in that dtype.
"""

from __future__ import annotations

import math

import torch


def _sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v)) if v >= 0 else math.exp(v) / (1.0 + math.exp(v))


def _elementwise(fn, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    vals = [fn(g, u) for g, u in zip(gate.float().reshape(-1).tolist(), up.float().reshape(-1).tolist())]
    return torch.tensor(vals, dtype=torch.float32).reshape(gate.shape).to(gate.dtype)


def naive_silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _elementwise(lambda g, u: g * _sigmoid(g) * u, gate, up)


def naive_situ_and_mul(gate: torch.Tensor, up: torch.Tensor, beta: float = 1.0,
                       linear_beta: float | None = None) -> torch.Tensor:
    def situ(g: float, u: float) -> float:
        capped = u if linear_beta is None else linear_beta * math.tanh(u / linear_beta)
        return beta * math.tanh(g / beta) * _sigmoid(g) * capped

    return _elementwise(situ, gate, up)
