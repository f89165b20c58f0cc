"""Acceptance 1 (fp32, greedy): a request's tokens do not depend on how the engine ran it — alone, in a batch
of 64 with mixed lengths, with chunked prefill at several chunk sizes, under preemption, with prefix-cache hits
on and off. "Alone" is the naive system-level reference ``models.generate.greedy_generate`` on one prompt."""

from __future__ import annotations

import pytest
import torch

from k3serve.models.cache import cache_spec
from k3serve.models.generate import greedy_generate

MAX_NEW = 8


def _prompts(n, lo, hi, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 2000, (k,), generator=g).tolist() for k in torch.randint(lo, hi + 1, (n,), generator=g)]


PROMPTS = _prompts(64, 4, 80, seed=0)
SHARED = _prompts(1, 40, 40, seed=1)[0]
PREFIXED = [SHARED[:k] + tail for k, tail in zip([40, 40, 33, 40, 17, 40, 36, 40], _prompts(8, 1, 12, 2))]


@pytest.fixture(scope="module")
def alone(tiny):
    """Each prompt run alone, computed on first use."""
    cache: dict[tuple[int, ...], list[int]] = {}

    def get(prompts):
        for p in prompts:
            if tuple(p) not in cache:
                cache[tuple(p)] = greedy_generate(tiny[0], [p], MAX_NEW)[0]
        return [cache[tuple(p)] for p in prompts]

    return get


def test_batch_of_64_mixed_lengths(tiny, alone, eh):
    engine = eh.make_engine(tiny)
    assert eh.run_greedy(engine, PROMPTS, MAX_NEW) == alone(PROMPTS)
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_generated_tokens == 64 * MAX_NEW


@pytest.mark.parametrize("chunk", [16, 37, 100])
def test_chunked_prefill(tiny, alone, eh, chunk):
    engine = eh.make_engine(tiny, max_num_batched_tokens=chunk, state_cache_interval=32)
    prompts = PROMPTS[:8]
    assert eh.run_greedy(engine, prompts, MAX_NEW) == alone(prompts)


def test_preemption_under_a_tiny_budget(tiny, alone, eh):
    engine = eh.make_engine(tiny, max_num_seqs=12, max_model_len=128, enable_prefix_caching=False,
                            kv_cache_memory=_budget(tiny, blocks=16, max_num_seqs=12))
    prompts = PROMPTS[:12]
    assert eh.run_greedy(engine, prompts, MAX_NEW) == alone(prompts)
    assert engine.stats().num_preemptions > 0


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_cache_on_and_off(tiny, alone, eh, caching):
    engine = eh.make_engine(tiny, enable_prefix_caching=caching, state_cache_interval=16)
    # the first wave fills the cache, the second (same prefix, new tails) hits it
    got = eh.run_greedy(engine, PREFIXED[:2], MAX_NEW, "a") + eh.run_greedy(engine, PREFIXED[2:], MAX_NEW, "b")
    assert got == alone(PREFIXED)
    stats = engine.stats()
    assert (stats.num_prefix_hit_tokens > 0) == caching


def _budget(tiny, *, blocks: int, max_num_seqs: int) -> int:
    spec = cache_spec(tiny[0], torch.float32)
    return max_num_seqs * spec.kda_bytes_per_slot + blocks * 16 * spec.mla_bytes_per_token


@pytest.mark.slow
def test_everything_at_once(tiny, alone, eh):
    """64 + 8 requests (shared prefixes), chunk 37, snapshots every 32 tokens, and a budget that preempts."""
    engine = eh.make_engine(tiny, max_num_seqs=24, max_num_batched_tokens=37, state_cache_interval=32,
                            max_model_len=128, snapshot_memory_fraction=0.4,
                            kv_cache_memory=int(_budget(tiny, blocks=12, max_num_seqs=24) / 0.6))
    prompts = PREFIXED + PROMPTS
    assert eh.run_greedy(engine, prompts, MAX_NEW) == alone(prompts)
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.num_prefix_hit_tokens > 0
