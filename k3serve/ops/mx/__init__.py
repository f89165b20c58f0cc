"""OCP MX v1.0 number formats: MXFP4 weights (E2M1 + E8M0 per 32) and MXFP8 activations (E4M3 + E8M0 per 32).

``naive`` is the scalar spec reference; ``quant`` the vectorised quantise/dequantise; ``linear`` the
``mxfp4_linear`` op; ``checkpoint`` the compressed-tensors key layout. Importing this package registers
"mxfp4_linear" under "torch" (``linear``) and "naive" (``naive.mxfp4_linear``).
"""

from k3serve.ops import registry
from k3serve.ops.mx import naive
from k3serve.ops.mx.checkpoint import k3_quantization_config, pack_weight, unpack_weight
from k3serve.ops.mx.linear import mxfp4_linear
from k3serve.ops.mx.quant import (
    mxfp4_dequantize,
    mxfp4_fake_quant,
    mxfp4_quantize,
    mxfp8_dequantize,
    mxfp8_fake_quant,
    mxfp8_quantize,
)

registry.register("mxfp4_linear", "torch")(mxfp4_linear)
registry.register("mxfp4_linear", "naive")(naive.mxfp4_linear)

__all__ = [
    "k3_quantization_config",
    "mxfp4_dequantize",
    "mxfp4_fake_quant",
    "mxfp4_linear",
    "mxfp4_quantize",
    "mxfp8_dequantize",
    "mxfp8_fake_quant",
    "mxfp8_quantize",
    "naive",
    "pack_weight",
    "unpack_weight",
]
