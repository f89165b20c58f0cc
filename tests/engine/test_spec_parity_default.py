"""Acceptance 1 on k3-default (the shipped trained model): greedy outputs with speculation on equal those with
it off for every drafter, in the mixed batch of ``spec_parity.scenario`` (prefill chunks beside verify rows, a
prefix hit, an abort, a json_schema request) and, slow, the same batch under preemption (a cache of the
longest request and one block, 32-token chunks). The prompts are tool-calling, copy and
JSON tasks, whose answers copy their prompts, so the n-gram and suffix drafts get accepted; the draft model is
k3-default itself (accepted in full) or k3-tiny-fullvocab-random (same vocabulary, mostly rejected); the
eagle3 head is random (rejected: every position's rollback is exercised). A rollback that keeps the rejected
drafts' state must break the equality. The fast tests take a few k values; the slow grid takes k = 0..8."""

from __future__ import annotations

import random

import pytest

from tests.engine.spec_parity import METHODS, NoRestore, preempting, random_head, scenario, spec

MAX_NEW = 16
MODEL = "k3-default"
LEN = {"max_model_len": 1024, "max_num_batched_tokens": 64}


@pytest.fixture(scope="module")
def model(eh):
    return eh.get_model(MODEL)


@pytest.fixture(scope="module")
def prompts():
    from training import tasks
    from training.render import prompt_ids
    from training.tok import load_tokenizer

    tok, rng = load_tokenizer(), random.Random(5)
    return [prompt_ids(tasks.make(kind, rng, held_out=True), tok) for kind in ("tool", "copy", "tool", "json")]


@pytest.fixture(scope="module")
def head(model, tmp_path_factory):
    return random_head(model, tmp_path_factory.mktemp("head"))


@pytest.fixture(scope="module")
def reference(eh, model, prompts):
    return scenario(eh, model, prompts, MAX_NEW, guided_prompt=prompts[3], **LEN)[0]


def _check(eh, model, prompts, reference, config, **cfg):
    got, engine = scenario(eh, model, prompts, MAX_NEW, config, guided_prompt=prompts[3], **LEN, **cfg)
    assert got == reference
    s = engine.scheduler
    assert s.num_spec_rows > 0 and (s.num_draft_tokens > 0) == (config.num_speculative_tokens > 0)
    assert engine.stats().num_prefix_hit_tokens > 0
    return s


@pytest.mark.parametrize("method,k", [("ngram", 4), ("suffix", 2)])
def test_prompt_drafters(eh, model, prompts, reference, method, k):
    s = _check(eh, model, prompts, reference, spec(method, k))
    assert s.num_accepted_tokens > 0  # the answers copy their prompts


def test_draft_model_and_eagle3(eh, model, prompts, reference, head):
    s = _check(eh, model, prompts, reference, spec("draft_model", 3, draft=MODEL))
    # the same weights draft what the target decodes, except in the json_schema request (drafts see no grammar)
    assert s.num_accepted_tokens > 0.5 * s.num_draft_tokens
    _check(eh, model, prompts, reference, spec("eagle3", 2, head=head))


@pytest.mark.slow
def test_a_rollback_that_keeps_rejected_drafts_fails(eh, model, prompts, reference):
    got, engine = scenario(eh, model, prompts, MAX_NEW, spec("ngram", 4), guided_prompt=prompts[3],
                           rollback=NoRestore, **LEN)
    assert engine.scheduler.num_draft_tokens > engine.scheduler.num_accepted_tokens
    assert got != reference


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("k", range(9))
def test_grid(eh, model, prompts, reference, head, method, k):
    draft = MODEL if k % 2 else "k3-tiny-fullvocab-random"
    _check(eh, model, prompts, reference, spec(method, k, draft=draft, head=head,
                                               rollback="replay" if k == 5 else "slots"))


def PREEMPT(model, prompts) -> dict:
    # 32-token chunks: requests are admitted by their first chunk's blocks, so later chunks and decodes run out
    return preempting(model, prompts, MAX_NEW) | {"max_num_batched_tokens": 32}


@pytest.fixture(scope="module")
def preempt_reference(eh, model, prompts):
    return scenario(eh, model, prompts, MAX_NEW, guided_prompt=prompts[3], **PREEMPT(model, prompts))[0]


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_preemption(eh, model, prompts, preempt_reference, head, method):
    # a cache that holds the longest request and one block more: requests are preempted and recomputed while
    # they speculate; the other (mostly rejected) model drafts, so requests live long enough to be preempted
    got, engine = scenario(eh, model, prompts, MAX_NEW, spec(method, 4, draft="k3-tiny-fullvocab-random", head=head),
                           guided_prompt=prompts[3], **PREEMPT(model, prompts))
    assert got == preempt_reference
    assert engine.stats().num_preemptions > 0 and engine.scheduler.num_spec_rows > 0
