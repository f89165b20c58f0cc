"""Greedy outputs with speculative decoding on equal those with it off (fp32, both tiny models), for k = 0..8,
both rollback strategies, batches that mix prefill chunks with verify rows, prefix-cache hits, preemption and
an abort. The drafts come from an oracle that knows the speculation-off continuation and spoils some of it,
so acceptance is high but partial (every accept count occurs); the test checks acceptance > 0. A rollback
that skips the restore must break the equality (the negative control)."""

from __future__ import annotations

import pytest
import torch

from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.spec.config import SpeculativeConfig
from k3serve.engine.spec.rollback import SlotsRollback

MAX_NEW = 14


def _prompts():
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(0, 2000, (33,), generator=g).tolist()
    tails = [torch.randint(0, 2000, (n,), generator=g).tolist() for n in (3, 9, 1)]
    return [torch.randint(0, 2000, (n,), generator=g).tolist() for n in (5, 21)] + [shared + t for t in tails]


PROMPTS = _prompts()


class Oracle:
    """Proposes the speculation-off continuation, spoiling one draft in every third proposal."""

    def __init__(self, prompts, outputs):
        self.ref = [(p, o) for p, o in zip(prompts, outputs)]
        self.calls = 0

    def propose(self, token_ids, k):
        self.calls += 1
        for p, o in self.ref:
            if token_ids[:len(p)] == p and token_ids[len(p):] == o[:len(token_ids) - len(p)]:
                d = list(o[len(token_ids) - len(p):][:k])
                if d and self.calls % 3 == 0:
                    d[self.calls % len(d)] = (d[self.calls % len(d)] + 1) % 2000
                return d
        return []


class NoRestore(SlotsRollback):
    """Deliberately wrong: leaves the state after every draft, accepted or not."""

    def _commit(self, num_accepted, snapshots):
        self._slots.clear()


@pytest.fixture(scope="module")
def reference(tiny, eh):
    return eh.run_greedy(eh.make_engine(tiny), PROMPTS, MAX_NEW)


def _run(tiny, eh, reference, spec, rollback_cls=None, abort=False, **cfg):
    engine = eh.make_engine(tiny, speculative_config=spec, **cfg)
    engine.scheduler.speculator.drafter = Oracle(PROMPTS, reference)
    if rollback_cls is not None:
        engine.runner.rollback = rollback_cls
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    # the first two run alone for a few steps; the shared-prefix wave then joins (prefill chunks beside
    # verify rows) and hits the prefix of the first of them
    for i in (0, 1, 2):
        engine.add_request(str(i), PROMPTS[i], params)
    done = {}
    for _ in range(3):
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    for i in (3, 4):
        engine.add_request(str(i), PROMPTS[i], params)
    if abort:
        engine.add_request("gone", PROMPTS[3], params)
        engine.step()
        assert engine.abort_request("gone").finish_reason == "abort"
    done.update(eh.drain(engine))
    return [done[str(i)].token_ids for i in range(len(PROMPTS))], engine


@pytest.mark.parametrize("k", [0, 1, 3, 8])
def test_greedy_equal_for_k(tiny, eh, reference, k):
    got, engine = _run(tiny, eh, reference, SpeculativeConfig(num_speculative_tokens=k), abort=k == 3,
                       max_num_batched_tokens=24)
    assert got == reference
    s = engine.scheduler
    assert s.num_spec_rows > 0 and (s.num_accepted_tokens > 0) == (k > 0)
    assert engine.stats().num_prefix_hit_tokens > 0
    assert engine.blocks.num_used == 0 and engine.states.num_running_free == engine.states.max_running


@pytest.mark.parametrize("caching", [True, False])
def test_greedy_equal_replay_reference(tiny, eh, reference, caching):
    got, engine = _run(tiny, eh, reference, SpeculativeConfig(num_speculative_tokens=5, rollback="replay"),
                       enable_prefix_caching=caching)
    assert got == reference and engine.scheduler.num_accepted_tokens > 0


def test_preemption(tiny, eh, reference):
    from k3serve.models.cache import cache_spec

    spec = cache_spec(tiny[0], torch.float32)
    budget = 5 * spec.kda_bytes_per_slot + 6 * 16 * spec.mla_bytes_per_token
    got, engine = _run(tiny, eh, reference, SpeculativeConfig(num_speculative_tokens=4), max_num_seqs=5,
                       enable_prefix_caching=False, kv_cache_memory=budget, max_model_len=64)
    assert got == reference
    assert engine.stats().num_preemptions > 0 and engine.scheduler.num_accepted_tokens > 0


def test_a_rollback_that_skips_the_restore_fails(tiny, eh, reference):
    got, engine = _run(tiny, eh, reference, SpeculativeConfig(num_speculative_tokens=4), rollback_cls=NoRestore)
    assert engine.scheduler.num_draft_tokens > engine.scheduler.num_accepted_tokens  # some drafts were rejected
    assert got != reference


def test_backoff_when_the_batch_is_large(tiny, eh, reference):
    got, engine = _run(tiny, eh, reference, SpeculativeConfig(num_speculative_tokens=4, max_running=1))
    assert got == reference
    s = engine.scheduler
    assert s.num_spec_rows > 0 and s.num_draft_tokens < 4 * s.num_spec_rows


def test_logprobs_under_speculation(eh, reference):
    model = eh.get_model("k3-tiny-random")
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
    outs = []
    for spec in (None, SpeculativeConfig(num_speculative_tokens=3)):
        engine = eh.make_engine(model, speculative_config=spec)
        if spec is not None:
            engine.scheduler.speculator.drafter = Oracle(PROMPTS[:1], eh.run_greedy(eh.make_engine(model), PROMPTS[:1],
                                                                                   MAX_NEW))
        engine.add_request("0", PROMPTS[0], params)
        outs.append(eh.drain(engine)["0"])
    off, on = outs
    assert on.token_ids == off.token_ids and len(on.logprobs) == len(off.logprobs) == MAX_NEW
    for a, b in zip(on.logprobs, off.logprobs):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_real_drafters_on_the_default_model(eh, method):
    """k3-default answering tool-calling tasks: its calls copy the request, so real drafts get accepted."""
    import random

    from training import tasks
    from training.render import prompt_ids
    from training.tok import load_tokenizer

    tok, rng = load_tokenizer(), random.Random(5)
    prompts = [prompt_ids(tasks.make("tool", rng, held_out=True), tok) for _ in range(2)]
    model = eh.get_model("k3-default")
    ref = eh.run_greedy(eh.make_engine(model, max_model_len=1024), prompts, 48)
    engine = eh.make_engine(model, max_model_len=1024,
                            speculative_config=SpeculativeConfig(method=method, num_speculative_tokens=4))
    assert eh.run_greedy(engine, prompts, 48) == ref
    assert engine.scheduler.num_accepted_tokens > 0


@pytest.mark.parametrize("rollback", ["slots", "replay"])
def test_follow_up_turn_resumes_from_a_snapshot_taken_inside_a_window(tiny, eh, rollback):
    """Turn 1 decodes across block boundaries under speculation (windows straddle them); turn 2 (turn 1's
    tokens + a new tail) must hit the snapshot published from inside a window and decode as without it."""
    first = PROMPTS[1]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)

    def turns(spec):
        engine = eh.make_engine(tiny, speculative_config=spec)
        ref1 = eh.run_greedy(eh.make_engine(tiny), [first], 30)[0]
        if spec is not None:
            engine.scheduler.speculator.drafter = Oracle([first], [ref1])
        engine.add_request("t1", first, params)
        out1 = eh.drain(engine)["t1"].token_ids
        second = first + out1 + [11, 12, 13]
        engine.add_request("t2", second, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        out2 = eh.drain(engine)["t2"]
        return out1, out2.token_ids, out2.num_cached_tokens, engine

    off1, off2, _, _ = turns(None)
    on1, on2, hit, engine = turns(SpeculativeConfig(num_speculative_tokens=7, rollback=rollback))
    assert (on1, on2) == (off1, off2)
    assert hit == 48 and engine.scheduler.num_accepted_tokens > 0  # 21 + 30 tokens: last boundary at 48


def test_penalties_min_tokens_and_stops_under_speculation(eh):
    """Penalties and min_tokens see the accepted drafts as output; a stop id inside an accepted window ends
    the request there (the rest of the window is dropped)."""
    model = eh.get_model("k3-tiny-random")
    prompt = PROMPTS[1]

    def run(spec, params, drafter_ref=None):
        engine = eh.make_engine(model, speculative_config=spec)
        if spec is not None:
            engine.scheduler.speculator.drafter = Oracle([prompt], [drafter_ref])
        engine.add_request("p", prompt, params)
        return eh.drain(engine)["p"], engine

    pen = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3,
                         presence_penalty=0.5, frequency_penalty=0.2, min_tokens=5)
    off, _ = run(None, pen)
    on, engine = run(SpeculativeConfig(num_speculative_tokens=4), pen, off.token_ids)
    assert on.token_ids == off.token_ids and engine.scheduler.num_accepted_tokens > 0
    stop = off.token_ids[9]
    stop_params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3,
                                 presence_penalty=0.5, frequency_penalty=0.2, stop_token_ids=[stop])
    off_s, _ = run(None, stop_params)
    on_s, engine = run(SpeculativeConfig(num_speculative_tokens=6), stop_params, off.token_ids)
    assert on_s.token_ids == off_s.token_ids and on_s.finish_reason == off_s.finish_reason == "stop"
    assert engine.blocks.num_used == 0
