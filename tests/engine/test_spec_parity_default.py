"""Acceptance 1 on k3-default (the shipped trained model): greedy outputs with speculation on equal those with
it off for every drafter, in the mixed batch of ``spec_parity.scenario`` (prefill chunks beside verify rows, a
prefix hit, an abort, a json_schema request). Preemption is covered on the tiny models
(``test_spec_parity_grid``): this model's long prompts make a cache that preempts reliably hard to size. The prompts are tool-calling, copy and
JSON tasks, whose answers copy their prompts, so the n-gram and suffix drafts get accepted; the draft model is
k3-default itself (accepted in full) or k3-tiny-fullvocab-random (same vocabulary, mostly rejected); the
eagle3 head is random (rejected: every position's rollback is exercised). A rollback that keeps the rejected
drafts' state must break the equality. The fast tests take a few k values; the slow grid takes k = 0..8."""

from __future__ import annotations

import random

import pytest

from tests.engine.spec_parity import METHODS, NoRestore, random_head, scenario, spec

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
