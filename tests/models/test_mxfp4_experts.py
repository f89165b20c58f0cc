"""Routed experts stay packed in MXFP4 (4.25 bits/param resident) and compute what their dequantised
weights compute; MXFP8 activation emulation is switchable."""

from __future__ import annotations

import dataclasses

import torch

from k3serve.core.config import ModelConfig
from k3serve.layers.moe import RoutedExperts
from k3serve.models.generate import SimpleRunner
from k3serve.models.kimi import build_model, set_expert_act_quant
from k3serve.models.registry import packaged_config
from k3serve.models.writer import init_random_
from k3serve.ops.mx import mxfp4_dequantize


def _models():
    cfg = ModelConfig.from_file(packaged_config("k3-tiny"))
    packed = init_random_(build_model(cfg), seed=2).eval()
    dense = build_model(dataclasses.replace(cfg, experts_mxfp4=False)).eval()
    sd = {k: v for k, v in packed.state_dict().items() if "experts.w" not in k or "shared" in k}
    dense.load_state_dict(sd, strict=False)
    for a, b in zip(packed.modules(), dense.modules()):
        if isinstance(a, RoutedExperts):
            with torch.no_grad():
                b.w13.copy_(mxfp4_dequantize(a.w13_packed, a.w13_scale))
                b.w2.copy_(mxfp4_dequantize(a.w2_packed, a.w2_scale))
    return packed, dense


def test_resident_expert_bytes_are_4_25_bits_per_param():
    cfg = ModelConfig.from_file(packaged_config("k3-tiny"))
    model = build_model(cfg)
    experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    assert experts and all(m.mxfp4 for m in experts)
    params = sum(m.num_experts * 3 * m.width * m.inter for m in experts)
    resident = sum(b.numel() * b.element_size() for m in experts for b in m.buffers())
    assert not any(p.dtype.is_floating_point for m in experts for p in m.parameters())
    bits = 8 * resident / params
    assert abs(bits - 4.25) / 4.25 <= 0.01, bits


def test_packed_experts_equal_dequantised_weights():
    packed, dense = _models()
    ids = list(range(40, 80))
    a = SimpleRunner(packed, max_seqs=1, max_len=48).step({0: ids})
    b = SimpleRunner(dense, max_seqs=1, max_len=48).step({0: ids})
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_mxfp8_activation_emulation_switches():
    packed, _ = _models()
    ids = list(range(10, 40))
    off = SimpleRunner(packed, max_seqs=1, max_len=32).step({0: ids})
    set_expert_act_quant(packed, "rceil")
    on = SimpleRunner(packed, max_seqs=1, max_len=32).step({0: ids})
    set_expert_act_quant(packed, None)
    assert not torch.equal(on, off)  # the fake-quant really runs
    assert (on.softmax(-1) - off.softmax(-1)).abs().max() < 0.05  # and stays a small perturbation
