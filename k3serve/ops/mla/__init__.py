"""MLA attention over the compressed latent cache: ``naive`` (the spec, backend "naive" of every op here),
``paged`` (prefill/decode, "torch"), ``packed`` (packed fresh prefill: "torch" loops, "bucketed" pads) and
``masked`` (decode over fixed-width block tables with a length mask, no host reads: op "mla_decode_static",
the static decode step's, ``core.context.StaticDecode``) and ``cpu`` (decode with the native kernel, C++ in ``native/``; dispatch picks it for CPU fp32 inputs when
the extension is built)."""

from k3serve.ops.mla.naive import naive_mla_attention, naive_mla_decode, naive_mla_prefill_packed
from k3serve.ops.mla.masked import mla_decode_masked
from k3serve.ops.mla.packed import mla_prefill_bucketed, mla_prefill_loop
from k3serve.ops.mla.paged import (DecodeChunk, decode_workspace_numel, gather_latents, mla_decode_absorbed,
                                   mla_prefill, plan_decode, write_latents)
from k3serve.ops import native
from k3serve.ops.mla.cpu import mla_decode_cpu
from k3serve.ops.registry import register

register("mla_prefill", "torch")(mla_prefill)
register("mla_prefill", "naive")(naive_mla_attention)
register("mla_prefill_packed", "torch")(mla_prefill_loop)
register("mla_prefill_packed", "bucketed")(mla_prefill_bucketed)
register("mla_prefill_packed", "naive")(naive_mla_prefill_packed)
register("mla_decode", "torch")(mla_decode_absorbed)
register("mla_decode", "naive")(naive_mla_decode)
register("mla_decode_static", "torch")(mla_decode_masked)
register("mla_decode_static", "naive")(naive_mla_decode)
register("mla_decode", "cpu", priority=native.priority(),
         accepts=lambda q, cache, block_tables, context_lens, kv_b, **_: native.accepts_fp32_cpu(q, cache, kv_b))(
    mla_decode_cpu)

__all__ = ["DecodeChunk", "decode_workspace_numel", "gather_latents", "mla_decode_absorbed", "mla_decode_cpu",
           "mla_decode_masked",
           "mla_prefill", "mla_prefill_bucketed", "mla_prefill_loop", "naive_mla_attention", "naive_mla_decode",
           "naive_mla_prefill_packed", "plan_decode", "write_latents"]
