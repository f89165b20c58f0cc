"""Attention data parallel with the experts over every rank (``-dp D --enable-expert-parallel``), through the
HTTP app on gloo: concurrent greedy completions (prefix hits, preemption) give the single process's tokens and
logprobs within 1e-5; a request alone keeps the other core stepping dummies (counted) and still answers as one
process; requests arriving at random times afterwards (reusing prefix caches that lived through the dummy
steps) answer the same. Every wait has a timeout, so a lockstep deadlock fails the test instead of hanging it."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from tests.distributed.conftest import MODEL, prompts, serving

# each layout starts 2-4 ranks that load the model: ~20 s alone, minutes on a loaded 2-core box
pytestmark = pytest.mark.slow
TIMEOUT_S = 240  # per phase: a hang in the lockstep fails here rather than stalling the run
BLOCKS = 5  # MLA blocks per replica: small enough that each replica preempts


async def one(http: httpx.AsyncClient, prompt: list[int], max_tokens: int = 8) -> tuple[list[str], list[float]]:
    r = await http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                  "temperature": 0, "ignore_eos": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"]


async def all_at_once(http: httpx.AsyncClient) -> list[tuple[list[str], list[float]]]:
    return list(await asyncio.wait_for(asyncio.gather(*(one(http, p) for p in prompts())), TIMEOUT_S))


def assert_same(got, want) -> None:
    for (tokens, lps), (want_tokens, want_lps) in zip(got, want, strict=True):
        assert tokens == want_tokens
        assert max(abs(a - b) for a, b in zip(lps, want_lps, strict=True)) <= 1e-5, (lps, want_lps)


@pytest.fixture(scope="module")
def reference():
    async def run():
        async with serving() as (http, _):
            return await all_at_once(http)

    return asyncio.run(run())


async def wait_for_dummies(state, above: int) -> int:
    """The summed dummy-step count once it passes ``above`` (stats come with outputs and heartbeats)."""
    for _ in range(50):
        n = state.client.stats.num_dummy_steps
        if n > above:
            return n
        await asyncio.sleep(0.2)
    return state.client.stats.num_dummy_steps


def test_dp2_ep2_lockstep_matches_one_process(reference):
    async def run():
        async with serving(dp=2, ep=True, blocks=BLOCKS) as (http, state):
            assert_same(await all_at_once(http), reference)
            before = state.client.stats.num_dummy_steps
            # alone: one core decodes, the other runs dummy steps in its reserved block and slot
            alone = await asyncio.wait_for(one(http, prompts()[1]), TIMEOUT_S)
            assert_same([alone], [reference[1]])
            assert await wait_for_dummies(state, before) > before
            rng = random.Random(7)

            async def late(p):
                await asyncio.sleep(rng.uniform(0.0, 1.5))
                return await one(http, p)

            for _ in range(2):  # random arrivals: cores start and stop their waves at different times
                outs = await asyncio.wait_for(asyncio.gather(*(late(p) for p in prompts())), TIMEOUT_S)
                assert_same(outs, reference)
            return state.client.stats

    stats = asyncio.run(run())
    assert stats.num_prefix_hit_tokens > 0 and stats.num_preemptions > 0, stats


def test_tp2_dp2_ep4_matches_one_process(reference):
    async def run():
        async with serving(tp=2, dp=2, ep=True, blocks=BLOCKS) as (http, state):
            outs = await all_at_once(http)
            return outs, state.client.stats

    outs, stats = asyncio.run(run())
    assert_same(outs, reference)
    assert stats.num_prefix_hit_tokens > 0, stats
