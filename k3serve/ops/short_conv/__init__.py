"""Depthwise causal short convolution (KDA's q/k/v conv, kernel 4, no bias, SiLU): the token-by-token
reference (`naive`), the packed varlen form and its decode step (`conv`). Importing this package registers
"short_conv" and "short_conv_update" under "torch" (`conv`) and "naive" (the reference)."""

from k3serve.ops import registry
from k3serve.ops.short_conv.conv import causal_conv1d, causal_conv1d_update
from k3serve.ops.short_conv.naive import naive_causal_conv1d, naive_causal_conv1d_update

registry.register("short_conv", "torch")(causal_conv1d)
registry.register("short_conv_update", "torch")(causal_conv1d_update)
registry.register("short_conv", "naive")(naive_causal_conv1d)
registry.register("short_conv_update", "naive")(naive_causal_conv1d_update)

__all__ = ["causal_conv1d", "causal_conv1d_update", "naive_causal_conv1d", "naive_causal_conv1d_update"]
