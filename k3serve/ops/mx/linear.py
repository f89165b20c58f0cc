"""y = x @ W^T with W held as MXFP4 (the routed-expert GEMM), torch backend of op "mxfp4_linear".

    x      [..., K]    float32 / bfloat16 / float16
    packed [N, K/2]    uint8, element 2j of a row in the low nibble of byte j
    scale  [N, K/32]   uint8 E8M0 bytes
    y      [..., N]    x's dtype

W is dequantised a slab of rows at a time, so the full-precision weight never exists at once; a slab is sized
to stay in cache between its dequantisation and its matmul. ``act_quant`` emulates the MXFP8 activations K3
was trained with (E4M3 elements, blocks of 32 along K, scale rule "rceil" or "floor"; model.md §11.4).
"""

from __future__ import annotations

import torch

from k3serve.ops.mx.naive import BLOCK, RULES
from k3serve.ops.mx.quant import describe, fp4_dequant_rows, mxfp8_fake_quant

# Elements per dequantised slab: 512 K float32 = 2 MiB, about one core's L2; measured best on the dev box.
_SLAB_ELEMENTS = 1 << 19
_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, act_quant: str | None) -> None:
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"packed must be a 2-D uint8 tensor [N, K/2], got {describe(packed)}")
    n, k = packed.shape[0], packed.shape[1] * 2
    if k % BLOCK != 0:
        raise ValueError(f"packed must have K/2 columns, K a multiple of {BLOCK}, got {tuple(packed.shape)}")
    want = (n, k // BLOCK)
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.uint8 or tuple(scale.shape) != want:
        raise ValueError(f"scale must be a uint8 tensor of shape {want}, got {describe(scale)}")
    if not isinstance(x, torch.Tensor) or x.dtype not in _X_DTYPES or x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"x must be a float32/bfloat16/float16 tensor [..., {k}], got {describe(x)}")
    if act_quant is not None and act_quant not in RULES:
        raise ValueError(f"act_quant must be None or one of {RULES}, got {act_quant!r}")


def mxfp4_linear(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, *, act_quant: str | None = None
) -> torch.Tensor:
    """x [..., K] @ W^T with W = MXFP4(packed [N, K/2], scale [N, K/32]) -> [..., N] in x's dtype."""
    _check(x, packed, scale, act_quant)
    if act_quant is not None:
        x = mxfp8_fake_quant(x, act_quant)
    n, k = packed.shape[0], packed.shape[1] * 2
    # Both float32 and bfloat16 hold every dequantised weight exactly; float16 lacks the exponent range.
    compute = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
    x2 = x.reshape(-1, k).to(compute)
    # Output is built transposed so each slab writes contiguous rows.
    y_t = torch.empty(n, x2.shape[0], dtype=compute, device=x.device)
    rows = max(1, _SLAB_ELEMENTS // k)
    for r0 in range(0, n, rows):
        r1 = min(r0 + rows, n)
        torch.mm(fp4_dequant_rows(packed[r0:r1], scale[r0:r1], compute), x2.t(), out=y_t[r0:r1])
    return y_t.t().reshape(*x.shape[:-1], n).to(x.dtype)
