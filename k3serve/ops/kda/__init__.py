"""Kimi Delta Attention ops: the token recurrence (`naive`, the spec), the chunked WY prefill (`chunk`) and
the batched single-step decode (`decode`). Importing this package registers them with `ops.registry` as
"kda_recurrent", "kda_chunk" and "kda_decode" under the "torch" backend."""

from k3serve.ops import registry
from k3serve.ops.kda.chunk import chunk_kda
from k3serve.ops.kda.decode import kda_decode
from k3serve.ops.kda.naive import naive_recurrent_kda

registry.register("kda_recurrent", "torch")(naive_recurrent_kda)
registry.register("kda_chunk", "torch")(chunk_kda)
registry.register("kda_decode", "torch")(kda_decode)

__all__ = ["chunk_kda", "kda_decode", "naive_recurrent_kda"]
