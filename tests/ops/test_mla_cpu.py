"""The native CPU MLA decode kernel against the naive reference and the torch decode: odd head counts and
widths, paged tables with shuffled non-contiguous blocks, varying lengths (empty, one block, partial blocks),
and the fallbacks when the kernel does not apply."""

from __future__ import annotations

import pytest
import torch

from k3serve.ops import native, registry
from k3serve.ops.mla import cpu as mla_cpu
from k3serve.ops.mla import mla_decode_absorbed, mla_decode_cpu, naive_mla_attention, write_latents

pytestmark = pytest.mark.skipif(not native.available(), reason="native CPU kernels not built")


def _paged(lengths: list[int], bs: int, width: int, g: torch.Generator):
    """A shuffled block pool (spare blocks hold junk) with each sequence's latents; tables padded with -1."""
    nblocks = [-(-n // bs) for n in lengths]
    cache = torch.randn(sum(nblocks) + 3, bs, width, generator=g)
    perm = torch.randperm(cache.shape[0], generator=g)
    tables = torch.full((len(lengths), max(nblocks) + 2), -1, dtype=torch.long)
    lats, used = [], 0
    for i, (n, nb) in enumerate(zip(lengths, nblocks)):
        tables[i, :nb] = perm[used:used + nb]
        used += nb
        lat = torch.randn(n, width, generator=g)
        pos = torch.arange(n)
        write_latents(cache, tables[i, pos // bs] * bs + pos % bs, lat)
        lats.append(lat)
    return cache, tables, lats


@pytest.mark.parametrize("H,DN,R,DV,C,BS", [(3, 8, 4, 6, 16, 4), (4, 32, 16, 32, 64, 16), (5, 7, 0, 9, 19, 3),
                                            (1, 12, 5, 3, 33, 1)])
@pytest.mark.parametrize("lengths", [[1], [5, 1, 17, 8], [33, 2, 16, 9, 30, 100]])
def test_matches_naive_and_torch(H, DN, R, DV, C, BS, lengths) -> None:
    g = torch.Generator().manual_seed(len(lengths) * 7 + H)
    cache, tables, lats = _paged(lengths, BS, C + R, g)
    kv_b = torch.randn(H * (DN + DV), C, generator=g) * 0.3
    q = torch.randn(len(lengths), H, DN + R, generator=g) * 2
    dims = dict(nope_dim=DN, v_dim=DV, scale=(DN + R) ** -0.5)
    got = mla_decode_cpu(q, cache, tables, torch.tensor(lengths), kv_b, **dims)
    torch.testing.assert_close(got, mla_decode_absorbed(q, cache, tables, torch.tensor(lengths), kv_b, **dims),
                               rtol=1e-5, atol=1e-5)
    for i, lat in enumerate(lats):  # per sequence against the spec
        torch.testing.assert_close(got[i:i + 1], naive_mla_attention(q[i:i + 1], lat, kv_b, **dims),
                                   rtol=1e-5, atol=1e-5)


def test_rows_of_a_batch_are_independent() -> None:
    """The kernel's output for a sequence does not depend on its batch neighbours: the packed call equals
    per-sequence calls bit for bit (fixed summation order)."""
    g = torch.Generator().manual_seed(3)
    lengths = [40, 3, 17]
    cache, tables, _ = _paged(lengths, 8, 24, g)
    q = torch.randn(3, 2, 24, generator=g)
    lens = torch.tensor(lengths)

    def run(rows: slice) -> torch.Tensor:
        t, n = tables[rows].contiguous(), lens[rows].contiguous()
        out = torch.empty(t.shape[0], 2, 16)
        native.kernels.mla_decode(q[rows].contiguous().data_ptr(), cache.data_ptr(), t.data_ptr(), n.data_ptr(),
                               out.data_ptr(), t.shape[0], 2, 24, 16, cache.shape[0], 8, t.shape[1])
        return out

    packed = run(slice(None))
    for i in range(3):
        assert torch.equal(packed[i:i + 1], run(slice(i, i + 1)))


def test_large_scores_and_empty_context() -> None:
    """Scores far apart (softmax max subtraction) stay finite; a zero-length context gives zeros."""
    g = torch.Generator().manual_seed(4)
    cache, tables, lats = _paged([12, 1], 4, 20, g)
    kv_b = torch.randn(2 * 16, 16, generator=g)
    q = torch.randn(2, 2, 12, generator=g) * 60
    dims = dict(nope_dim=8, v_dim=8, scale=1.0)
    got = mla_decode_cpu(q, cache, tables, torch.tensor([12, 1]), kv_b, **dims)
    torch.testing.assert_close(got[:1], naive_mla_attention(q[:1], lats[0], kv_b, **dims), rtol=1e-5, atol=1e-4)
    empty = mla_decode_cpu(q, cache, tables, torch.tensor([12, 0]), kv_b, **dims)
    assert torch.equal(empty[1], torch.zeros_like(empty[1]))


def test_bad_table_is_refused() -> None:
    g = torch.Generator().manual_seed(5)
    cache, tables, _ = _paged([9], 4, 20, g)
    kv_b = torch.randn(2 * 16, 16, generator=g)
    q = torch.randn(1, 2, 12, generator=g)
    tables[0, 1] = cache.shape[0]
    with pytest.raises(IndexError):
        mla_decode_cpu(q, cache, tables, torch.tensor([9]), kv_b, nope_dim=8, v_dim=8, scale=1.0)


def test_falls_back_for_bf16_and_grad(monkeypatch) -> None:
    g = torch.Generator().manual_seed(6)
    cache, tables, _ = _paged([9, 4], 4, 20, g)
    kv_b = torch.randn(2 * 16, 16, generator=g)
    q = torch.randn(2, 2, 12, generator=g)
    dims = dict(nope_dim=8, v_dim=8, scale=0.5)
    lens = torch.tensor([9, 4])
    bf = cache.bfloat16()
    assert torch.equal(mla_decode_cpu(q, bf, tables, lens, kv_b, **dims),
                       mla_decode_absorbed(q, bf, tables, lens, kv_b, **dims))
    monkeypatch.setattr(mla_cpu, "mla_decode_absorbed", lambda *a, **k: "torch")
    assert mla_decode_cpu(q, cache, tables, lens, kv_b.clone().requires_grad_(), **dims) == "torch"
    with torch.no_grad():  # no gradient recorded: the kernel serves
        assert isinstance(mla_decode_cpu(q, cache, tables, lens, kv_b.clone().requires_grad_(), **dims), torch.Tensor)


def test_registered_and_active() -> None:
    assert registry.get("mla_decode", "cpu") is mla_decode_cpu
    assert registry.active("mla_decode") == "cpu"
