"""RMSNorm (Kimi convention) and the gated RMSNorm of the KDA output: the row-by-row reference (``naive``)
and the torch forms (``rms``). Importing this package registers "rms_norm" and "gated_rms_norm" under
"torch" and "naive"."""

from k3serve.ops import registry
from k3serve.ops.norm.naive import naive_gated_rms_norm, naive_rms_norm
from k3serve.ops.norm.rms import gated_rms_norm, rms_norm, rms_normalize

registry.register("rms_norm", "torch")(rms_norm)
registry.register("rms_norm", "naive")(naive_rms_norm)
registry.register("gated_rms_norm", "torch")(gated_rms_norm)
registry.register("gated_rms_norm", "naive")(naive_gated_rms_norm)

__all__ = ["gated_rms_norm", "naive_gated_rms_norm", "naive_rms_norm", "rms_norm", "rms_normalize"]
