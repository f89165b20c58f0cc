"""The compressed-tensors "mxfp4-pack-quantized" layout of K3's routed experts (model.md §5.3, §11.4).

A logical weight W [out, in] is stored as two safetensors entries:

    <name>.weight_packed  U8 [out, in/2]   E2M1 codes: W[r, 2j] low nibble of byte [r, j], W[r, 2j+1] high
    <name>.weight_scale   U8 [out, in/32]  E8M0: W[r, c] = E2M1(code) * 2^(weight_scale[r, c // 32] - 127)

These are exactly ``mxfp4_quantize`` / ``mxfp4_dequantize`` over the ``in`` dim. In K3 only the routed experts
``...block_sparse_moe.experts.{e}.w{1,2,3}`` use it; everything else is BF16/F32 and listed in ``ignore``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from k3serve.ops.mx.quant import describe, mxfp4_dequantize, mxfp4_quantize

PACKED_SUFFIX = ".weight_packed"
SCALE_SUFFIX = ".weight_scale"


def pack_weight(name: str, weight: torch.Tensor, rule: str = "floor") -> dict[str, torch.Tensor]:
    """Logical ``weight`` [out, in] -> {"<name>.weight_packed": U8 [out, in/2],
    "<name>.weight_scale": U8 [out, in/32]}."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D tensor [out, in], got {describe(weight)}")
    packed, scale = mxfp4_quantize(weight, rule)
    return {name + PACKED_SUFFIX: packed, name + SCALE_SUFFIX: scale}


def unpack_weight(
    tensors: Mapping[str, torch.Tensor], name: str, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """The logical weight [out, in] in ``dtype`` from ``<name>.weight_packed`` / ``<name>.weight_scale``."""
    missing = [key for key in (name + PACKED_SUFFIX, name + SCALE_SUFFIX) if key not in tensors]
    if missing:
        raise ValueError(f"tensors lacks {missing} for name {name!r}")
    return mxfp4_dequantize(tensors[name + PACKED_SUFFIX], tensors[name + SCALE_SUFFIX], dtype)


def k3_quantization_config() -> dict[str, Any]:
    """The ``quantization_config`` block of a K3 config.json, as summarised in model.md §11.4.

    The ignore patterns are our regex rendering of the published categories (self_attn, shared_experts, dense
    mlp projections, lm_head, vision_tower, mm_projector); the exact published strings are not in hand."""
    weights = {
        "num_bits": 4,
        "type": "float",
        "symmetric": True,
        "group_size": 32,
        "strategy": "group",
        "block_structure": None,
        "dynamic": False,
        "actorder": None,
        "observer": "minmax",
        "observer_kwargs": {},
        "scale_dtype": "torch.uint8",
        "zp_dtype": "torch.uint8",
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": "mxfp4-pack-quantized",
            }
        },
        "ignore": [
            "re:.*self_attn.*",
            "re:.*shared_experts.*",
            r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
            "re:.*lm_head",
            "re:.*vision_tower.*",
            "re:.*mm_projector.*",
        ],
        "kv_cache_scheme": None,
    }
