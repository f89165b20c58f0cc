"""Sampler: filters, penalties and min_tokens on hand-made logits; seeded draws independent of the batch;
logprobs (sampled + top-k, and prompt logprobs) equal the log-softmax of the model's own logits."""

from __future__ import annotations

import pytest
import torch

from k3serve.engine.request import Request
from k3serve.engine.sampler import filter_logits, sample
from k3serve.engine.sampling_params import SamplingParams
from k3serve.models.generate import SimpleRunner


def req(rid="r", prompt=(1, 2), **kw) -> Request:
    return Request(rid, list(prompt), SamplingParams(**kw), eos_token_ids=(3,))


def test_filters_keep_the_expected_sets():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    out = filter_logits(logits, top_k=torch.tensor([2, 0, 0]), top_p=torch.tensor([1.0, 0.7, 1.0]),
                        min_p=torch.tensor([0.0, 0.0, 0.2]))
    kept = torch.isfinite(out)
    assert kept.tolist() == [[True, True, False, False], [True, True, False, False], [True, True, True, False]]


def test_greedy_penalties_and_min_tokens():
    logits = torch.tensor([[0.0, 2.0, 1.9, 5.0, -1.0]])
    assert sample(logits, [req(temperature=0)]).tokens == [3]
    r = req(temperature=0, min_tokens=2)  # EOS (3) masked until two tokens exist
    assert sample(logits, [r]).tokens == [1]
    r = req(prompt=(1,), temperature=0, repetition_penalty=2.0)
    r.token_ids += [3]  # 5.0 -> 2.5, still above 2.0 / 2 for the prompt's token 1
    assert sample(logits, [r]).tokens == [3]
    r = req(prompt=(0,), temperature=0, frequency_penalty=2.0)
    r.token_ids += [3, 3]
    assert sample(logits, [r]).tokens == [1]
    assert sample(logits.clone(), [r]).tokens == [1]


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    torch.manual_seed(0)
    r = req(temperature=1.0)
    draws = [sample(probs.log()[None], [r]).tokens[0] for _ in range(3000)]
    freq = torch.bincount(torch.tensor(draws), minlength=3) / 3000
    assert torch.allclose(freq, probs, atol=0.03)


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))

    def draws(rows, order):
        reqs = {i: req(str(i), temperature=0.9, top_p=0.95, seed=100 + i) for i in rows}
        out = {i: [] for i in rows}
        for _ in range(20):
            toks = sample(logits[order], [reqs[i] for i in order]).tokens
            for i, t in zip(order, toks):
                out[i].append(t)
        return out

    alone = {i: draws([i], [i])[i] for i in range(4)}
    together = draws([0, 1, 2, 3], [3, 1, 0, 2])
    assert together == alone and len({tuple(v) for v in alone.values()}) == 4


def test_logprobs_are_log_softmax_of_model_logits(eh):
    model, cfg = eh.get_model("kimi-linear-tiny-random")
    engine = eh.make_engine((model, cfg))
    prompt = eh.random_prompts(1, 23, 23, seed=5)[0]
    engine.add_request("x", prompt, SamplingParams(temperature=0.7, seed=3, max_tokens=5, logprobs=4,
                                                   prompt_logprobs=2, ignore_eos=True))
    out = eh.drain(engine)["x"]
    runner = SimpleRunner(model, max_seqs=1, max_len=64)
    full = prompt + out.token_ids
    # logits of every position of prompt + outputs in one forward
    logits = runner.step({0: full[:1]})
    all_logits = [logits[0]] + [runner.step({0: [t]})[0] for t in full[1:-1]]
    lp = [torch.log_softmax(x, -1) for x in all_logits]
    for k, (tok, got) in enumerate(zip(out.token_ids, out.logprobs)):
        ref = lp[len(prompt) - 1 + k]
        assert list(got)[0] == tok and len(got) in (4, 5)
        top = ref.topk(4)
        assert set(top.indices.tolist()) <= set(got)
        for t, v in got.items():
            assert v == pytest.approx(float(ref[t]), abs=1e-4)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for p in range(1, len(prompt)):
        got = out.prompt_logprobs[p]
        assert got[prompt[p]] == pytest.approx(float(lp[p - 1][prompt[p]]), abs=1e-4)
        assert set(lp[p - 1].topk(2).indices.tolist()) <= set(got)


def test_filter_logits_without_filters_is_identity_and_matches_the_sorting_path():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    off = filter_logits(logits, torch.zeros(3, dtype=torch.long), torch.ones(3), torch.zeros(3))
    assert torch.equal(off, logits)
    # a top_k as large as the vocabulary filters nothing either, but goes through the sort
    full = filter_logits(logits, torch.full((3,), 50), torch.ones(3), torch.zeros(3))
    assert torch.equal(full, logits)
