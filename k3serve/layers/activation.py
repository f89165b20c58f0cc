"""The gated activation a config names (``hidden_act``), as the ``(gate, up) -> act`` function the MLPs and
experts call; the math is in ``ops/activation/``."""

from __future__ import annotations

from k3serve.ops.activation import GatedActivation


def make_glu(hidden_act: str, beta: float = 1.0, linear_beta: float | None = None) -> GatedActivation:
    """The ``(gate, up) -> act`` function named by a config's ``hidden_act`` (SiTU by the registry's active
    ``situ_and_mul`` backend, so the trainer can swap in its own form); it carries its name and constants, so
    a fused expert kernel can compute it in its epilogue."""
    if hidden_act == "silu":
        return GatedActivation("silu")
    if hidden_act == "situ":
        return GatedActivation("situ", beta, linear_beta)
    raise ValueError(f"unsupported hidden_act {hidden_act!r}")
