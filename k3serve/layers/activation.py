"""The gated activation a config names (``hidden_act``), as the ``(gate, up) -> act`` function the MLPs and
experts call; the math is in ``ops/activation/``."""

from __future__ import annotations

from functools import partial

import torch

from k3serve.ops import registry
from k3serve.ops.activation import silu_and_mul


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
