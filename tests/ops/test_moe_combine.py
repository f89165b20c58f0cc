"""Grouped (padded bmm) routed-expert combine, dense and MXFP4, the segmented (per-expert GEMM) form and the
all-experts dense form, equal the per-token naive reference."""

from __future__ import annotations

import pytest
import torch

from k3serve.ops.activation import silu_and_mul, situ_and_mul
from k3serve.ops import registry
from k3serve.ops.moe import (dense_expert_combine, expert_combine, grouped_expert_combine, mxfp4_expert_combine,
                             naive_expert_combine, naive_mxfp4_expert_combine, segmented_expert_combine)
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


def _routed_case(N, E, k, D, I, seed):
    """Tokens, routing weights and distinct expert ids (at N = 65 expert 3 takes every token's first slot:
    skewed routing), and dense expert weights."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(N, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    if N == 65:
        ids[:, 0] = 3
    weights = torch.rand(N, k, generator=g)
    w13, w2 = torch.randn(E, 2 * I, D, generator=g) / D**0.5, torch.randn(E, D, I, generator=g) / I**0.5
    return u, weights, ids, w13, w2


@pytest.mark.parametrize("N,E,k,D,I", [(1, 4, 1, 8, 4), (7, 16, 4, 32, 12), (56, 16, 4, 24, 40), (65, 64, 8, 24, 40),
                                       (300, 8, 2, 16, 12)])
def test_grouped_swapped_weights_equal_naive(N, E, k, D, I):
    """The swapped contiguous weight copies (used whenever given, at any width per expert)
    give the naive result, also when only some experts are hit."""
    u, weights, ids, w13, w2 = _routed_case(N, E, k, D, I, seed=N + E + 7)
    got = grouped_expert_combine(u, weights, ids, w13, w2, silu_and_mul, w13_t=w13.mT.contiguous(),
                                 w2_t=w2.mT.contiguous())
    want = naive_expert_combine(u, weights, ids, w13, w2, silu_and_mul)
    assert ((got - want).norm() / want.norm()) < 1e-6
    assert (got - want).abs().max() < 1e-5 * max(1.0, float(want.abs().max()))


@pytest.mark.parametrize("N,E,k,D,I", [(1, 4, 1, 8, 4), (7, 16, 4, 32, 12), (65, 64, 8, 24, 40), (3, 8, 8, 16, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_equals_naive(N, E, k, D, I, dtype):
    g = torch.Generator().manual_seed(N * E + k + 1)
    u = torch.randn(N, D, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    weights = torch.rand(N, k, generator=g)
    w13 = (torch.randn(E, 2 * I, D, generator=g) / D**0.5).to(dtype)
    w2 = (torch.randn(E, D, I, generator=g) / I**0.5).to(dtype)
    got = dense_expert_combine(u, weights, ids, w13, w2, silu_and_mul)
    want = naive_expert_combine(u, weights, ids, w13, w2, silu_and_mul)
    assert got.dtype == torch.float32 and got.shape == (N, D)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got - want).abs().max() <= tol * max(1.0, float(want.abs().max()))


def test_dense_ignores_overflow_in_experts_not_picked():
    g = torch.Generator().manual_seed(3)
    N, E, k, D, I = 4, 8, 2, 16, 8
    u = torch.randn(N, D, generator=g)
    ids = torch.tensor([[0, 1]] * N)
    weights = torch.rand(N, k, generator=g)
    w13, w2 = torch.randn(E, 2 * I, D, generator=g), torch.randn(E, D, I, generator=g)
    w13[5] = 1e30  # expert 5 (never picked) overflows to inf
    got = dense_expert_combine(u, weights, ids, w13, w2, silu_and_mul)
    torch.testing.assert_close(got, naive_expert_combine(u, weights, ids, w13, w2, silu_and_mul), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("N", [2, 200, 300])
def test_expert_combine_picks_by_size(N, monkeypatch):
    import k3serve.ops.moe.dense as dense

    calls = []
    monkeypatch.setattr(dense, "dense_expert_combine", lambda *a, **kw: calls.append("dense") or dense_expert_combine(*a))
    monkeypatch.setattr(dense, "grouped_expert_combine",
                        lambda *a, **kw: calls.append("grouped") or grouped_expert_combine(*a, **kw))
    monkeypatch.setattr(dense, "segmented_expert_combine",
                        lambda *a, **kw: calls.append("segmented") or segmented_expert_combine(*a, **kw))
    g = torch.Generator().manual_seed(N)
    E, k, D, I = 16, 4, 16, 8
    u = torch.randn(N, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    weights = torch.rand(N, k, generator=g)
    w13, w2 = torch.randn(E, 2 * I, D, generator=g), torch.randn(E, D, I, generator=g)
    got = expert_combine(u, weights, ids, w13, w2, silu_and_mul)
    form = ("dense" if N * E <= dense.DENSE_MAX_ROWS else
            "segmented" if N >= dense.SEGMENTED_MIN_TOKENS else "grouped")
    assert calls == [form]
    torch.testing.assert_close(got, naive_expert_combine(u, weights, ids, w13, w2, silu_and_mul), rtol=1e-4, atol=1e-4)
    assert registry.get("expert_combine", "torch") is expert_combine


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


@pytest.mark.parametrize("N,E,k,D,I", [(1, 4, 1, 8, 4), (7, 16, 4, 32, 12), (65, 64, 8, 24, 40), (3, 8, 8, 16, 16),
                                       (300, 8, 2, 16, 12)])
@pytest.mark.parametrize("swapped", [False, True])
def test_segmented_equals_naive_and_grouped(N, E, k, D, I, swapped):
    """Per-expert GEMMs over exact token runs give the naive result (also with skewed routing, idle experts
    and the swapped weight copies), and on this build the padded bmm's bits."""
    u, weights, ids, w13, w2 = _routed_case(N, E, k, D, I, seed=N * 3 + E)
    swaps = dict(w13_t=w13.mT.contiguous(), w2_t=w2.mT.contiguous()) if swapped else {}
    got = segmented_expert_combine(u, weights, ids, w13, w2, silu_and_mul, **swaps)
    want = naive_expert_combine(u, weights, ids, w13, w2, silu_and_mul)
    assert got.dtype == torch.float32 and got.shape == (N, D)
    assert ((got - want).norm() / want.norm()) < 1e-6
    assert (got - want).abs().max() < 1e-5 * max(1.0, float(want.abs().max()))
    torch.testing.assert_close(got, grouped_expert_combine(u, weights, ids, w13, w2, silu_and_mul, **swaps),
                               rtol=1e-6, atol=1e-6)


def test_segmented_bf16_experts_equal_naive():
    g = torch.Generator().manual_seed(11)
    N, E, k, D, I = 40, 8, 2, 32, 16
    u = torch.randn(N, D, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    weights = torch.rand(N, k, generator=g)
    w13 = (torch.randn(E, 2 * I, D, generator=g) / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, I, generator=g) / I**0.5).bfloat16()
    got = segmented_expert_combine(u, weights, ids, w13, w2, silu_and_mul)
    want = naive_expert_combine(u, weights, ids, w13, w2, silu_and_mul)
    assert (got - want).abs().max() <= 2e-2 * max(1.0, float(want.abs().max()))


@pytest.mark.parametrize("combine", [segmented_expert_combine, grouped_expert_combine], ids=["segmented", "grouped"])
def test_under_autograd_equals_naive(combine):
    """Training runs both forms (segmented on CPU, grouped on a GPU): gradients to the tokens, the routing
    weights and both expert weights must match the naive reference's."""
    g = torch.Generator().manual_seed(5)
    N, E, k, D, I = 30, 8, 2, 16, 8
    u = torch.randn(N, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    ids[:, 0] = ids[:, 0].clamp(max=E - 2)  # leave the last expert unhit most of the time: a zero gradient there
    weights = torch.rand(N, k, generator=g)
    w13, w2 = torch.randn(E, 2 * I, D, generator=g) / D**0.5, torch.randn(E, D, I, generator=g) / I**0.5
    results = []
    for fn in (combine, naive_expert_combine):
        leaves = [t.clone().requires_grad_() for t in (u, weights, w13, w2)]
        out = fn(leaves[0], leaves[1], ids, leaves[2], leaves[3], silu_and_mul)
        probe = torch.linspace(-1, 1, out.numel()).view_as(out)
        results.append([out, *torch.autograd.grad((out * probe).sum(), leaves)])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
