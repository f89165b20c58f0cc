"""Gated activations ``act(gate) · up``: SiLU and K3's soft-capped SiTU, the element-by-element reference
(``naive``) and the torch forms (``glu``). Importing this package registers "silu_and_mul" and
"situ_and_mul" under "torch" and "naive"."""

from k3serve.ops import registry
from k3serve.ops.activation.glu import GatedActivation, silu_and_mul, situ_and_mul
from k3serve.ops.activation.naive import naive_silu_and_mul, naive_situ_and_mul

registry.register("silu_and_mul", "torch")(silu_and_mul)
registry.register("silu_and_mul", "naive")(naive_silu_and_mul)
registry.register("situ_and_mul", "torch")(situ_and_mul)
registry.register("situ_and_mul", "naive")(naive_situ_and_mul)

__all__ = ["GatedActivation", "naive_silu_and_mul", "naive_situ_and_mul", "silu_and_mul", "situ_and_mul"]
