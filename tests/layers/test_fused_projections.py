"""``ConcatCache`` (and ``SwappedCache``) and the KDA layer's fused input projection: the same output as separate projections, and
the fused weights follow every change to the layer's parameters."""

from __future__ import annotations

import struct

import torch

import k3serve.layers.kda as kda_module
from k3serve.core.config import ModelConfig
from k3serve.core.context import ForwardContext, forward_context
from k3serve.layers.weights import ConcatCache, SwappedCache
from k3serve.models.cache import allocate_caches, cache_spec
from k3serve.models.kimi import build_model
from k3serve.models.registry import packaged_config
from k3serve.models.writer import init_random_


def test_concat_cache_follows_in_place_updates_and_declines_large_weights():
    a, b = torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(2, 4))
    cache = ConcatCache(max_bytes=1 << 20)
    with torch.no_grad():
        first = cache([a, b])
        assert cache([a, b]) is first  # kept between calls
        a.mul_(2)  # an in-place update (as a loader copy or an optimiser step)
        torch.testing.assert_close(cache([a, b]), torch.cat([a, b]), rtol=0, atol=0)
        b.data = b.data.double().float()  # storage replaced (as the loader's dtype cast)
        torch.testing.assert_close(cache([a, b]), torch.cat([a, b]), rtol=0, atol=0)
    assert ConcatCache(max_bytes=16)([a, b]) is None


def test_concat_cache_sees_a_fresh_tensor_at_a_reused_address():
    """A parametrised weight (QAT fake-quant) is computed anew on each access; the allocator may put the new
    one where the previous one was freed, with the same zero version. The cache must still rebuild."""
    buf = bytearray(4 * 8)
    cache = ConcatCache(max_bytes=1 << 20)
    with torch.no_grad():
        w1 = torch.frombuffer(buf, dtype=torch.float32).view(2, 4)
        assert torch.equal(cache([w1]), torch.zeros(2, 4))
        buf[:] = struct.pack("8f", *range(8))  # new contents behind torch's back: no version bump
        w2 = torch.frombuffer(buf, dtype=torch.float32).view(2, 4)  # same address, fresh version 0
        assert w2.data_ptr() == w1.data_ptr() and w2._version == w1._version
        torch.testing.assert_close(cache([w2]), torch.arange(8.0).view(2, 4), rtol=0, atol=0)


def test_concat_cache_lets_gradients_through_while_recording():
    a, b = torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(2, 4))
    cache = ConcatCache(max_bytes=1 << 20)
    with torch.no_grad():
        cache([a, b])
    cache([a, b]).sum().backward()
    assert torch.equal(a.grad, torch.ones(3, 4)) and torch.equal(b.grad, torch.ones(2, 4))


def test_swapped_cache_is_a_contiguous_transpose_that_follows_updates():
    w = torch.nn.Parameter(torch.randn(5, 3, 4))
    cache = SwappedCache(max_bytes=1 << 20)
    with torch.no_grad():
        first = cache([w])
        assert first.is_contiguous() and first.shape == (5, 4, 3) and cache([w]) is first
        torch.testing.assert_close(first, w.mT, rtol=0, atol=0)
        w.add_(1.0)
        torch.testing.assert_close(cache([w]), w.mT, rtol=0, atol=0)
    assert SwappedCache(max_bytes=16)([w]) is None
    cache([w]).sum().backward()  # recording: built per call, gradients reach the parameter
    assert torch.equal(w.grad, torch.ones(5, 3, 4))


def _kda_layers(name: str):
    cfg = ModelConfig.from_file(packaged_config(name))
    model = init_random_(build_model(cfg), seed=3).eval()
    return model, [m for m in model.modules() if isinstance(m, kda_module.KimiDeltaAttention)]


def _run(model, layer, x: torch.Tensor, lens: list[int]) -> torch.Tensor:
    caches = allocate_caches(cache_spec(model, torch.float32), num_blocks=8, block_size=16, num_slots=len(lens))
    ctx = ForwardContext(cu_seqlens=torch.tensor([0, *lens]).cumsum(0), cached_lens=[0] * len(lens),
                         state_slots=torch.arange(len(lens)), block_tables=torch.arange(8).view(len(lens), -1),
                         caches=caches)
    with torch.inference_mode(), forward_context(ctx):
        return layer(x, ctx)


def test_fused_and_separate_projections_agree(monkeypatch):
    for name in ("kimi-linear-tiny", "k3-tiny"):  # low-rank and full-rank output gate
        model, layers = _kda_layers(name)
        layer = layers[0]
        x = torch.randn(10, layer.q_proj.in_features, generator=torch.Generator().manual_seed(0))
        fused = _run(model, layer, x, [6, 4])
        monkeypatch.setattr(layer._in_weight, "max_bytes", 0)  # too large to fuse: separate projections
        separate = _run(model, layer, x, [6, 4])
        torch.testing.assert_close(fused, separate, rtol=1e-5, atol=1e-6)
