"""Scalar reference for the OCP MX v1.0 formats K3 uses, written straight from the spec: the test oracle.

An MX block is 32 values V sharing one E8M0 scale X = 2^e; each value is stored as an element code P with
V ~ X * value(P). Elements are E2M1 (FP4, codes 0..15) for weights and E4M3 "fn" (FP8, codes 0..255) for
activations. Everything here is Python ints and floats, one element at a time; the tensor wrappers at the
bottom loop over blocks and return the same shapes as the vectorised forms in ``quant.py``:

    mxfp4_quantize(w [..., K]) -> packed uint8 [..., K/2] (element 2j low nibble), scale uint8 [..., K/32]
    mxfp8_quantize(x [..., K]) -> codes uint8 [..., K],                              scale uint8 [..., K/32]

Choices the spec leaves to the implementation, made once here and matched bit-for-bit in ``quant.py``:

* A block holding any NaN or +-Inf gets scale byte 0xFF (NaN) and all codes 0. OCP §5.3 makes every element
  of a block with X = NaN read back as NaN, so the codes carry nothing and zero is the tidy choice.
* The sign of zero is kept: -0.0, and negatives that round to zero, get the negative-zero code (8 for E2M1,
  0x80 for E4M3). Both read back as -0.0.
* A zero block (amax = 0) gets scale byte 0 (X = 2^-127); its codes are +-0.
* Scale rules, with e clamped to [-127, 127]:
  "floor" (OCP §6.3): e = floor(log2(amax)) - emax_elem; |V|/X can reach 8 for E2M1 (512 for E4M3) and
  saturates. "rceil" (cuBLAS/TransformerEngine): the smallest e with amax <= max_elem * 2^e, computed
  exactly (no rounding of amax / max_elem), so no element ever clips.
* Element rounding is round-to-nearest, ties to the even code, with finite overflow saturating to +-max_elem.
"""

from __future__ import annotations

import bisect
import math
from fractions import Fraction
from typing import NamedTuple

import torch

BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 0xFF
RULES = ("floor", "rceil")

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_decode(code: int) -> float:
    """Value of an E2M1 code: bit 3 is the sign, bits 0..2 index the magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6."""
    if not 0 <= code <= 15:
        raise ValueError(f"code must be in [0, 15], got {code}")
    mag = E2M1_VALUES[code & 7]
    return -mag if code & 8 else mag


def e4m3_decode(code: int) -> float:
    """Value of an E4M3 "fn" byte: S.EEEE.MMM, bias 7, subnormals at exponent 0, S.1111.111 is NaN, no inf."""
    if not 0 <= code <= 255:
        raise ValueError(f"code must be in [0, 255], got {code}")
    sign = -1.0 if code & 0x80 else 1.0
    exp, man = (code >> 3) & 0xF, code & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * (man / 8) * 2.0**-6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def e8m0_decode(byte: int) -> float:
    """Value of an E8M0 scale byte: 2^(byte - 127); 0xFF is NaN; byte 0 is 2^-127 (there is no zero)."""
    if not 0 <= byte <= 255:
        raise ValueError(f"byte must be in [0, 255], got {byte}")
    return math.nan if byte == E8M0_NAN else 2.0 ** (byte - E8M0_BIAS)


class ElementFormat(NamedTuple):
    name: str
    emax: int  # exponent of the largest power of two the element can hold
    max_value: float
    sign_bit: int
    nan_code: int | None
    magnitudes: tuple[float, ...]  # value of each non-negative code, indexed by code; increasing


def _magnitudes(decode, count: int) -> tuple[float, ...]:
    return tuple(decode(code) for code in range(count))


E2M1 = ElementFormat("e2m1", 2, 6.0, 0x8, None, _magnitudes(e2m1_decode, 8))
# Codes 0..126 are the finite non-negative E4M3 values; 127 is NaN.
E4M3 = ElementFormat("e4m3", 8, 448.0, 0x80, 0x7F, _magnitudes(e4m3_decode, 127))


def encode_element(value: float, fmt: ElementFormat) -> int:
    """Nearest code to ``value``, ties to the even code, saturating at +-max; the sign of zero is kept.

    NaN and +-Inf become the E4M3 NaN code; E2M1 has none, so they raise ValueError."""
    if not math.isfinite(value):
        if fmt.nan_code is None:
            raise ValueError(f"value must be finite for {fmt.name}, got {value}")
        return fmt.nan_code
    sign = fmt.sign_bit if math.copysign(1.0, value) < 0 else 0
    mag = abs(value)
    if mag >= fmt.max_value:
        return sign | (len(fmt.magnitudes) - 1)
    hi = bisect.bisect_left(fmt.magnitudes, mag)
    if fmt.magnitudes[hi] == mag:
        return sign | hi
    lo = hi - 1
    # Exact distances, so a tie is a tie.
    d_lo = Fraction(mag) - Fraction(fmt.magnitudes[lo])
    d_hi = Fraction(fmt.magnitudes[hi]) - Fraction(mag)
    if d_lo < d_hi or (d_lo == d_hi and lo % 2 == 0):
        return sign | lo
    return sign | hi


def floor_log2(q: Fraction) -> int:
    """The integer e with 2^e <= q < 2^(e+1), for q > 0."""
    e = q.numerator.bit_length() - q.denominator.bit_length()
    return e - 1 if Fraction(2) ** e > q else e


def ceil_log2(q: Fraction) -> int:
    """The smallest integer e with q <= 2^e, for q > 0."""
    e = floor_log2(q)
    return e if Fraction(2) ** e == q else e + 1


def block_exponent(amax: float, fmt: ElementFormat, rule: str) -> int:
    """The unbiased scale exponent e (X = 2^e) for a finite block with max |V| = amax."""
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    if amax == 0:
        return -E8M0_BIAS
    if rule == "floor":
        e = floor_log2(Fraction(amax)) - fmt.emax
    else:
        e = ceil_log2(Fraction(amax) / Fraction(fmt.max_value))
    return min(max(e, -E8M0_BIAS), E8M0_BIAS)


def quantize_block(values: list[float], fmt: ElementFormat, rule: str) -> tuple[int, list[int]]:
    """One block of 32 values -> (E8M0 scale byte, element codes)."""
    if len(values) != BLOCK:
        raise ValueError(f"values must hold {BLOCK} elements, got {len(values)}")
    if not all(math.isfinite(v) for v in values):
        return E8M0_NAN, [0] * BLOCK
    e = block_exponent(max(abs(v) for v in values), fmt, rule)
    # Dividing by a power of two inside double range is exact.
    return e + E8M0_BIAS, [encode_element(v / 2.0**e, fmt) for v in values]


def dequantize_block(scale_byte: int, codes: list[int], fmt: ElementFormat) -> list[float]:
    x = e8m0_decode(scale_byte)
    decode = e2m1_decode if fmt.name == "e2m1" else e4m3_decode
    return [x * decode(c) for c in codes]


def _blocks(x: torch.Tensor) -> list[list[float]]:
    if x.shape[-1] % BLOCK != 0:
        raise ValueError(f"last dim must be a multiple of {BLOCK}, got shape {tuple(x.shape)}")
    return x.double().reshape(-1, BLOCK).tolist()


def _quantize(x: torch.Tensor, fmt: ElementFormat, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    scales, codes = [], []
    for block in _blocks(x):
        s, c = quantize_block(block, fmt, rule)
        scales.append(s)
        codes.append(c)
    shape = x.shape[:-1]
    scale = torch.tensor(scales, dtype=torch.uint8).reshape(*shape, x.shape[-1] // BLOCK)
    return torch.tensor(codes, dtype=torch.uint8).reshape(x.shape), scale


def _dequantize(codes: torch.Tensor, scale: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    flat_codes = codes.reshape(-1, BLOCK).tolist()
    out = [dequantize_block(s, c, fmt) for s, c in zip(scale.reshape(-1).tolist(), flat_codes)]
    return torch.tensor(out, dtype=torch.float64).reshape(codes.shape).float()


def pack_nibbles(codes: list[int]) -> list[int]:
    """E2M1 codes -> bytes, element 2j in the low nibble and 2j+1 in the high nibble."""
    return [codes[2 * j] | (codes[2 * j + 1] << 4) for j in range(len(codes) // 2)]


def unpack_nibbles(packed: list[int]) -> list[int]:
    return [nibble for byte in packed for nibble in (byte & 0xF, byte >> 4)]


def mxfp4_quantize(w: torch.Tensor, rule: str = "floor") -> tuple[torch.Tensor, torch.Tensor]:
    codes, scale = _quantize(w, E2M1, rule)
    packed = [pack_nibbles(row) for row in codes.reshape(-1, w.shape[-1]).tolist()]
    return torch.tensor(packed, dtype=torch.uint8).reshape(*w.shape[:-1], w.shape[-1] // 2), scale


def mxfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 [..., K] (values computed in double, then rounded once to float32)."""
    rows = [unpack_nibbles(row) for row in packed.reshape(-1, packed.shape[-1]).tolist()]
    codes = torch.tensor(rows, dtype=torch.uint8).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    return _dequantize(codes, scale, E2M1)


def mxfp8_quantize(x: torch.Tensor, rule: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 codes as uint8 [..., K] and scale bytes [..., K/32]."""
    return _quantize(x, E4M3, rule)


def mxfp8_dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return _dequantize(codes, scale, E4M3)


def mxfp4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, *,
                 act_quant: str | None = None) -> torch.Tensor:
    """``x [..., K] @ W^T`` with W = MXFP4(packed [N, K/2], scale [N, K/32]) -> ``[..., N]`` in x's dtype, in
    fp32: x MXFP8 round-tripped (rule ``act_quant``) first when given."""
    xf = x.float()
    if act_quant is not None:
        xf = mxfp8_dequantize(*mxfp8_quantize(xf, act_quant))
    return (xf @ mxfp4_dequantize(packed, scale).t()).to(x.dtype)
