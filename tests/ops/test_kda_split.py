"""A prefill cut at a snapshot position (two calls, fp32 state carried) equals one uncut run, and its
snapshot equals the state of the prefix alone (torch chunk form vs the naive recurrence)."""

from __future__ import annotations

import pytest
import torch

from k3serve.ops.kda import chunk_kda, chunk_kda_split, naive_recurrent_kda


def kda_inputs(lens, H=2, K=16, V=8, seed=0):
    """Packed q, k (L2-normalised), v, g (log decay), beta for sequences of ``lens``, their cu_seqlens and a
    random fp32 initial state."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    v = torch.randn(1, T, H, V, generator=gen)
    g = -torch.rand(1, T, H, K, generator=gen) * 0.3
    beta = torch.rand(1, T, H, generator=gen)
    cu = torch.tensor([0, *lens]).cumsum(0)
    s0 = torch.randn(len(lens), H, K, V, generator=gen) * 0.1
    return q, k, v, g, beta, cu, s0


def check_split(chunk, lens, split_at, device="cpu", atol=2e-5):
    q, k, v, g, beta, cu, s0 = kda_inputs(lens)
    want_o, want_final = naive_recurrent_kda(q, k, v, g, beta, initial_state=s0, cu_seqlens=cu)
    on = [t.to(device) for t in (q, k, v, g, beta, cu, s0)]
    o, snaps, final = chunk_kda_split(*on[:5], split_at=split_at, initial_state=on[6], cu_seqlens=on[5],
                                      chunk=chunk)
    assert torch.allclose(o.cpu(), want_o, atol=atol) and torch.allclose(final.cpu(), want_final, atol=atol)
    for i, p in enumerate(split_at):  # the snapshot is the prefix's own final state
        s = int(cu[i])
        _, prefix = naive_recurrent_kda(*(t[:, s:s + p] for t in (q, k, v, g, beta)), initial_state=s0[i:i + 1])
        assert torch.allclose(snaps[i].cpu(), prefix[0], atol=atol)


@pytest.mark.parametrize("lens,split_at", [([37, 5, 70], [16, 0, 70]), ([1], [1]), ([66, 3], [33, 2])])
def test_split_equals_uncut_and_prefix(lens, split_at):
    check_split(chunk_kda, lens, split_at)


def test_split_checks_positions():
    q, k, v, g, beta, cu, s0 = kda_inputs([4, 4])
    with pytest.raises(ValueError, match="split_at"):
        chunk_kda_split(q, k, v, g, beta, split_at=[5, 0], cu_seqlens=cu)
