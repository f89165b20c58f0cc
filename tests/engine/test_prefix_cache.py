"""Acceptance 2: the second turn of a conversation computes only what the first turn did not (engine stats),
and prefix-cache hits give the same tokens as a cold run."""

from __future__ import annotations

from k3serve.engine.sampling_params import SamplingParams
from k3serve.models.generate import greedy_generate

BS = 16


def test_second_turn_computes_only_the_new_tokens(tiny, eh):
    engine = eh.make_engine(tiny, block_size=BS)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    turn1 = eh.random_prompts(1, 37, 37, seed=7)[0]  # 37 + 12 = 49: turn 1 leaves 48 tokens computed
    engine.add_request("t1", turn1, greedy)
    out1 = eh.drain(engine)["t1"]
    new = eh.random_prompts(1, 10, 10, seed=8)[0]
    turn2 = turn1 + out1.token_ids + new
    before = engine.stats()
    engine.add_request("t2", turn2, greedy)
    out2 = eh.drain(engine)["t2"]
    after = engine.stats()
    # 48 tokens come from the cache (MLA blocks + the KDA snapshot at 48); computed: turn 1's last sampled
    # token (never fed to the model in turn 1), the 10 new tokens, and the 11 decode steps of turn 2
    assert out2.num_cached_tokens == 48
    assert after.num_computed_tokens - before.num_computed_tokens == 1 + len(new) + 11
    assert after.num_prefix_hit_tokens - before.num_prefix_hit_tokens == 48
    assert out2.token_ids == greedy_generate(tiny[0], [turn2], 12)[0]


def test_hits_with_an_unaligned_history_recompute_less_than_a_block(tiny, eh):
    engine = eh.make_engine(tiny, block_size=BS, max_num_batched_tokens=64, state_cache_interval=32)
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    history = eh.random_prompts(1, 150, 150, seed=9)[0]
    engine.add_request("a", history, greedy)
    out = eh.drain(engine)["a"]
    turn2 = history + out.token_ids + [5, 6, 7]
    engine.add_request("b", turn2, greedy)
    hit = eh.drain(engine)["b"].num_cached_tokens
    assert len(history) + len(out.token_ids) - BS <= hit < len(turn2)
    # a prompt sharing only the first 100 tokens hits the interval snapshot at 96
    engine.add_request("c", history[:100] + [1, 2, 3], greedy)
    assert eh.drain(engine)["c"].num_cached_tokens == 96


def test_an_exact_repeat_of_a_block_aligned_prompt_hits(tiny, eh):
    # a hit leaves one token to compute, so a 48-token prompt asked again can use at most 32 cached tokens: the
    # snapshot at the prompt's end (48) cannot serve it, the one at the boundary before it (32) does
    engine = eh.make_engine(tiny, block_size=BS)
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompt = eh.random_prompts(1, 48, 48, seed=11)[0]
    engine.add_request("a", prompt, greedy)
    first = eh.drain(engine)["a"]
    engine.add_request("b", prompt, greedy)
    again = eh.drain(engine)["b"]
    assert again.num_cached_tokens == 32
    assert again.token_ids == first.token_ids
    # and a follow-up extending it still resumes from the snapshot at 48
    engine.add_request("c", prompt + [3, 4], greedy)
    assert eh.drain(engine)["c"].num_cached_tokens == 48
