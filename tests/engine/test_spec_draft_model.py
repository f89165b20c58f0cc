"""The draft-model drafter: greedy outputs with it on equal those with it off (fp32, both tiny models as
target and as draft), in batches mixing prefill chunks with verify rows, prefix-cache hits, preemption and an
abort; the draft model drafting for itself is accepted in full; a draft model with another vocabulary is one
clear error."""

from __future__ import annotations

import pytest
import torch

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.spec.config import SpeculativeConfig

MAX_NEW = 12
TINY = ["k3-tiny-random", "kimi-linear-tiny-random"]


def _prompts():
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(0, 2000, (33,), generator=g).tolist()
    return ([torch.randint(0, 2000, (n,), generator=g).tolist() for n in (5, 21)]
            + [shared + torch.randint(0, 2000, (n,), generator=g).tolist() for n in (3, 9, 1)])


PROMPTS = _prompts()


def _run(eh, target: str, spec: SpeculativeConfig | None, **cfg):
    engine = eh.make_engine(eh.get_model(target), speculative_config=spec, **cfg)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    for i in (0, 1, 2):
        engine.add_request(str(i), PROMPTS[i], params)
    done = {}
    for _ in range(3):  # the shared-prefix wave joins later: prefill chunks beside verify rows, prefix hits
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    for i in (3, 4):
        engine.add_request(str(i), PROMPTS[i], params)
    engine.add_request("gone", PROMPTS[3], params)
    done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert engine.abort_request("gone").finish_reason == "abort"
    done.update(eh.drain(engine))
    return [done[str(i)].token_ids for i in range(len(PROMPTS))], engine


@pytest.fixture(scope="module")
def reference(eh):
    return {t: _run(eh, t, None, max_num_batched_tokens=24)[0] for t in TINY}


@pytest.mark.parametrize("target,draft,k", [("k3-tiny-random", "k3-tiny-random", 3),
                                            ("k3-tiny-random", "kimi-linear-tiny-random", 8),
                                            ("kimi-linear-tiny-random", "k3-tiny-random", 5),
                                            ("kimi-linear-tiny-random", "kimi-linear-tiny-random", 0)])
def test_greedy_equal_with_a_draft_model(eh, reference, target, draft, k):
    spec = SpeculativeConfig(method="draft_model", model=draft, num_speculative_tokens=k)
    got, engine = _run(eh, target, spec, max_num_batched_tokens=24)
    assert got == reference[target]
    s = engine.scheduler
    assert s.num_spec_rows > 0 and (s.num_draft_tokens > 0) == (k > 0)
    if draft == target and k > 0:  # the same weights draft exactly what the target decodes
        assert s.num_accepted_tokens > 0.8 * s.num_draft_tokens
    assert engine.blocks.num_used == 0


def test_preemption_with_a_draft_model(eh, reference):
    from k3serve.models.cache import cache_spec

    target = "k3-tiny-random"
    cs = cache_spec(eh.get_model(target)[0], torch.float32)
    spec = SpeculativeConfig(method="draft_model", model=target, num_speculative_tokens=4)
    got, engine = _run(eh, target, spec, max_num_seqs=5, enable_prefix_caching=False, max_model_len=64,
                       kv_cache_memory=5 * cs.kda_bytes_per_slot + 6 * 16 * cs.mla_bytes_per_token)
    assert got == reference[target]
    assert engine.stats().num_preemptions > 0 and engine.scheduler.num_accepted_tokens > 0


def test_a_draft_model_with_another_vocabulary_is_one_error(eh):
    model, config = eh.get_model("k3-tiny-random")
    spec = SpeculativeConfig(method="draft_model", model="k3-tiny-fullvocab-random")
    with pytest.raises(ValueError, match="^speculative_config: draft model 'k3-tiny-fullvocab-random' has a "
                                         "vocabulary of 163840 tokens, the target 2048"):
        LLMEngine(model, model_config=config, config=EngineConfig(kv_cache_memory=2**24, max_model_len=64,
                                                                  speculative_config=spec))


@pytest.mark.parametrize("raw,msg", [
    ('{"method": "draft_model"}', "needs 'model'"),
    ('{"method": "ngram", "model": "x"}', "'model' applies to draft_model, eagle3, eagle_suffix only"),
    ('{"method": "medusa"}', "unknown method 'medusa'"),
    ('{"method": "draft_model", "model": "x", "num_speculative_tokens": -1}', "must be an integer >= 0"),
])
def test_bad_configs(raw, msg):
    with pytest.raises(ValueError, match=msg):
        SpeculativeConfig.parse(raw)


def test_finished_requests_give_their_draft_seat_back(eh):
    engine = eh.make_engine(eh.get_model("k3-tiny-random"),
                            speculative_config=SpeculativeConfig(method="draft_model", model="k3-tiny-random"))
    drafter = engine.scheduler.speculator.drafter
    free = len(drafter.free)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request("a", PROMPTS[0], params)
    engine.add_request("b", PROMPTS[1], params)
    for _ in range(3):  # prefills, then verify rows: each request takes a seat
        engine.step()
    assert len(drafter.free) == free - 2 and set(drafter.seats) == {"a", "b"}
    engine.abort_request("a")
    eh.drain(engine)
    assert len(drafter.free) == free and not drafter.seats
