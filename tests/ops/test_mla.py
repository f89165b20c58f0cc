"""Paged MLA (expanded prefill, absorbed batched decode) against the naive per-head reference."""

from __future__ import annotations

import pytest
import torch

from k3serve.ops import registry
from k3serve.ops.mla import packed, paged
from k3serve.ops.mla import (gather_latents, mla_decode_absorbed, mla_prefill, mla_prefill_bucketed, mla_prefill_loop,
                             naive_mla_attention, naive_mla_decode, naive_mla_prefill_packed, write_latents)

H, DN, R, DV, C, BS = 3, 8, 4, 6, 16, 4
DIMS = dict(nope_dim=DN, v_dim=DV, scale=(DN + R) ** -0.5)


def _paged(lengths: list[int], g: torch.Generator, dtype=torch.float32):
    """A shuffled block pool holding each sequence's latents; returns cache, block tables, per-sequence latents."""
    nblocks = [-(-n // BS) for n in lengths]
    cache = torch.randn(sum(nblocks) + 3, BS, C + R, generator=g).to(dtype)  # spare blocks hold junk
    perm = torch.randperm(cache.shape[0], generator=g)
    tables = torch.full((len(lengths), max(nblocks)), -1, dtype=torch.long)
    lats, used = [], 0
    for i, (n, nb) in enumerate(zip(lengths, nblocks)):
        tables[i, :nb] = perm[used:used + nb]
        used += nb
        lat = torch.randn(n, C + R, generator=g).to(dtype)
        pos = torch.arange(n)
        write_latents(cache, tables[i, pos // BS] * BS + pos % BS, lat)
        lats.append(lat)
    return cache, tables, lats


@pytest.mark.parametrize("lengths", [[1], [5, 1, 17, 8], [33, 2, 16, 9, 30]])
@pytest.mark.parametrize("with_workspace", [False, True])
@pytest.mark.parametrize("chunk", [1, 200, 1 << 18])  # one sequence per chunk .. the whole batch in one
def test_decode_matches_naive(lengths: list[int], with_workspace: bool, chunk: int, monkeypatch) -> None:
    monkeypatch.setattr(paged, "DECODE_CHUNK_ELEMENTS", chunk)
    g = torch.Generator().manual_seed(0)
    cache, tables, lats = _paged(lengths, g)
    kv_b = torch.randn(H * (DN + DV), C, generator=g) * 0.3
    q = torch.randn(len(lengths), H, DN + R, generator=g)
    need = paged.decode_workspace_numel(max(lengths), BS, C + R)
    work = torch.full((need,), float("nan")) if with_workspace else None  # stale contents must not leak
    got = mla_decode_absorbed(q, cache, tables, torch.tensor(lengths), kv_b, workspace=work, **DIMS)
    for i, lat in enumerate(lats):
        torch.testing.assert_close(gather_latents(cache, tables[i], lengths[i]), lat, rtol=0, atol=0)
        want = naive_mla_attention(q[i:i + 1], lat, kv_b, **DIMS)
        torch.testing.assert_close(got[i:i + 1], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 200, 1 << 18])
def test_decode_shared_plan(chunk: int, monkeypatch) -> None:
    """One plan, computed once for the tables and lengths, serves two layers' caches and queries exactly as
    if each call planned for itself."""
    monkeypatch.setattr(paged, "DECODE_CHUNK_ELEMENTS", chunk)
    g = torch.Generator().manual_seed(2)
    lengths = [33, 2, 16, 9, 30]
    cache_a, tables, _ = _paged(lengths, g)
    cache_b = torch.randn(cache_a.shape, generator=g)
    plan = paged.plan_decode(tables, torch.tensor(lengths), BS, C + R)
    for cache in (cache_a, cache_b):
        kv_b = torch.randn(H * (DN + DV), C, generator=g) * 0.3
        q = torch.randn(len(lengths), H, DN + R, generator=g)
        want = mla_decode_absorbed(q, cache, tables, torch.tensor(lengths), kv_b, **DIMS)
        got = mla_decode_absorbed(q, cache, tables, torch.tensor(lengths), kv_b, plan=plan, **DIMS)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_decode_small_workspace_and_bf16_cache() -> None:
    g = torch.Generator().manual_seed(1)
    lengths = [9, 3]
    cache, tables, lats = _paged(lengths, g, torch.bfloat16)
    kv_b = torch.randn(H * (DN + DV), C, generator=g) * 0.3
    q = torch.randn(2, H, DN + R, generator=g)
    got = mla_decode_absorbed(q, cache, tables, torch.tensor(lengths), kv_b, workspace=torch.empty(4), **DIMS)
    for i, lat in enumerate(lats):
        want = naive_mla_attention(q[i:i + 1], lat.float(), kv_b, **DIMS)
        torch.testing.assert_close(got[i:i + 1], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T", [1, 5, 12])
@pytest.mark.parametrize("tile", [1, 3 * 12 * 5, 1 << 20])  # one query per tile .. all queries in one
def test_prefill_matches_naive(T: int, tile: int, monkeypatch) -> None:
    monkeypatch.setattr(paged, "PREFILL_SCORE_ELEMENTS", tile)
    g = torch.Generator().manual_seed(2)
    L = 12
    lat = torch.randn(L, C + R, generator=g)
    kv_b = torch.randn(H * (DN + DV), C, generator=g) * 0.3
    q = torch.randn(T, H, DN + R, generator=g)
    torch.testing.assert_close(mla_prefill(q, lat, kv_b, **DIMS), naive_mla_attention(q, lat, kv_b, **DIMS),
                               rtol=1e-5, atol=1e-5)


def test_registered_backends() -> None:
    assert registry.get("mla_decode", "torch") is mla_decode_absorbed
    assert registry.get("mla_prefill", "torch") is mla_prefill
    assert registry.get("mla_prefill_packed", "torch") is mla_prefill_loop
    assert registry.get("mla_prefill_packed", "bucketed") is mla_prefill_bucketed
    assert registry.get("mla_prefill", "naive") is naive_mla_attention
    assert registry.get("mla_prefill_packed", "naive") is naive_mla_prefill_packed
    assert registry.get("mla_decode", "naive") is naive_mla_decode


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_naive_decode_reads_the_paged_cache(dtype) -> None:
    """The naive paged decode (position by position from block and offset) against the naive attention over
    each sequence's own latents, and the torch decode against it."""
    g = torch.Generator().manual_seed(7)
    lengths = [1, 6, 13]
    cache, tables, lats = _paged(lengths, g, dtype)
    kv_b = torch.randn(H * (DN + DV), C, generator=g) * 0.3
    q = torch.randn(len(lengths), H, DN + R, generator=g)
    got = naive_mla_decode(q, cache, tables, torch.tensor(lengths), kv_b, **DIMS)
    for i, lat in enumerate(lats):
        torch.testing.assert_close(got[i:i + 1], naive_mla_attention(q[i:i + 1], lat, kv_b, **DIMS), rtol=0, atol=0)
    torch.testing.assert_close(mla_decode_absorbed(q, cache, tables, torch.tensor(lengths), kv_b, **DIMS), got,
                               rtol=1e-5, atol=1e-5)


def test_naive_packed_prefill_is_per_sequence() -> None:
    g = torch.Generator().manual_seed(8)
    lens = [3, 1, 7]
    cu = torch.tensor([0, 3, 4, 11])
    q, lat = torch.randn(11, H, DN + R, generator=g), torch.randn(11, C + R, generator=g)
    kv_b = torch.randn(H * (DN + DV), C, generator=g) * 0.3
    got = naive_mla_prefill_packed(q, lat, cu, kv_b, **DIMS)
    assert got.shape == (sum(lens), H, DV)
    torch.testing.assert_close(mla_prefill_loop(q, lat, cu, kv_b, **DIMS), got, rtol=1e-5, atol=1e-5)


def test_buckets_bound_padding() -> None:
    lens = [3, 40, 1, 17, 17, 90, 2, 60, 8]
    groups = packed.buckets(lens, waste=1.5)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    for g in groups:
        assert lens[g[0]] == max(lens[i] for i in g)  # the bucket pads to its first (longest) sequence
        assert len(g) * lens[g[0]] <= 1.5 * sum(lens[i] for i in g)
    assert packed.buckets([5, 5, 5], waste=1.0) == [[0, 1, 2]]


@pytest.mark.parametrize("lengths", [[1], [7], [5, 1, 17, 8, 2], [33, 2, 16, 9, 30, 31]])
@pytest.mark.parametrize("waste", [1.0, 1.5, 100.0])  # a bucket per length .. one bucket for all
def test_packed_prefill_bucketed_matches_loop(lengths: list[int], waste: float) -> None:
    """Packed sequences, bucketed and right-padded, against each sequence alone: values and gradients."""
    g = torch.Generator().manual_seed(3)
    N = sum(lengths)
    cu = torch.tensor([0, *lengths]).cumsum(0)
    kv_b = (torch.randn(H * (DN + DV), C, generator=g) * 0.3).requires_grad_()
    q = torch.randn(N, H, DN + R, generator=g, requires_grad=True)
    lat = torch.randn(N, C + R, generator=g, requires_grad=True)
    w = torch.randn(N, H, DV, generator=g)
    outs, grads = [], []
    for fn in (mla_prefill_loop, lambda *a, **k: mla_prefill_bucketed(*a, **k, waste=waste)):
        o = fn(q, lat, cu, kv_b, **DIMS)
        (o * w).sum().backward()
        outs.append(o.detach())
        grads.append([t.grad.clone() for t in (q, lat, kv_b)])
        for t in (q, lat, kv_b):
            t.grad = None
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # and the loop is the per-sequence spec
    a, b = int(cu[-2]), int(cu[-1])
    torch.testing.assert_close(outs[0][a:b], naive_mla_attention(q[a:b].detach(), lat[a:b].detach(), kv_b.detach(),
                                                                 **DIMS), rtol=1e-5, atol=1e-5)
