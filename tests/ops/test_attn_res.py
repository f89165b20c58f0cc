"""The Block AttnRes mix: the torch form against the token-by-token reference for 1..5 sources and odd sizes,
and a packed batch of sequences against each sequence alone (the mix is per token)."""

from __future__ import annotations

import pytest
import torch

from k3serve.ops import registry
from k3serve.ops.attn_res import attn_res_mix, naive_attn_res_mix


def _inputs(sources, n, d, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    vs = [(torch.randn(n, d, generator=gen) * (1 + 2 * i)).to(dtype) for i in range(sources)]
    return vs[:-1], vs[-1], torch.randn(1, d, generator=gen) * 3, torch.randn(d, generator=gen)


@pytest.mark.parametrize("sources", [2, 3, 5])
@pytest.mark.parametrize("n,d", [(1, 1), (7, 5), (13, 64)])
def test_mix_matches_naive(sources, n, d):
    blocks, partial, pw, nw = _inputs(sources, n, d, seed=sources + n + d)
    got, want = attn_res_mix(blocks, partial, pw, nw, 1e-5), naive_attn_res_mix(blocks, partial, pw, nw, 1e-5)
    assert got.shape == want.shape == partial.shape and got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-5)


def test_mix_in_bf16_matches_naive():
    blocks, partial, pw, nw = _inputs(4, 9, 33, torch.bfloat16, seed=3)
    got, want = attn_res_mix(blocks, partial, pw, nw, 1e-5), naive_attn_res_mix(blocks, partial, pw, nw, 1e-5)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=2e-2)


def test_without_blocks_the_mix_is_the_partial_sum():
    _, partial, pw, nw = _inputs(1, 4, 8)
    assert attn_res_mix([], partial, pw, nw, 1e-5) is partial
    assert naive_attn_res_mix([], partial, pw, nw, 1e-5) is partial


def test_packed_tokens_match_each_sequence_alone():
    # to the last bit or so: vectorised tails may round a token differently when the batch around it changes
    blocks, partial, pw, nw = _inputs(3, 17, 24, seed=4)
    packed = attn_res_mix(blocks, partial, pw, nw, 1e-5)
    cu = [0, 1, 6, 6, 17]
    for a, b in zip(cu[:-1], cu[1:]):
        alone = attn_res_mix([t[a:b] for t in blocks], partial[a:b], pw, nw, 1e-5)
        torch.testing.assert_close(packed[a:b], alone, rtol=1e-6, atol=1e-6)


def test_registered_backends():
    assert registry.get("attn_res_mix", "torch") is attn_res_mix
    assert registry.get("attn_res_mix", "naive") is naive_attn_res_mix
