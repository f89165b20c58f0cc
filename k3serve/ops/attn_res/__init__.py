"""The Block Attention Residuals mix of K3: the token-by-token reference (``naive``) and the torch form
(``mix``). Importing this package registers "attn_res_mix" under "torch" and "naive"."""

from k3serve.ops import registry
from k3serve.ops.attn_res.mix import attn_res_mix
from k3serve.ops.attn_res.naive import naive_attn_res_mix

registry.register("attn_res_mix", "torch")(attn_res_mix)
registry.register("attn_res_mix", "naive")(naive_attn_res_mix)

__all__ = ["attn_res_mix", "naive_attn_res_mix"]
