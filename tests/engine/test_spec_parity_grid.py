"""Acceptance 1 on the tiny models (slow grid): k3-tiny and kimi-linear-tiny x every drafter x k = 0..8,
greedy outputs with speculation on equal those with it off in ``spec_parity.scenario``'s mixed batch
(prefill chunks beside verify rows, a prefix hit, an abort), and under preemption for every drafter (eagle3
included). The draft model is the target itself for odd k (accepted in full) and the other tiny model for even
k; the eagle3 head is random. One fast case per model keeps eagle3 under preemption in the default run."""

from __future__ import annotations

import pytest
import torch

from tests.engine.spec_parity import METHODS, random_head, scenario, spec

MAX_NEW = 14
TINY = ("k3-tiny-random", "kimi-linear-tiny-random")


def _prompts():
    g = torch.Generator().manual_seed(23)
    loop = torch.randint(0, 2000, (6,), generator=g).tolist()
    return [loop * 3 + [1, 2], torch.randint(0, 2000, (21,), generator=g).tolist(),
            torch.randint(0, 2000, (9,), generator=g).tolist()]


PROMPTS = _prompts()


def _preempting(model) -> dict:
    from k3serve.models.cache import cache_spec

    cs = cache_spec(model[0], torch.float32)
    return {"max_num_seqs": 5, "enable_prefix_caching": False, "max_model_len": 64,
            "kv_cache_memory": 5 * cs.kda_bytes_per_slot + 6 * 16 * cs.mla_bytes_per_token}


@pytest.fixture(scope="module", params=TINY)
def target(request, eh, tmp_path_factory):
    model = eh.get_model(request.param)
    head = random_head(model, tmp_path_factory.mktemp("head"))
    other = TINY[1 - TINY.index(request.param)]
    return request.param, model, head, other, {
        "plain": scenario(eh, model, PROMPTS, MAX_NEW, max_num_batched_tokens=24)[0],
        "preempt": scenario(eh, model, PROMPTS, MAX_NEW, **_preempting(model))[0]}


def _config(target, method, k):
    name, _, head, other, _ = target
    return spec(method, k, draft=name if k % 2 else other, head=head, rollback="replay" if k == 4 else "slots")


def test_eagle3_under_preemption(eh, target):
    got, engine = scenario(eh, target[1], PROMPTS, MAX_NEW, _config(target, "eagle3", 3), **_preempting(target[1]))
    assert got == target[4]["preempt"] and engine.stats().num_preemptions > 0
    assert engine.scheduler.num_draft_tokens > 0


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("k", range(9))
def test_grid(eh, target, method, k):
    got, engine = scenario(eh, target[1], PROMPTS, MAX_NEW, _config(target, method, k), max_num_batched_tokens=24)
    assert got == target[4]["plain"]
    s = engine.scheduler
    assert s.num_spec_rows > 0 and engine.stats().num_prefix_hit_tokens > 0
    if method == "draft_model" and k % 2:  # the target drafting for itself
        assert s.num_accepted_tokens > 0.8 * s.num_draft_tokens


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_grid_preemption(eh, target, method):
    # k = 8: the other tiny model drafts (the target drafting for itself finishes too soon to be preempted)
    got, engine = scenario(eh, target[1], PROMPTS, MAX_NEW, _config(target, method, 8), **_preempting(target[1]))
    assert got == target[4]["preempt"] and engine.stats().num_preemptions > 0
