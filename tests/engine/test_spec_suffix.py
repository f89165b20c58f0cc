"""Suffix decoding with the global response cache (``engine/spec/suffix.py``): the vectorised match against a
plain loop, drafts found in earlier responses only, separators never crossed, eviction, the support cutoff and
the scored choice between own text and cache; the ``eagle_suffix`` combination in the engine (greedy on ==
off) and the shipped k3-default head found without a path."""

from __future__ import annotations

import numpy as np
import pytest

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.spec.config import SpeculativeConfig
from k3serve.engine.spec.suffix import SEP, ResponseCache, SuffixDrafter, suffix_match


def match_reference(hay, query, max_len):
    out = []
    for e in range(len(hay)):
        n = 0
        while n < min(max_len, len(query)) and e - n >= 0 and hay[e - n] == query[-1 - n]:
            n += 1
        out.append(n)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_suffix_match_equals_the_loop(seed):
    rng = np.random.default_rng(seed)
    hay = rng.integers(0, 4, 200)
    hay[rng.integers(0, 200, 10)] = SEP
    query = rng.integers(0, 4, 12)
    for max_len in (1, 3, 8, 20):
        assert suffix_match(hay, query, max_len).tolist() == match_reference(hay.tolist(), query.tolist(), max_len)


def test_drafts_come_from_an_earlier_response():
    d = SuffixDrafter(max_match=8, min_match=2)
    request = [1, 2, 3, 40, 41]
    assert d.propose(request, 4) == []  # 40 41 never occurred before
    d.finished([9, 40, 41, 42, 43, 44, 45])
    assert d.propose(request, 4) == [42, 43, 44, 45]
    assert SuffixDrafter(max_match=8, min_match=2, use_cache=False).propose(request, 4) == []


def test_a_continuation_stops_at_the_end_of_a_response():
    d = SuffixDrafter(max_match=8, min_match=2)
    d.finished([40, 41, 42])
    d.finished([77, 78, 79])
    assert d.propose([5, 40, 41], 4) == [42]  # not 42, SEP, 77, ...


def test_the_cache_evicts_the_oldest_responses():
    c = ResponseCache(max_tokens=10)
    c.add([1, 2, 3, 4])
    c.add([5, 6, 7, 8])
    assert c.tokens.tolist() == [1, 2, 3, 4, SEP, 5, 6, 7, 8, SEP]
    c.add([9, 10])
    assert c.tokens.tolist() == [5, 6, 7, 8, SEP, 9, 10, SEP] and c.size == 8
    c.add([0])  # one token: nothing to learn
    assert c.size == 8


def test_disagreeing_continuations_stop_the_walk():
    d = SuffixDrafter(max_match=8, min_match=2, min_support=0.6)
    for tail in ([50, 51], [50, 52], [50, 53]):
        d.finished([40, 41, *tail])
    assert d.propose([40, 41], 4) == [50]  # then 51/52/53 split three ways: 1/3 < 0.6


def test_the_better_scored_source_wins():
    d = SuffixDrafter(max_match=8, min_match=2, min_support=0.3)
    own = [40, 41, 7, 1, 40, 41, 8, 2, 40, 41]  # own text: after 40 41 comes 7 or 8, split
    assert d.propose_scored(own, 2) == ([8, 2], 1.0)  # 7 or 8 (ties: the most recent), then 2
    for _ in range(3):
        d.finished([40, 41, 60, 61])  # the cache agrees on 60 61 three times
    assert d.propose(own, 2) == [60, 61]
    drafts, score = d.propose_scored(own, 2)
    assert score == pytest.approx(2.0)


def test_config_of_the_combined_method():
    c = SpeculativeConfig(method="eagle_suffix")
    assert c.model is None and c.min_draft_prob == 0.2 and c.max_running == 32 and c.eagle_max_running == 4
    assert SpeculativeConfig(method="eagle3").min_draft_prob == 0.0
    with pytest.raises(ValueError, match="^speculative_config: min_draft_prob must be a number in"):
        SpeculativeConfig(method="eagle_suffix", min_draft_prob=1.5)


def test_eagle_suffix_greedy_equals_off_on_the_default_model(eh):
    """k3-default with its shipped head (no 'model' given) on tool-calling tasks: the same tokens as without
    speculation, drafts accepted, the cache fed by the first wave's responses."""
    import random

    from training import tasks
    from training.render import prompt_ids
    from training.tok import load_tokenizer

    tok, rng = load_tokenizer(), random.Random(5)
    prompts = [prompt_ids(tasks.make("tool", rng, held_out=True), tok) for _ in range(2)]
    model = eh.get_model("k3-default")
    ref = eh.run_greedy(eh.make_engine(model, max_model_len=1024), prompts, 40)
    for method in ("eagle3", "eagle_suffix"):
        spec = SpeculativeConfig(method=method, num_speculative_tokens=6)
        engine = LLMEngine("k3-default", config=EngineConfig(kv_cache_memory=32 * 2**20, max_model_len=1024,
                                                             speculative_config=spec))
        assert eh.run_greedy(engine, prompts, 40) == ref
        assert eh.run_greedy(engine, prompts, 40, prefix="again") == ref  # now with both answers in the cache
        s = engine.scheduler
        assert s.num_accepted_tokens > 0.5 * s.num_spec_rows, method


def test_no_shipped_head_is_one_error(eh):
    with pytest.raises(ValueError, match="^speculative_config: no eagle3 head ships with this model"):
        LLMEngine("k3-tiny-random", config=EngineConfig(kv_cache_memory=32 * 2**20, max_model_len=256,
                                                        speculative_config=SpeculativeConfig(method="eagle_suffix")))
