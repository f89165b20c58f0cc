"""Grouped (padded bmm) routed-expert combine, dense and MXFP4, equals the per-token naive reference."""

from __future__ import annotations

import pytest
import torch

from k3serve.layers.activation import situ_and_mul, silu_and_mul
from k3serve.ops.moe import (grouped_expert_combine, mxfp4_expert_combine, naive_expert_combine,
                             naive_mxfp4_expert_combine)
from k3serve.ops.mx import mxfp4_dequantize, mxfp4_quantize


@pytest.mark.parametrize("N,E,k,D,I", [(1, 4, 1, 8, 4), (7, 16, 4, 32, 12), (65, 64, 8, 24, 40), (3, 8, 8, 16, 16)])
@pytest.mark.parametrize("act", ["silu", "situ"])
def test_grouped_equals_naive(N, E, k, D, I, act):
    g = torch.Generator().manual_seed(N * E + k)
    u = torch.randn(N, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    if N == 65:  # skewed routing: many tokens on one expert, most experts idle
        ids[:, 0] = 3
    weights = torch.rand(N, k, generator=g)
    w13, w2 = torch.randn(E, 2 * I, D, generator=g) / D**0.5, torch.randn(E, D, I, generator=g) / I**0.5
    glu = silu_and_mul if act == "silu" else (lambda a, b: situ_and_mul(a, b, 4.0, 25.0))
    got = grouped_expert_combine(u, weights, ids, w13, w2, glu)
    want = naive_expert_combine(u, weights, ids, w13, w2, glu)
    # fp32 summation order differs (GEMM vs GEMV): compare relative to the output's scale
    assert ((got - want).norm() / want.norm()) < 1e-6
    assert (got - want).abs().max() < 1e-5 * max(1.0, float(want.abs().max()))


@pytest.mark.parametrize("N,E,k", [(1, 4, 2), (9, 16, 4), (40, 64, 8)])
@pytest.mark.parametrize("act_quant", [None, "rceil"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_grouped_equals_naive(N, E, k, act_quant, dtype, monkeypatch):
    import k3serve.ops.moe.grouped as grouped

    monkeypatch.setattr(grouped, "_DEQUANT_ELEMENTS", 3 * 64 * 32)  # several dequantisation groups
    g = torch.Generator().manual_seed(N + E)
    D, I = 64, 32
    u = torch.randn(N, D, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    weights = torch.rand(N, k, generator=g)
    w13p, w13s = mxfp4_quantize(torch.randn(E, 2 * I, D, generator=g) / D**0.5)
    w2p, w2s = mxfp4_quantize(torch.randn(E, D, I, generator=g) / I**0.5)
    glu = lambda a, b: situ_and_mul(a, b, 4.0, 25.0)  # noqa: E731
    got = mxfp4_expert_combine(u, weights, ids, w13p, w13s, w2p, w2s, glu, act_quant=act_quant)
    want = naive_mxfp4_expert_combine(u, weights, ids, w13p, w13s, w2p, w2s, glu, act_quant=act_quant)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got - want).abs().max() <= tol * max(1.0, float(want.abs().max()))
    if act_quant is None and dtype == torch.float32:  # and both equal the dense combine on dequantised weights
        dense = naive_expert_combine(u, weights, ids, mxfp4_dequantize(w13p, w13s), mxfp4_dequantize(w2p, w2s), glu)
        torch.testing.assert_close(got, dense, rtol=1e-5, atol=1e-5)
