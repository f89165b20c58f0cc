"""Resharding a request's cache rows between the full (tp 1) layout and tp-N shards (engine/pd/reshard.py):
gather(scatter(x)) == x, the fast slicing equals the channel-by-channel reference, and the shards equal what
real tp-2 ranks (each a model loaded with its own shard of the checkpoint) hold after the same chunked prefill
and decode step, for both KDA flavours. A flat slice of the q|k|v conv window (sglang#22060) fails that check."""

from __future__ import annotations

import pytest
import torch

from k3serve.core.context import ForwardContext, ModelCaches
from k3serve.core.distributed import Parallel, ParallelLayout
from k3serve.engine.pd import reshard
from k3serve.layers.kda import KimiDeltaAttention
from k3serve.models.loader import load_model
from k3serve.models.registry import resolve_model_path

MODELS = ["k3-tiny-random", "kimi-linear-tiny-random"]


def _items(num_heads: int = 8, head_dim: int = 4, window: int = 3, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    P = num_heads * head_dim
    return {"kda_state.0": torch.randn(num_heads, head_dim, head_dim, generator=g),
            "kda_conv.0": torch.randn(3 * P, window, generator=g).to(torch.bfloat16),
            "mla.1": torch.randn(5, 7, generator=g),
            "generator": torch.arange(10, dtype=torch.uint8)}


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_gather_of_scatter_is_identity_and_matches_reference(tp: int) -> None:
    items = _items()
    per_rank = reshard.scatter(items, tp)
    assert set(per_rank[0]) == set(items)
    assert all("generator" not in r for r in per_rank[1:])
    back = reshard.gather_all(per_rank)
    assert back.keys() == items.keys()
    for name, t in items.items():
        assert torch.equal(back[name], t) and back[name].dtype == t.dtype, name
    for name in ("kda_state.0", "kda_conv.0"):
        naive = reshard.shard_naive(name, items[name], tp, num_heads=8)
        for r in range(tp):
            assert torch.equal(per_rank[r][name], naive[r]), (name, r)
        assert torch.equal(reshard.gather_naive(name, naive, num_heads=8), items[name])
        assert reshard.full_shape(name, tuple(per_rank[0][name].shape), tp) == tuple(items[name].shape)


def test_conv_shard_is_per_segment_not_flat() -> None:
    """Rank 0 of 2 holds the first half of q, of k and of v: never all of q and half of k."""
    conv = torch.arange(3 * 8).float()[:, None]  # channel c holds c: q 0..7, k 8..15, v 16..23
    r0, r1 = reshard.shard("kda_conv.3", conv, 2)
    assert r0[:, 0].tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19]
    assert r1[:, 0].tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]


@pytest.mark.parametrize("tp_from,tp_to", [(2, 1), (1, 2), (2, 4), (4, 2)])
def test_reshard_between_tp_sizes(tp_from: int, tp_to: int) -> None:
    items = _items()
    direct = reshard.scatter(items, tp_to)
    via = reshard.reshard(reshard.scatter(items, tp_from), tp_to)
    for a, b in zip(direct, via):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_diverged_replicas_and_bad_splits_are_refused() -> None:
    items = _items()
    per_rank = reshard.scatter(items, 2)
    per_rank[1]["mla.1"] = per_rank[1]["mla.1"] + 1
    with pytest.raises(ValueError, match="differ between tensor-parallel ranks"):
        reshard.gather_all(per_rank)
    with pytest.raises(ValueError, match="cannot be split"):
        reshard.shard("kda_state.0", items["kda_state.0"], 3)


def _run(layer: KimiDeltaAttention, xs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence through ``layer``'s own heads, one step per ``xs`` entry (prefill chunks, then decode);
    its conv window and recurrent state ``[H_held, ...]`` after the last."""
    P = layer.num_heads * layer.head_dim
    conv = torch.zeros(1, 3 * P, layer.conv_size - 1)
    state = torch.zeros(1, layer.num_heads, layer.head_dim, layer.head_dim)
    cached = 0
    with torch.inference_mode():
        for x in xs:
            ctx = ForwardContext(cu_seqlens=torch.tensor([0, x.shape[0]]), cached_lens=[cached],
                                 state_slots=torch.tensor([0]), block_tables=torch.zeros(1, 4, dtype=torch.long),
                                 caches=ModelCaches())
            layer._heads(x, ctx, 0, conv, state)
            cached += x.shape[0]
    return conv[0].clone(), state[0].clone()


@pytest.mark.parametrize("model", MODELS)
def test_shards_equal_what_real_tp2_ranks_hold(model: str) -> None:
    path = resolve_model_path(model)
    full, _ = load_model(path, dtype=torch.float32, progress=False)
    ranks = [load_model(path, dtype=torch.float32, progress=False, par=Parallel(ParallelLayout(tp=2), rank=r))[0]
             for r in range(2)]

    def kda(m):
        return [x for x in m.modules() if isinstance(x, KimiDeltaAttention)]

    g = torch.Generator().manual_seed(1)
    d = kda(full)[0].q_proj.weight.shape[1]
    xs = [torch.randn(n, d, generator=g) for n in (13, 7, 1, 1)]  # a chunked prefill, then two decode steps
    for layer, *rank_layers in zip(kda(full), *(kda(r) for r in ranks)):
        conv, state = _run(layer, xs)
        assert state.abs().sum() > 0 and conv.abs().sum() > 0
        real = [_run(r, xs) for r in rank_layers]
        i = layer.layer_idx
        convs = reshard.shard(f"kda_conv.{i}", conv, 2)
        states = reshard.shard(f"kda_state.{i}", state, 2)
        for r, (rc, rs) in enumerate(real):
            torch.testing.assert_close(convs[r], rc, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(states[r], rs, rtol=1e-5, atol=1e-6)
        # the gathered real shards are the full-layout state
        torch.testing.assert_close(reshard.gather(f"kda_conv.{i}", [c for c, _ in real]), conv, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(reshard.gather(f"kda_state.{i}", [s for _, s in real]), state,
                                   rtol=1e-5, atol=1e-6)
        # negative control: a flat slice of q|k|v is not what rank 0 holds
        flat = conv.chunk(2, dim=0)[0]
        assert not torch.allclose(flat, real[0][0], rtol=1e-3, atol=1e-4)
