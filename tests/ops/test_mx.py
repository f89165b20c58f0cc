"""MX formats: hand-worked spec vectors (checked against both the scalar reference and the vectorised
form), vectorised == naive bit for bit on random tensors, nibble order, round trips, mxfp4_linear, and the
checkpoint layout."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from safetensors.torch import load, save

from k3serve.ops import registry
from k3serve.ops.mx import (
    k3_quantization_config,
    mxfp4_dequantize,
    mxfp4_fake_quant,
    mxfp4_linear,
    mxfp4_quantize,
    mxfp8_dequantize,
    mxfp8_fake_quant,
    mxfp8_quantize,
    naive,
    pack_weight,
    unpack_weight,
)
from k3serve.ops.mx import linear as mx_linear

def _mxfp8_quantize_bytes(x: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    codes, scale = mxfp8_quantize(x, rule)
    return codes.view(torch.uint8), scale


IMPLS = {
    "naive": (naive.mxfp4_quantize, naive.mxfp8_quantize),
    "fast": (mxfp4_quantize, _mxfp8_quantize_bytes),
}


def fp4(impl: str, values: list[float], rule: str = "floor") -> tuple[list[int], int]:
    """One block (padded with zeros to 32) -> (E2M1 codes, scale byte)."""
    w = torch.tensor(values + [0.0] * (32 - len(values)), dtype=torch.float32)
    packed, scale = IMPLS[impl][0](w, rule)
    codes = [n for b in packed.tolist() for n in (b & 0xF, b >> 4)]
    return codes[: len(values)], scale.item()


def fp8(impl: str, values: list[float], rule: str = "rceil") -> tuple[list[int], int]:
    x = torch.tensor(values + [0.0] * (32 - len(values)), dtype=torch.float32)
    codes, scale = IMPLS[impl][1](x, rule)
    return codes.tolist()[: len(values)], scale.item()


def test_element_tables():
    assert [naive.e2m1_decode(c) for c in range(16)] == [
        0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6
    ]
    assert math.copysign(1, naive.e2m1_decode(8)) == -1
    assert naive.e4m3_decode(0x7E) == 448.0
    assert math.isnan(naive.e4m3_decode(0x7F)) and math.isnan(naive.e4m3_decode(0xFF))
    assert naive.e4m3_decode(0x08) == 2.0**-6  # smallest normal
    assert naive.e4m3_decode(0x01) == 2.0**-9  # smallest subnormal
    assert naive.e4m3_decode(0x07) == 7 * 2.0**-9
    assert naive.e4m3_decode(0x38) == 1.0 and naive.e4m3_decode(0xB9) == -1.125
    assert naive.e8m0_decode(127) == 1.0 and naive.e8m0_decode(0) == 2.0**-127
    assert naive.e8m0_decode(254) == 2.0**127 and math.isnan(naive.e8m0_decode(255))


def test_e4m3_element_encode():
    enc = lambda v: naive.encode_element(v, naive.E4M3)  # noqa: E731
    assert enc(2.0**-10) == 0x00  # tie between 0 and 2^-9: even code 0
    assert enc(3 * 2.0**-10) == 0x02  # tie between 2^-9 (code 1) and 2^-8 (code 2)
    assert enc(1 + 1 / 16) == 0x38 and enc(1 + 3 / 16) == 0x3A  # normal ties go to the even mantissa
    assert enc(464.0) == 0x7E and enc(1e9) == 0x7E and enc(-1e9) == 0xFE  # saturate
    assert enc(-0.0) == 0x80 and enc(-(2.0**-11)) == 0x80
    assert enc(math.nan) == 0x7F
    with pytest.raises(ValueError, match="finite"):
        naive.encode_element(math.inf, naive.E2M1)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("e", [-3, 0, 5])
def test_fp4_ties_and_subnormal(impl, e):
    # The anchor 4 * 2^e makes floor(log2 amax) - 2 = e, so X = 2^e and every value below is V/X exactly.
    ratios = [4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.3, 0.2, 1.5, -0.75, -5.0, -0.25]
    want = [6, 0, 2, 2, 4, 4, 6, 6, 1, 0, 3, 8 | 2, 8 | 6, 8 | 0]
    codes, scale = fp4(impl, [r * 2.0**e for r in ratios])
    assert scale == 127 + e
    assert codes == want


@pytest.mark.parametrize("impl", IMPLS)
def test_fp4_floor_saturates_rceil_does_not(impl):
    # amax 7.5: floor gives X = 1 (7.5 -> 6, saturated); rceil gives X = 2 (7.5/2 = 3.75 -> 4).
    codes, scale = fp4(impl, [7.5, 6.9, 1.0], "floor")
    assert (scale, codes) == (127, [7, 7, 2])
    codes, scale = fp4(impl, [7.5, 6.9, 1.0], "rceil")
    assert (scale, codes) == (128, [6, 5, 1])  # 3.45 -> 3, 0.5 -> subnormal code 1


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "value, rule, want_scale, want_code",
    [
        (1.0, "floor", 125, 6),  # X = 1/4, 1/X = 4
        (1.0, "rceil", 125, 6),
        (3.0, "floor", 126, 7),
        (5.0, "floor", 127, 6),  # 5 is a tie between 4 and 6: even code 6 (value 4)
        (5.0, "rceil", 127, 6),
        (7.0, "floor", 127, 7),  # saturates to 6
        (7.0, "rceil", 128, 6),  # 3.5 -> tie -> 4
    ],
)
def test_fp4_all_equal_blocks(impl, value, rule, want_scale, want_code):
    w = torch.full((32,), value)
    packed, scale = IMPLS[impl][0](w, rule)
    assert scale.tolist() == [want_scale]
    assert packed.tolist() == [want_code | want_code << 4] * 16


@pytest.mark.parametrize("impl", IMPLS)
def test_zero_blocks_and_negative_zero(impl):
    packed, scale = IMPLS[impl][0](torch.zeros(2, 64), "floor")
    assert scale.tolist() == [[0, 0], [0, 0]] and not packed.any()
    packed, scale = IMPLS[impl][0](torch.full((32,), -0.0), "floor")
    assert scale.tolist() == [0] and packed.tolist() == [0x88] * 16
    back = mxfp4_dequantize(packed, scale)
    assert not back.any() and torch.signbit(back).all()
    codes, scale = fp8(impl, [-0.0, 0.0, -(2.0**-40), 1.0])
    assert codes[:3] == [0x80, 0x00, 0x80]


@pytest.mark.parametrize("impl", IMPLS)
def test_scale_clamps_at_2_pow_minus_127(impl):
    # floor(log2(1.5 * 2^-126)) - 2 = -128, clamped to -127, so V/X = 3 (code 5) instead of 6.
    codes, scale = fp4(impl, [1.5 * 2.0**-126, 2.0**-140])
    assert (scale, codes) == (0, [5, 0])
    codes, scale = fp8(impl, [2.0**-130], "floor")
    assert (scale, codes) == (0, [0x20])  # 2^-3 = exponent field 4
    assert naive.block_exponent(2.0**200, naive.E2M1, "floor") == 127


@pytest.mark.parametrize("impl", IMPLS)
def test_fp8_floor_clips_rceil_does_not(impl):
    # floor: X = 2^(8 - 8) = 1 and 500 saturates to 448. rceil: X = 2, 250 -> 256 (0x78), 1 -> 0.5 (0x30).
    assert fp8(impl, [500.0, 1.0], "floor") == ([0x7E, 0x38], 127)
    assert fp8(impl, [500.0, 1.0], "rceil") == ([0x78, 0x30], 128)
    # rceil is exact at the boundary: amax = 448 keeps X = 1; the next float up needs X = 2.
    assert fp8(impl, [448.0], "rceil") == ([0x7E], 127)
    assert fp8(impl, [448.0 + 2.0**-15], "rceil")[1] == 128  # one float32 ulp above 448


@pytest.mark.parametrize("impl", IMPLS)
def test_non_finite_blocks(impl):
    for bad in (math.nan, math.inf, -math.inf):
        w = torch.ones(2, 64)
        w[1, 40] = bad
        packed, scale = IMPLS[impl][0](w, "floor")
        assert scale.tolist() == [[125, 125], [125, 255]]
        assert not packed[1, 16:].any() and packed[1, :16].tolist() == [0x66] * 16
        back = mxfp4_dequantize(packed, scale)
        assert back[1, 32:].isnan().all() and torch.equal(back[:, :32], torch.ones(2, 32))
        codes, scale = IMPLS[impl][1](w, "rceil")
        assert scale[1, 1] == 255 and not codes[1, 32:].any()
        assert mxfp8_dequantize(codes, scale)[1, 32:].isnan().all()


def test_nibble_order_known_byte():
    w = torch.zeros(1, 32)
    w[0, :4] = torch.tensor([0.5, 6.0, -0.5, 1.5])
    packed, scale = mxfp4_quantize(w)
    assert scale.tolist() == [[127]]
    assert packed[0, :2].tolist() == [0x71, 0x39]  # element 0 -> low nibble
    assert naive.pack_nibbles([1, 7, 9, 3]) == [0x71, 0x39]
    hand = torch.zeros(1, 16, dtype=torch.uint8)
    hand[0, 0] = 0x2C  # low nibble 0xC = -2, high nibble 0x2 = +1
    assert mxfp4_dequantize(hand, torch.tensor([[128]], dtype=torch.uint8))[0, :2].tolist() == [-4.0, 2.0]


def random_mx_input(shape: tuple[int, ...], seed: int, dtype=torch.float32) -> torch.Tensor:
    """Normal values scaled per block over 2^-130 .. 2^90, with zeros, signed zeros, subnormals and ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    block_exp = torch.randint(-130, 90, (*shape[:-1], shape[-1] // 32, 1), generator=g).float()
    x = (x.reshape(*shape[:-1], -1, 32) * torch.exp2(block_exp)).reshape(shape)
    flat = x.view(-1)
    picks = torch.randint(0, flat.numel(), (6, max(1, flat.numel() // 50)), generator=g)
    flat[picks[0]] = 0.0
    flat[picks[1]] = -0.0
    flat[picks[2]] = 2.0**-140
    flat[picks[3]] = flat[picks[3]].sign() * 2.0 ** flat[picks[3]].abs().log2().floor() * 1.25  # E2M1 ties
    flat[picks[4]] *= 2.0**30  # in-block dynamic range
    return x.to(dtype)


@pytest.mark.parametrize("shape", [(32,), (3, 64), (2, 3, 96), (5, 160)])
@pytest.mark.parametrize("rule", naive.RULES)
def test_fast_equals_naive_random(shape, rule):
    x = random_mx_input(shape, seed=sum(shape))
    if len(shape) == 2:
        x[0, 5] = math.nan
    p, s = mxfp4_quantize(x, rule)
    pn, sn = naive.mxfp4_quantize(x, rule)
    assert torch.equal(p, pn) and torch.equal(s, sn)
    exact = dict(rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(mxfp4_dequantize(p, s), naive.mxfp4_dequantize(pn, sn), **exact)
    c, s = mxfp8_quantize(x, rule)
    cn, sn = naive.mxfp8_quantize(x, rule)
    assert torch.equal(c.view(torch.uint8), cn) and torch.equal(s, sn)
    torch.testing.assert_close(mxfp8_dequantize(c, s), naive.mxfp8_dequantize(cn, sn), **exact)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fast_equals_naive_half_inputs(dtype):
    x = random_mx_input((4, 64), seed=7).clamp(-6e4, 6e4).to(dtype)
    for rule in naive.RULES:
        assert all(torch.equal(a, b) for a, b in zip(mxfp4_quantize(x, rule), naive.mxfp4_quantize(x, rule)))
        c, s = mxfp8_quantize(x, rule)
        assert torch.equal(c.view(torch.uint8), naive.mxfp8_quantize(x, rule)[0])
        assert mxfp8_fake_quant(x, rule).dtype == dtype


def test_fast_equals_naive_at_every_e4m3_midpoint():
    # Every midpoint between adjacent E4M3 magnitudes and the floats either side, in blocks pinned to X = 1.
    mags = torch.tensor(naive.E4M3.magnitudes, dtype=torch.float64)
    mids = ((mags[1:] + mags[:-1]) / 2).float()
    probes = torch.cat([mids, torch.nextafter(mids, torch.zeros_like(mids)), torch.nextafter(mids, mids * 2)])
    probes = torch.cat([probes, -probes])
    blocks = torch.cat([probes, torch.zeros(-probes.numel() % 31)]).reshape(-1, 31)
    x = torch.cat([torch.full((blocks.shape[0], 1), 448.0), blocks], dim=1)
    c, s = mxfp8_quantize(x, "rceil")
    cn, sn = naive.mxfp8_quantize(x, "rceil")
    assert (s == 127).all() and torch.equal(c.view(torch.uint8), cn) and torch.equal(s, sn)


@pytest.mark.parametrize("finite", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rule", naive.RULES)
def test_mxfp4_fake_quant_is_the_round_trip(rule, dtype, finite):
    # every scale from 2^-127 up, subnormals, signed zeros and E2M1 ties; with a NaN or inf block the whole
    # tensor takes the general path, and those blocks come back NaN
    big = torch.finfo(dtype).max
    w = random_mx_input((5, 3, 96), seed=11).clamp(-big, big)
    if not finite:
        w[0, 0, 3], w[1, 2, 40], w[4, 1, 95] = math.nan, math.inf, -math.inf
    w = w.to(dtype)
    fake = mxfp4_fake_quant(w, rule)
    want = mxfp4_dequantize(*mxfp4_quantize(w, rule), dtype=dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert fake.dtype == dtype and torch.equal(fake.view(bits), want.view(bits))
    assert fake.isnan().any() != finite


@pytest.mark.parametrize("rule", naive.RULES)
def test_round_trip_is_idempotent_and_bounded(rule):
    w = random_mx_input((8, 128), seed=3).clamp(-1e30, 1e30)
    w4 = mxfp4_dequantize(*mxfp4_quantize(w, rule))
    assert torch.equal(mxfp4_dequantize(*mxfp4_quantize(w4, rule)), w4)
    w8 = mxfp8_fake_quant(w, rule)
    assert torch.equal(mxfp8_fake_quant(w8, rule), w8)
    # Error bound per element: half the widest element step (1 * X for E2M1), plus the floor rule's
    # saturation of |V|/X in (6, 8) (2 * X).
    _, scale = mxfp4_quantize(w, rule)
    x_scale = torch.exp2(scale.float() - 127).repeat_interleave(32, dim=-1)
    bound = (2.0 if rule == "floor" else 1.0) * x_scale
    assert ((w4 - w).abs() <= bound).all()


def test_mxfp8_rceil_never_clips_floor_may():
    x = random_mx_input((16, 256), seed=11)
    for rule, clips in (("rceil", False), ("floor", True)):
        _, scale = mxfp8_quantize(x, rule)
        x_scale = torch.exp2(scale.double() - 127).repeat_interleave(32, dim=-1)
        ratio = x.double().abs() / x_scale
        assert bool((ratio > 448).any()) == clips
        assert (ratio < 512).all()


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act_quant", [None, "rceil", "floor"])
def test_mxfp4_linear_equals_dequant_matmul(monkeypatch, x_dtype, act_quant):
    # A tiny slab forces several slabs and a ragged last one.
    monkeypatch.setattr(mx_linear, "_SLAB_ELEMENTS", 5 * 96)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 96, generator=g) * 0.05
    packed, scale = mxfp4_quantize(w)
    x = torch.randn(2, 3, 96, generator=g).to(x_dtype)
    y = mxfp4_linear(x, packed, scale, act_quant=act_quant)
    xq = x if act_quant is None else mxfp8_fake_quant(x, act_quant)
    want = (xq.float() @ mxfp4_dequantize(packed, scale).t()).to(x_dtype)
    assert y.shape == (2, 3, 37) and y.dtype == x_dtype
    # Slabs may change the BLAS blocking, hence a tolerance; one bf16 ulp for the bf16 output.
    tol = dict(rtol=1e-5, atol=1e-6) if x_dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(y, want, **tol)
    if act_quant is not None:
        assert not torch.equal(y, mxfp4_linear(x, packed, scale))
    assert registry.get("mxfp4_linear", "torch") is mxfp4_linear
    assert registry.get("mxfp4_linear", "naive") is naive.mxfp4_linear


@pytest.mark.parametrize("act_quant", [None, "rceil"])
def test_mxfp4_linear_matches_naive(act_quant):
    g = torch.Generator().manual_seed(3)
    packed, scale = mxfp4_quantize(torch.randn(5, 64, generator=g) * 0.1)
    x = torch.randn(3, 64, generator=g)
    want = naive.mxfp4_linear(x, packed, scale, act_quant=act_quant)
    assert want.shape == (3, 5) and want.dtype == torch.float32
    torch.testing.assert_close(mxfp4_linear(x, packed, scale, act_quant=act_quant), want, rtol=1e-5, atol=1e-6)


def test_bad_input_raises_value_error():
    w = torch.randn(4, 64)
    packed, scale = mxfp4_quantize(w)
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4_quantize(torch.randn(4, 48))
    with pytest.raises(ValueError, match="rule"):
        mxfp8_quantize(w, "ceil")
    with pytest.raises(ValueError, match="float32"):
        mxfp4_quantize(w.double())
    with pytest.raises(ValueError, match="scale"):
        mxfp4_dequantize(packed, scale[:, :1])
    with pytest.raises(ValueError, match="x must"):
        mxfp4_linear(torch.randn(2, 32), packed, scale)
    with pytest.raises(ValueError, match="act_quant"):
        mxfp4_linear(torch.randn(2, 64), packed, scale, act_quant="even")
    with pytest.raises(ValueError, match="values"):
        naive.quantize_block([0.0] * 31, naive.E2M1, "floor")


def test_storage_is_4_25_bits_per_param():
    # K3 routed-expert w1/w3 logical shape [3072, 3584] (model.md §5.3).
    packed, scale = mxfp4_quantize(torch.randn(3072, 3584))
    assert packed.shape == (3072, 1792) and scale.shape == (3072, 112)
    bits = 8 * (packed.numel() * packed.element_size() + scale.numel() * scale.element_size()) / (3072 * 3584)
    assert bits == pytest.approx(4.25, rel=0.01)


def test_checkpoint_layout_round_trip():
    w = torch.randn(64, 96) * 0.02
    name = "language_model.model.layers.1.block_sparse_moe.experts.7.w2"
    tensors = pack_weight(name, w)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()} == {
        name + ".weight_packed": (torch.uint8, (64, 48)),
        name + ".weight_scale": (torch.uint8, (64, 3)),
    }
    loaded = load(save(tensors))
    back = unpack_weight(loaded, name, torch.float32)
    assert torch.equal(back, mxfp4_dequantize(*mxfp4_quantize(w)))
    assert torch.equal(unpack_weight(loaded, name), back.bfloat16())  # the bf16 table gives the same values
    with pytest.raises(ValueError, match="weight_scale"):
        unpack_weight({name + ".weight_packed": tensors[name + ".weight_packed"]}, name)


def test_k3_quantization_config():
    cfg = json.loads(json.dumps(k3_quantization_config()))
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "mxfp4-pack-quantized"
    group = cfg["config_groups"]["group_0"]
    assert group["input_activations"] is None and group["output_activations"] is None
    weights = group["weights"]
    assert (weights["num_bits"], weights["type"], weights["group_size"]) == (4, "float", 32)
    assert weights["symmetric"] is True and weights["strategy"] == "group"
    assert weights["scale_dtype"] == "torch.uint8"
    patterns = [re.compile(p.removeprefix("re:")) for p in cfg["ignore"]]
    ignored = lambda key: any(p.fullmatch(key) for p in patterns)  # noqa: E731
    layer = "language_model.model.layers.3"
    for key in (
        f"{layer}.self_attn.q_proj",
        f"{layer}.block_sparse_moe.shared_experts.down_proj",
        "language_model.model.layers.0.mlp.gate_proj",
        "language_model.lm_head",
        "vision_tower.encoder.blocks.0.wqkv",
        "mm_projector.proj.0",
    ):
        assert ignored(key), key
    for e, w in ((0, "w1"), (895, "w2"), (12, "w3")):
        assert not ignored(f"{layer}.block_sparse_moe.experts.{e}.{w}")
