"""RMSNorm and the gated RMSNorm: the torch forms against the row-by-row reference on odd shapes and dtypes, and
a packed batch of sequences against each sequence alone."""

from __future__ import annotations

import pytest
import torch

from k3serve.ops import registry
from k3serve.ops.norm import gated_rms_norm, naive_gated_rms_norm, naive_rms_norm, rms_norm

SHAPES = [(1, 1), (7, 5), (3, 11, 33), (2, 1, 64)]
TOL = {torch.float32: dict(rtol=2e-6, atol=2e-6), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


def _inputs(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    z = (torch.randn(shape, generator=gen) * 2).to(dtype)
    return x, z, torch.randn(shape[-1], generator=gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_matches_naive(shape, dtype):
    x, _, w = _inputs(shape, dtype, 0)
    w = w.to(dtype)
    got, want = rms_norm(x, w, 1e-6), naive_rms_norm(x, w, 1e-6)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape == x.shape
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_gated_rms_norm_matches_naive(shape, dtype):
    x, z, w = _inputs(shape, dtype, 1)  # the weight stays fp32, as the KDA output norm keeps it
    got, want = gated_rms_norm(x, z, w, 1e-5), naive_gated_rms_norm(x, z, w, 1e-5)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape == x.shape
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_eps_dominates_a_zero_row():
    x = torch.zeros(2, 8)
    torch.testing.assert_close(rms_norm(x, torch.ones(8), 1e-6), naive_rms_norm(x, torch.ones(8), 1e-6))
    assert torch.equal(rms_norm(x, torch.ones(8), 1e-6), torch.zeros(2, 8))


def test_packed_rows_match_each_sequence_alone():
    # to the last bit or so: vectorised tails may round a row differently when the batch around it changes
    x, z, w = _inputs((17, 24), torch.float32, 2)
    cu = [0, 1, 6, 6, 17]
    packed, gated = rms_norm(x, w, 1e-6), gated_rms_norm(x, z, w, 1e-6)
    for a, b in zip(cu[:-1], cu[1:]):
        torch.testing.assert_close(packed[a:b], rms_norm(x[a:b], w, 1e-6), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(gated[a:b], gated_rms_norm(x[a:b], z[a:b], w, 1e-6), rtol=1e-6, atol=1e-6)


def test_registered_backends():
    assert registry.get("rms_norm", "torch") is rms_norm
    assert registry.get("rms_norm", "naive") is naive_rms_norm
    assert registry.get("gated_rms_norm", "torch") is gated_rms_norm
    assert registry.get("gated_rms_norm", "naive") is naive_gated_rms_norm
