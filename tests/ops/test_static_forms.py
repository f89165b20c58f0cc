"""The static decode step's fixed-shape forms against their references, on odd shapes, and capture-safe:
``ops/mla/masked.py`` (MLA decode over fixed-width block tables with a length mask) vs the naive per-sequence
decode and the paged chunked form, and ``ops/moe/gathered.py`` (each token's k experts gathered) vs the naive
per-token combine, dense and MXFP4. Each static form runs under ``CaptureCheck`` (it raises on any host sync);
the forms they replace do sync, which the check catches (so the check is not vacuous here)."""

from __future__ import annotations

import pytest
import torch

from k3serve.engine.capture_check import CaptureCheck, HostSyncError
from k3serve.ops.activation import silu_and_mul, situ_and_mul
from k3serve.ops.mla import mla_decode_absorbed, mla_decode_masked, naive_mla_decode, write_latents
from k3serve.ops.mla import masked
from k3serve.ops.moe import (gathered_expert_combine, gathered_mxfp4_expert_combine, grouped_expert_combine,
                             naive_expert_combine, naive_mxfp4_expert_combine)
from k3serve.ops.mx import mxfp4_quantize

H, DN, R, DV, C = 3, 8, 4, 6, 16
DIMS = dict(nope_dim=DN, v_dim=DV, scale=(DN + R) ** -0.5)


def _paged(lengths, width_blocks, bs, g):
    """A shuffled pool with each sequence's latents; tables ``[B, width_blocks]`` (-1 past a row's blocks)."""
    nblocks = [-(-n // bs) for n in lengths]
    cache = torch.randn(sum(nblocks) + 2, bs, C + R, generator=g)  # spare blocks hold junk
    perm = torch.randperm(cache.shape[0], generator=g)
    tables = torch.full((len(lengths), width_blocks), -1, dtype=torch.long)
    used = 0
    for i, (n, nb) in enumerate(zip(lengths, nblocks)):
        tables[i, :nb] = perm[used:used + nb]
        used += nb
        pos = torch.arange(n)
        write_latents(cache, tables[i, pos // bs] * bs + pos % bs, torch.randn(n, C + R, generator=g))
    return cache, tables


@pytest.mark.parametrize("lengths,bs,width", [([1], 4, 1), ([1], 3, 5), ([5, 1, 17, 8], 4, 6),
                                              ([33, 2, 16, 9, 30], 5, 7), ([7, 7, 1], 1, 9)])
@pytest.mark.parametrize("group", [1, 97, 1 << 20])  # one row per group .. the whole batch in one
def test_masked_mla_decode_matches_naive_and_paged(lengths, bs, width, group, monkeypatch):
    monkeypatch.setattr(masked, "MASKED_GROUP_ELEMENTS", group)
    g = torch.Generator().manual_seed(len(lengths) * 31 + bs)
    cache, tables = _paged(lengths, width, bs, g)
    kv_b = torch.randn(H * (DN + DV), C, generator=g) * 0.3
    q = torch.randn(len(lengths), H, DN + R, generator=g)
    lens = torch.tensor(lengths)
    with torch.inference_mode(), CaptureCheck("masked MLA decode"):
        got = mla_decode_masked(q, cache, tables, lens, kv_b, **DIMS)
    want = naive_mla_decode(q, cache, tables, lens, kv_b, **DIMS)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, mla_decode_absorbed(q, cache, tables, lens, kv_b, **DIMS), rtol=1e-5, atol=1e-5)


def test_masked_mla_ignores_junk_past_the_length():
    """Latents past a row's length (in its last block, or in block 0, which unused -1 columns gather) never
    reach the output (finite junk: as in the paged form, a masked NaN would still poison the value bmm)."""
    g = torch.Generator().manual_seed(5)
    cache, tables = _paged([6, 3], 4, 4, g)
    kv_b = torch.randn(H * (DN + DV), C, generator=g)
    q = torch.randn(2, H, DN + R, generator=g)
    lens = torch.tensor([6, 3])
    before = mla_decode_masked(q, cache, tables, lens, kv_b, **DIMS)
    cache[tables[0, 1], 2:] = 1e4  # row 0's positions 6, 7
    cache[tables[1, 0], 3:] = -3e3  # row 1's position 3
    used = set(tables[tables >= 0].tolist())
    if 0 not in used:
        cache[0] = 5e3  # block 0: what the -1 columns gather
    torch.testing.assert_close(mla_decode_masked(q, cache, tables, lens, kv_b, **DIMS), before, rtol=0, atol=0)


def test_paged_decode_is_not_capture_safe():
    g = torch.Generator().manual_seed(1)
    cache, tables = _paged([5, 9], 3, 4, g)
    kv_b = torch.randn(H * (DN + DV), C, generator=g)
    with pytest.raises(HostSyncError), torch.inference_mode(), CaptureCheck():
        mla_decode_absorbed(torch.randn(2, H, DN + R, generator=g), cache, tables, torch.tensor([5, 9]), kv_b, **DIMS)


def _routing(N, E, k, g):
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    return torch.rand(N, k, generator=g), ids


@pytest.mark.parametrize("N,E,k,D,I", [(1, 4, 1, 8, 4), (3, 16, 4, 32, 12), (5, 8, 8, 16, 16), (32, 64, 8, 24, 40)])
@pytest.mark.parametrize("act", ["silu", "situ"])
def test_gathered_equals_naive(N, E, k, D, I, act):
    g = torch.Generator().manual_seed(N * E + k)
    u = torch.randn(N, D, generator=g)
    weights, ids = _routing(N, E, k, g)
    w13, w2 = torch.randn(E, 2 * I, D, generator=g) / D**0.5, torch.randn(E, D, I, generator=g) / I**0.5
    glu = silu_and_mul if act == "silu" else (lambda a, b: situ_and_mul(a, b, 4.0, 25.0))
    with torch.inference_mode(), CaptureCheck("gathered combine"):
        got = gathered_expert_combine(u, weights, ids, w13, w2, glu)
    want = naive_expert_combine(u, weights, ids, w13, w2, glu)
    assert (got - want).abs().max() < 1e-5 * max(1.0, float(want.abs().max()))


@pytest.mark.parametrize("N,E,k,D,I", [(1, 4, 1, 32, 32), (6, 8, 4, 64, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act_quant", [None, "rceil"])
def test_gathered_mxfp4_equals_naive(N, E, k, D, I, dtype, act_quant):
    g = torch.Generator().manual_seed(N + E + k)
    u = torch.randn(N, D, generator=g).to(dtype)
    weights, ids = _routing(N, E, k, g)
    w13p, w13s = mxfp4_quantize(torch.randn(E, 2 * I, D, generator=g) / D**0.5)
    w2p, w2s = mxfp4_quantize(torch.randn(E, D, I, generator=g) / I**0.5)
    glu = lambda a, b: situ_and_mul(a, b, 4.0, 25.0)  # noqa: E731
    with torch.inference_mode(), CaptureCheck("gathered mxfp4 combine"):
        got = gathered_mxfp4_expert_combine(u, weights, ids, w13p, w13s, w2p, w2s, glu, act_quant=act_quant)
    want = naive_mxfp4_expert_combine(u, weights, ids, w13p, w13s, w2p, w2s, glu, act_quant=act_quant)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got - want).abs().max() <= tol * max(1.0, float(want.abs().max()))


def test_grouped_combine_is_not_capture_safe():
    g = torch.Generator().manual_seed(3)
    weights, ids = _routing(40, 16, 4, g)
    w13, w2 = torch.randn(16, 8, 8, generator=g), torch.randn(16, 8, 4, generator=g)
    with pytest.raises(HostSyncError), torch.inference_mode(), CaptureCheck():
        grouped_expert_combine(torch.randn(40, 8, generator=g), weights, ids, w13, w2, silu_and_mul)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_kda_decode_step_is_capture_safe(backend):
    """The KDA decode step (conv update, norms, gate, recurrence; states in place) is fixed-shape already: it
    runs under the check as it is, torch form and (where built) the native CPU kernel."""
    from k3serve.ops import native, registry

    if backend == "cpu" and not native.available():
        pytest.skip("native CPU kernels not built")
    N, H, K, W = 3, 2, 16, 4
    g = torch.Generator().manual_seed(11)
    qkv, conv_w = torch.randn(N, 3 * H * K, generator=g), torch.randn(3 * H * K, W, generator=g)
    conv_state, state = torch.randn(N, 3 * H * K, W - 1, generator=g), torch.randn(N, H, K, K, generator=g) * 0.1
    f, b = torch.randn(N, H, K, generator=g), torch.randn(N, H, generator=g)
    dt_bias, a_log = torch.randn(H * K, generator=g), torch.randn(H, generator=g)
    before = state.clone()
    with torch.inference_mode(), CaptureCheck("KDA decode step"):
        o = registry.get("kda_decode_step", backend)(qkv, conv_w, conv_state, f, dt_bias, a_log, b, state,
                                                     lower_bound=None)
    assert o.shape == (N, H, K) and not torch.equal(state, before)
