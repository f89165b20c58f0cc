"""Scheduler + pools + hybrid prefix cache, driven without a model: each step "samples" a token from a seeded
RNG for every request that reached its last token."""

from __future__ import annotations

import random

import pytest

from k3serve.engine.block_pool import BlockPool
from k3serve.engine.prefix_cache import HybridPrefixCache, NoPrefixCache
from k3serve.engine.request import Request, RequestStatus
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.scheduler import Scheduler
from k3serve.engine.state_pool import StatePool

BS = 4


def make(num_blocks=64, max_seqs=4, budget=16, snapshots=8, interval=0, caching=True):
    blocks, states = BlockPool(num_blocks, BS), StatePool(max_seqs, snapshots if caching else 0)
    cache = HybridPrefixCache(blocks, states) if caching else NoPrefixCache()
    return Scheduler(max_num_seqs=max_seqs, max_num_batched_tokens=budget, state_cache_interval=interval,
                     blocks=blocks, states=states, cache=cache)


def req(rid, prompt, max_tokens=5, **kw):
    return Request(str(rid), list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw))


def step(s: Scheduler, rng: random.Random):
    batch = s.schedule()
    sampled = [rng.randrange(100) if batch.samples(i) else None for i in range(len(batch))]
    s.update(batch, sampled)
    return batch


def run(s, rng, max_steps=10_000):
    batches = []
    while s.has_unfinished():
        batches.append(step(s, rng))
        assert len(batches) < max_steps
    return batches


def assert_pools_full(s: Scheduler):
    assert s.blocks.num_free == s.blocks.num_blocks and not any(s.blocks.ref_count)
    assert s.states.num_running_free == s.states.max_running
    assert all(r == 0 for r in s.states._refs.values())
    s.blocks.clear_cache()
    s.states.clear_cache()
    assert s.states.num_free == s.states.num_slots and s.blocks.num_cached == 0


def test_budget_mixes_decodes_and_prefill_chunks():
    s = make(budget=8)
    rng = random.Random(0)
    s.add(req(0, range(3)))
    step(s, rng)  # request 0 prefills and starts decoding
    s.add(req(1, range(100, 130)))
    batches = run(s, rng)
    assert all(b.num_tokens <= 8 for b in batches)
    mixed = [b for b in batches if len(b) == 2]
    assert mixed and mixed[0].num_new_tokens[0] == 1 and mixed[0].num_new_tokens[1] > 1
    assert_pools_full(s)


def test_fcfs_and_max_num_seqs():
    s = make(max_seqs=2, budget=64)
    for i in range(4):
        s.add(req(i, range(i, i + 6), max_tokens=3))
    first = s.schedule()
    assert [r.request_id for r in first.requests] == ["0", "1"] and len(s.waiting) == 2


def test_preemption_by_recompute_keeps_outputs_and_frees_everything():
    s = make(num_blocks=12, max_seqs=4, budget=64, caching=False)  # 48 tokens of MLA cache
    reqs = [req(i, range(10 * i, 10 * i + 9), max_tokens=12) for i in range(4)]
    for r in reqs:
        s.add(r)
    run(s, random.Random(1))
    assert s.num_preemptions > 0
    assert all(r.num_output_tokens == 12 and r.finish_reason == "length" for r in reqs)
    assert_pools_full(s)


def test_prefix_hit_counts_prompt_tokens_only_even_after_a_recompute():
    # 44 tokens of MLA cache for 4 requests of 5 + 20: preempted requests come back and hit the blocks of
    # their own outputs, which are no prompt tokens served from the cache (usage's cached_tokens)
    s = make(num_blocks=11, max_seqs=4, budget=64)
    reqs = [req(i, range(10 * i, 10 * i + 5), max_tokens=20) for i in range(4)]
    for r in reqs:
        s.add(r)
    rng = random.Random(1)
    while s.has_unfinished():
        step(s, rng)
        assert all(r.num_prefix_hit_tokens == 0 for r in reqs)  # distinct prompts: nothing cached
    assert s.num_preemptions > 0 and s.num_hit_tokens > 0  # the recomputes did hit
    assert_pools_full(s)


def test_prefix_hit_needs_blocks_and_a_snapshot_at_the_same_position():
    prompt = list(range(23))  # 5 full blocks; prompt-end snapshot at 20
    s = make(interval=8)
    rng = random.Random(2)
    run_one = lambda rid, toks: (s.add(r := req(rid, toks, max_tokens=1)), run(s, rng), r)[2]
    first = run_one("a", prompt)
    assert first.num_prefix_hit_tokens == 0 and s.states.num_snapshots == 3  # at 8, 16 and 20
    assert run_one("b", prompt + [99]).num_prefix_hit_tokens == 20
    # drop the snapshot at 20: the next hit falls back to the deepest remaining one (16)
    s.states._evict(s.states.snapshot_of[first.block_hashes[4]])
    assert run_one("c", prompt + [98]).num_prefix_hit_tokens == 16
    # drop the MLA blocks: snapshots alone give no hit
    s.blocks.clear_cache()
    assert run_one("d", prompt + [97]).num_prefix_hit_tokens == 0
    assert_pools_full(s)


def test_prefill_chunks_end_on_snapshot_positions():
    s = make(budget=64, interval=8)
    r = req(0, range(30), max_tokens=1)
    s.add(r)
    ends = []
    while s.has_unfinished():
        b = step(s, random.Random(0))
        ends += [c + n for c, n in zip(b.cached_lens, b.num_new_tokens)]
    assert ends[:4] == [8, 16, 24, 28] and ends[4] == 30


def test_decode_snapshot_is_published_when_the_request_leaves():
    s = make()
    r = req(0, range(5), max_tokens=9)  # computes 5 + 8 = 13 tokens; last decode boundary at 12
    s.add(r)
    run(s, random.Random(3))
    assert r.block_hashes[2] in s.states.snapshot_of
    follow = req(1, r.token_ids + [1, 2])
    s.add(follow)
    run(s, random.Random(3))
    assert follow.num_prefix_hit_tokens == 12


@pytest.mark.parametrize("caching", [True, False])
def test_thousand_random_aborts_leave_both_pools_full(caching):
    rng = random.Random(4)
    s = make(num_blocks=40, max_seqs=6, budget=24, caching=caching, interval=8)
    shared = list(range(40))
    live: list[Request] = []
    for i in range(1000):
        prompt = shared[:rng.randrange(1, 40)] + [rng.randrange(100) for _ in range(rng.randrange(1, 20))]
        r = req(i, prompt, max_tokens=rng.randrange(1, 30))
        s.add(r)
        live.append(r)
        for _ in range(rng.randrange(3)):
            step(s, rng)
        while live and rng.random() < 0.7:
            s.abort(live.pop(rng.randrange(len(live))).request_id)
    for r in live:
        s.abort(r.request_id)
    assert not s.has_unfinished() and not s.requests
    assert sum(r.status is RequestStatus.FINISHED for r in live) == len(live)
    assert s.num_preemptions > 0 and (s.num_hit_tokens > 0) == caching
    assert_pools_full(s)
