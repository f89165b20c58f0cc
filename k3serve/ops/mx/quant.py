"""Vectorised MXFP4 / MXFP8 quantise and dequantise along the last dim, in blocks of 32 (OCP MX v1.0).

    mxfp4_quantize(w [..., K], rule="floor") -> packed uint8 [..., K/2], scale uint8 [..., K/32]
    mxfp4_dequantize(packed [..., K/2], scale [..., K/32])  -> [..., K]
    mxfp4_fake_quant(w [..., K], rule="floor")              -> [..., K] in w.dtype
    mxfp8_quantize(x [..., K], rule="rceil") -> codes float8_e4m3fn [..., K], scale uint8 [..., K/32]
    mxfp8_dequantize(codes [..., K], scale [..., K/32])     -> [..., K]
    mxfp8_fake_quant(x [..., K], rule="rceil")              -> [..., K] in x.dtype

Packed byte j of a row holds element 2j in its low nibble and 2j+1 in its high nibble. A scale byte b means
2^(b - 127), 0xFF is NaN. Results equal ``naive.py`` bit for bit; the edge-case choices (NaN blocks, signed
zero, exact rceil) are documented there. Inputs are float32, bfloat16 or float16 and are quantised in float32,
which holds all of them exactly.
"""

from __future__ import annotations

import math
from functools import cache

import torch

from k3serve.ops.mx.naive import BLOCK, E2M1_VALUES, E8M0_BIAS, E8M0_NAN, RULES

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Scale byte -> float32 value; 2^-127 is a float32 subnormal and exact.
E8M0_TO_F32 = torch.tensor([2.0 ** (b - E8M0_BIAS) for b in range(255)] + [math.nan], dtype=torch.float32)
E2M1_TO_F32 = torch.tensor([*E2M1_VALUES, *(-v for v in E2M1_VALUES)], dtype=torch.float32)
# Byte -> (value of low nibble, value of high nibble): one gather decodes two elements.
FP4_PAIR_TO_F32 = torch.stack([E2M1_TO_F32.repeat(16), E2M1_TO_F32.repeat_interleave(16)], dim=-1)
# 2 * |E2M1 value| -> magnitude code; only the slots of representable values are read.
_TWICE_MAG_TO_CODE = torch.tensor([0, 1, 2, 3, 4, 0, 5, 0, 6, 0, 0, 0, 7], dtype=torch.uint8)


class _Element:
    def __init__(self, mbits: int, emin: int, max_value: float):
        self.mbits, self.emin, self.max_value = mbits, emin, max_value
        self.max_mant, self.max_exp = math.frexp(max_value)  # max_value = max_mant * 2^max_exp
        self.emax = self.max_exp - 1


_E2M1 = _Element(mbits=1, emin=0, max_value=6.0)
_E4M3 = _Element(mbits=3, emin=-6, max_value=448.0)


def describe(t: object) -> str:
    """How a bad argument is named in error messages: dtype and shape, or the Python type."""
    return f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def _check(x: torch.Tensor, name: str, rule: str | None = None) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be a float32/bfloat16/float16 tensor, got {describe(x)}")
    if x.dim() == 0 or x.shape[-1] % BLOCK != 0:
        raise ValueError(f"{name} last dim must be a multiple of {BLOCK}, got shape {tuple(x.shape)}")
    if rule is not None and rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")


@cache
def _lut(name: str, device: torch.device) -> torch.Tensor:
    """The constant table ``name`` on ``device``, copied there once: a host -> device copy on every call would
    also be a host sync inside a captured CUDA-graph decode step (``engine/capture_check.py`` refuses those)."""
    return {"e8m0": E8M0_TO_F32, "twice_mag": _TWICE_MAG_TO_CODE}[name].to(device)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e as float32 for integer e in [-127, 127]."""
    return _lut("e8m0", e.device)[(e + E8M0_BIAS).long()]


def _scale_exponent(amax: torch.Tensor, elem: _Element, rule: str) -> torch.Tensor:
    """Unbiased block exponent e (int32) for finite amax; frexp is exact, so no log2 rounding creeps in."""
    mant, exp = torch.frexp(amax)  # amax = mant * 2^exp, mant in [0.5, 1)
    if rule == "floor":
        e = exp - 1 - elem.emax
    else:
        # amax <= max_mant * 2^(max_exp + e)  <=>  e >= exp - max_exp, plus one when mant > max_mant.
        e = exp - elem.max_exp + (mant > elem.max_mant).int()
    e = torch.where(amax == 0, -E8M0_BIAS, e)
    return e.clamp(-E8M0_BIAS, E8M0_BIAS)


def _round_to_element(y: torch.Tensor, elem: _Element) -> torch.Tensor:
    """Round float32 y to the element grid (nearest, ties to even), saturating at +-max; keeps 0's sign."""
    mag = y.abs()
    _, exp = torch.frexp(mag)
    # Grid spacing in mag's binade; below the smallest normal the spacing is the subnormal one.
    step = _pow2(torch.clamp(exp - 1, min=elem.emin) - elem.mbits)
    # mag / step is exact (power of two); torch.round breaks ties to even.
    mag = torch.clamp(torch.round(mag / step) * step, max=elem.max_value)
    return torch.copysign(mag, y)


def _quantize(x: torch.Tensor, elem: _Element, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """-> element values on the grid (float32, [..., K/32, 32]) and scale bytes (uint8, [..., K/32])."""
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    finite = torch.isfinite(blocks).all(dim=-1)
    blocks = torch.where(finite.unsqueeze(-1), blocks, 0.0)
    e = _scale_exponent(blocks.abs().amax(dim=-1), elem, rule)
    # Multiplying by 2^-e is exact unless the product is a float32 subnormal, far below half the smallest
    # element step, where it rounds to +-0 either way.
    values = _round_to_element(blocks * _pow2(-e).unsqueeze(-1), elem)
    values = torch.where(finite.unsqueeze(-1), values, 0.0)
    scale = torch.where(finite, (e + E8M0_BIAS).to(torch.uint8), E8M0_NAN)
    return values, scale.to(torch.uint8)


def _e2m1_codes(values: torch.Tensor) -> torch.Tensor:
    mag_code = _lut("twice_mag", values.device)[(values.abs() * 2).long()]
    return mag_code | (torch.signbit(values).to(torch.uint8) << 3)


def mxfp4_quantize(w: torch.Tensor, rule: str = "floor") -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] -> (packed uint8 [..., K/2], scale uint8 [..., K/32])."""
    _check(w, "w", rule)
    values, scale = _quantize(w, _E2M1, rule)
    codes = _e2m1_codes(values).reshape(*w.shape[:-1], w.shape[-1] // 2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return packed, scale


def _check_scale(scale: torch.Tensor, shape: torch.Size, k: int) -> None:
    want = (*shape[:-1], k // BLOCK)
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.uint8 or tuple(scale.shape) != want:
        raise ValueError(f"scale must be a uint8 tensor of shape {want}, got {describe(scale)}")


@cache
def _scaled_pair_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256 * 256] words whose entry (scale_byte << 8 | packed_byte) is the pair (X * low value,
    X * high value) in ``dtype`` (float32 or bfloat16) viewed as one integer, so a single gather decodes and
    scales two elements. Every product is exact in both dtypes (2^-128 is a subnormal), except
    6 * 2^127 -> inf."""
    table = (E8M0_TO_F32[:, None, None] * FP4_PAIR_TO_F32[None]).to(dtype)
    word = torch.int64 if dtype == torch.float32 else torch.int32
    return table.contiguous().view(word).flatten().to(device)


def fp4_dequant_rows(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """packed uint8 [R, K/2], scale uint8 [R, K/32] -> [R, K] in ``dtype`` (float32 or bfloat16)."""
    rows, half_k = packed.shape
    index = packed.reshape(rows, half_k // (BLOCK // 2), BLOCK // 2).int()
    # In place on int32: about twice as fast as the mixed-dtype broadcast.
    index |= (scale.int() << 8).unsqueeze(-1)
    words = _scaled_pair_table(packed.device, dtype).index_select(0, index.flatten())
    return words.view(dtype).view(rows, half_k * 2)


def mxfp4_dequantize(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """(packed uint8 [..., K/2], scale uint8 [..., K/32]) -> w [..., K] in ``dtype`` (computed in float32)."""
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.dim() == 0:
        raise ValueError(f"packed must be a uint8 tensor [..., K/2], got {describe(packed)}")
    if packed.shape[-1] % (BLOCK // 2) != 0:
        raise ValueError(f"packed last dim must be a multiple of {BLOCK // 2}, got {tuple(packed.shape)}")
    k = packed.shape[-1] * 2
    _check_scale(scale, packed.shape, k)
    table_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    rows = packed.reshape(-1, packed.shape[-1])
    w = fp4_dequant_rows(rows, scale.reshape(-1, scale.shape[-1]), table_dtype)
    return w.reshape(*packed.shape[:-1], k).to(dtype)


def mxfp4_fake_quant(w: torch.Tensor, rule: str = "floor") -> torch.Tensor:
    """``mxfp4_dequantize(*mxfp4_quantize(w, rule), w.dtype)`` bit for bit, in about a third of the passes: no
    nibbles packed and decoded again, and the element grid's step taken from the scaled magnitude directly
    (QAT runs this on every expert weight at every step). A block holding NaN or inf takes the general path."""
    _check(w, "w", rule)
    blocks = w.float().reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    if not torch.isfinite(amax).all():
        return _scaled_back(*_quantize(w, _E2M1, rule), w)
    e = _scale_exponent(amax, _E2M1, rule)
    y = blocks * _pow2(-e)
    # |y| < 8 under either rule: E2M1's grid steps by 0.5 below 2, by 1 to 4 and by 2 above (as
    # ``_round_to_element`` finds from the binade); round() breaks ties to even, the clamp saturates at 6.
    mag = y.abs()
    step = torch.where(mag < 2.0, 0.5, torch.where(mag < 4.0, 1.0, 2.0))
    q = (torch.round(mag / step) * step).clamp_(max=_E2M1.max_value).copysign_(y)
    return (q * _pow2(e)).reshape(w.shape).to(w.dtype)


def mxfp8_quantize(x: torch.Tensor, rule: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (codes float8_e4m3fn [..., K], scale uint8 [..., K/32]); ``codes.view(torch.uint8)``
    gives the raw bytes."""
    _check(x, "x", rule)
    values, scale = _quantize(x, _E4M3, rule)
    # Every value is on the E4M3 grid already, so this cast is exact.
    return values.reshape(x.shape).to(torch.float8_e4m3fn), scale


def mxfp8_dequantize(
    codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """(codes float8_e4m3fn or uint8 [..., K], scale uint8 [..., K/32]) -> [..., K] in ``dtype``."""
    if not isinstance(codes, torch.Tensor) or codes.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise ValueError(f"codes must be a float8_e4m3fn or uint8 tensor, got {describe(codes)}")
    if codes.dim() == 0 or codes.shape[-1] % BLOCK != 0:
        raise ValueError(f"codes last dim must be a multiple of {BLOCK}, got shape {tuple(codes.shape)}")
    _check_scale(scale, codes.shape, codes.shape[-1])
    values = codes.view(torch.float8_e4m3fn).float()
    values = values.reshape(*codes.shape[:-1], codes.shape[-1] // BLOCK, BLOCK)
    x = values * _lut("e8m0", codes.device)[scale.long()].unsqueeze(-1)
    return x.reshape(codes.shape).to(dtype)


def mxfp8_fake_quant(x: torch.Tensor, rule: str = "rceil") -> torch.Tensor:
    """Quantise x [..., K] to MXFP8 (E4M3 elements, blocks of 32 along K) and back, in x's dtype."""
    _check(x, "x", rule)
    return _scaled_back(*_quantize(x, _E4M3, rule), x)


def _scaled_back(values: torch.Tensor, scale: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Grid values ``[..., K/32, 32]`` times their blocks' scales, in ``like``'s shape and dtype."""
    return (values * _lut("e8m0", like.device)[scale.long()].unsqueeze(-1)).reshape(like.shape).to(like.dtype)
