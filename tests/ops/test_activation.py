"""The gated activations (SiLU, K3's soft-capped SiTU): torch forms against the element-by-element reference on
odd shapes, fp32 and bf16, across the soft caps."""

from __future__ import annotations

import pytest
import torch

from k3serve.ops import registry
from k3serve.ops.activation import naive_silu_and_mul, naive_situ_and_mul, silu_and_mul, situ_and_mul

TOL = {torch.float32: dict(rtol=2e-6, atol=2e-6), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


def _inputs(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    # wide ranges, so both soft caps (beta = 4 on the gate, 25 on up) saturate somewhere
    return (torch.randn(shape, generator=gen) * 8).to(dtype), (torch.randn(shape, generator=gen) * 40).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (13, 7), (2, 3, 17)])
def test_silu_and_mul_matches_naive(shape, dtype):
    gate, up = _inputs(shape, dtype, 0)
    got, want = silu_and_mul(gate, up), naive_silu_and_mul(gate, up)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("beta,linear_beta", [(1.0, None), (4.0, None), (4.0, 25.0)])
@pytest.mark.parametrize("shape", [(1, 1), (13, 7), (2, 3, 17)])
def test_situ_and_mul_matches_naive(shape, beta, linear_beta, dtype):
    gate, up = _inputs(shape, dtype, 1)
    got, want = situ_and_mul(gate, up, beta, linear_beta), naive_situ_and_mul(gate, up, beta, linear_beta)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    # the magnitudes reach beta * linear_beta = 100, so the fp32 tolerance is relative to that scale
    torch.testing.assert_close(got, want, **(dict(rtol=2e-6, atol=2e-5) if dtype == torch.float32 else TOL[dtype]))
    if linear_beta is not None:
        assert got.float().abs().max() <= beta * linear_beta


def test_registered_backends():
    assert registry.get("silu_and_mul", "torch") is silu_and_mul
    assert registry.get("silu_and_mul", "naive") is naive_silu_and_mul
    assert registry.get("situ_and_mul", "torch") is situ_and_mul
    assert registry.get("situ_and_mul", "naive") is naive_situ_and_mul
