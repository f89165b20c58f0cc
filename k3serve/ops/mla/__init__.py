"""MLA attention over the compressed latent cache: ``naive`` (the spec) and ``paged`` (prefill/decode)."""

from k3serve.ops.mla.naive import naive_mla_attention
from k3serve.ops.mla.paged import (DecodeChunk, decode_workspace_numel, gather_latents, mla_decode_absorbed,
                                   mla_prefill, plan_decode, write_latents)
from k3serve.ops.registry import register

register("mla_prefill", "torch")(mla_prefill)
register("mla_decode", "torch")(mla_decode_absorbed)

__all__ = ["DecodeChunk", "decode_workspace_numel", "gather_latents", "mla_decode_absorbed", "mla_prefill",
           "naive_mla_attention", "plan_decode", "write_latents"]
