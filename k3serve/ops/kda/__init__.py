"""Kimi Delta Attention ops: the token recurrence (`naive`, the spec), the chunked WY prefill (`chunk`), the
batched single-step decode (`decode`) and the whole decode step from pre-conv q|k|v (`step`; `cpu`: its
native fused kernel, C++ in `native/`). Importing this package registers with `ops.registry` "kda_chunk"
and "kda_decode" under "torch" and "naive" (the recurrence), "kda_decode_step" under "torch", "naive" and
"cpu" (dispatch picks it for CPU fp32 inputs when the extension is built). Where flash-linear-attention is
installed (the ``[gpu]`` extra), ``fla.py`` adds "fla" to "kda_chunk" and "kda_decode" (picked for CUDA
tensors) and "fla_recurrent" to "kda_chunk" (when named). ``split.py``: a prefill cut at snapshot positions."""

from importlib.util import find_spec

from k3serve.ops import registry
from k3serve.ops import native
from k3serve.ops.kda.chunk import chunk_kda
from k3serve.ops.kda.cpu import kda_decode_step_cpu
from k3serve.ops.kda.decode import kda_decode
from k3serve.ops.kda.naive import naive_kda_decode, naive_kda_decode_step, naive_recurrent_kda
from k3serve.ops.kda.split import chunk_kda_split
from k3serve.ops.kda.step import kda_decode_step, kda_gate, l2_normalize


def _native_step_accepts(qkv, conv_weight, conv_state, f, dt_bias, a_log, b, state, **_) -> bool:  # noqa: ANN001
    return native.accepts_fp32_cpu(qkv, conv_weight, conv_state, f, state)


registry.register("kda_chunk", "torch")(chunk_kda)
registry.register("kda_chunk", "naive")(naive_recurrent_kda)
registry.register("kda_decode", "torch")(kda_decode)
registry.register("kda_decode", "naive")(naive_kda_decode)
registry.register("kda_decode_step", "torch")(kda_decode_step)
registry.register("kda_decode_step", "cpu", priority=native.priority(), accepts=_native_step_accepts)(kda_decode_step_cpu)
registry.register("kda_decode_step", "naive")(naive_kda_decode_step)
if find_spec("fla") is not None:  # the [gpu] extra; a CPU install never imports it
    from k3serve.ops.kda import fla

    registry.register("kda_chunk", "fla", priority=20, accepts=fla.on_cuda)(fla.fla_chunk_kda)
    registry.register("kda_chunk", "fla_recurrent", priority=None)(fla.fla_recurrent_kda)
    registry.register("kda_decode", "fla", priority=20, accepts=fla.on_cuda)(fla.fla_kda_decode)

__all__ = ["chunk_kda", "chunk_kda_split", "kda_decode", "kda_decode_step", "kda_decode_step_cpu", "kda_gate", "l2_normalize",
           "naive_kda_decode", "naive_kda_decode_step", "naive_recurrent_kda"]
