"""Kimi Delta Attention ops: the token recurrence (`naive`, the spec), the chunked WY prefill (`chunk`), the
batched single-step decode (`decode`) and the whole decode step from pre-conv q|k|v (`step`; `cpu`: its
native fused kernel). Importing this package registers them with `ops.registry` as "kda_recurrent",
"kda_chunk", "kda_decode" and "kda_decode_step" under the "torch" backend, and "kda_decode_step" "cpu" (the
active one when the extension is built)."""

from k3serve.ops import registry
from k3serve.ops.cpu import available as native_available
from k3serve.ops.kda.chunk import chunk_kda
from k3serve.ops.kda.cpu import kda_decode_step_cpu
from k3serve.ops.kda.decode import kda_decode
from k3serve.ops.kda.naive import naive_recurrent_kda
from k3serve.ops.kda.step import kda_decode_step, kda_gate, l2_normalize

registry.register("kda_recurrent", "torch")(naive_recurrent_kda)
registry.register("kda_chunk", "torch")(chunk_kda)
registry.register("kda_decode", "torch")(kda_decode)
registry.register("kda_decode_step", "torch")(kda_decode_step)
registry.register("kda_decode_step", "cpu")(kda_decode_step_cpu)
if native_available():
    registry.set_backend("kda_decode_step", "cpu")

__all__ = ["chunk_kda", "kda_decode", "kda_decode_step", "kda_decode_step_cpu", "kda_gate", "l2_normalize",
           "naive_recurrent_kda"]
