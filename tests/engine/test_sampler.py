"""Sampler: filters, penalties and min_tokens on hand-made logits; seeded draws independent of the batch;
logprobs (sampled + top-k, and prompt logprobs) equal the log-softmax of the model's own logits."""

from __future__ import annotations

import pytest
import torch

from k3serve.engine.request import Request
from k3serve.engine.sampler import filter_logits, filter_logits_reference, inverse_cdf, nucleus_floor, sample
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


def _params(M, gen):
    """Per-row filters mixing top-p (tiny to 1), top-k and min-p, different in every row."""
    top_p = torch.tensor([[0.95, 1.0, 1e-6, 0.5, 0.999, 0.3, 0.9][i % 7] for i in range(M)])
    top_k = torch.tensor([[0, 0, 0, 40, 0, 3, 1000][i % 7] for i in range(M)])
    min_p = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.01, 0.0, 0.05][i % 7] for i in range(M)])
    return top_k, top_p, min_p


@pytest.mark.parametrize("shape", [(1, 7), (3, 1000), (7, 4099), (9, 20011), (5, 65537)])
@pytest.mark.parametrize("scale", [0.3, 3.0, 12.0])  # flat (sorted fallback), middling, peaked (short prefix)
def test_filter_logits_equals_the_sorting_reference(shape, scale):
    gen = torch.Generator().manual_seed(shape[1])
    logits = torch.randn(*shape, generator=gen) * scale
    top_k, top_p, min_p = _params(shape[0], gen)
    fast = filter_logits(logits, top_k, top_p, min_p)
    ref = filter_logits_reference(logits, top_k, top_p, min_p)
    assert torch.equal(fast, ref)
    assert torch.equal(fast.softmax(-1), ref.softmax(-1))
    assert torch.isfinite(fast).sum(-1).min() >= 1


@pytest.mark.parametrize("first_k", [1, 2, 5, 64])
def test_nucleus_floor_of_any_prefix_equals_the_sorted_floor(first_k):
    gen = torch.Generator().manual_seed(first_k)
    # integer logits: many tied probabilities; a top-k mask leaves trailing zeros in some rows
    logits = torch.randint(0, 6, (12, 997), generator=gen).float()
    logits[::3, 20:] = float("-inf")
    top_p = torch.rand(12, generator=gen).clamp(min=1e-3)
    top_p[5] = 1.0
    probs = logits.softmax(-1)
    desc = probs.sort(-1, descending=True).values
    mass = desc.double().cumsum(-1)  # the spec's masses are fp64
    n = (mass < top_p[:, None].double()).sum(-1).clamp(max=996)
    want = torch.where(top_p < 1, desc.gather(-1, n[:, None]).squeeze(-1), 0.0)
    assert torch.equal(nucleus_floor(probs, top_p, first_k=first_k), want)


def test_ties_are_kept_or_dropped_together():
    logits = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.2, 0.0]] * 2)).float()
    logits[1] = torch.tensor([3.0, 2.0, 2.0, 0.0, -1.0])
    for f in (filter_logits, filter_logits_reference):
        # top-p 0.5: the mass reaches p inside the tie of 0.2s, so all three stay
        out = f(logits[:1], torch.tensor([0]), torch.tensor([0.5]), torch.tensor([0.0]))
        assert torch.isfinite(out).tolist() == [[True, True, True, True, False]]
        # top-k 2 with the 2nd and 3rd logits equal keeps both
        out = f(logits[1:], torch.tensor([2]), torch.tensor([1.0]), torch.tensor([0.0]))
        assert torch.isfinite(out).tolist() == [[True, True, True, False, False]]


@pytest.mark.parametrize("scale", [8.0, 0.3])  # peaked (read from the top), near-flat (from the bottom)
def test_top_p_does_not_sort_the_vocabulary(monkeypatch, scale):
    logits = torch.randn(4, 50_000, generator=torch.Generator().manual_seed(0)) * scale
    want = filter_logits_reference(logits, torch.zeros(4, dtype=torch.long), torch.full((4,), 0.95), torch.zeros(4))

    def no_sort(*a, **kw):
        raise AssertionError("full-vocabulary sort")

    monkeypatch.setattr(torch.Tensor, "sort", no_sort)
    monkeypatch.setattr(torch, "sort", no_sort)
    got = filter_logits(logits, torch.zeros(4, dtype=torch.long), torch.full((4,), 0.95), torch.zeros(4))
    assert torch.equal(got, want)


def test_seeded_draws_follow_the_reference_filter():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 3000, generator=gen) * 4
    kw = [dict(top_p=0.95), dict(top_p=0.5, top_k=20), dict(top_p=1.0, min_p=0.1), dict(top_p=1e-6),
          dict(top_p=0.8, temperature=0.6), dict(top_k=5)]
    reqs = [req(str(i), seed=7 + i, **{"temperature": 1.0, **k}) for i, k in enumerate(kw)]
    twins = [torch.Generator().manual_seed(7 + i) for i in range(len(kw))]
    p = [r.params for r in reqs]
    ref = filter_logits_reference(logits / torch.tensor([q.temperature for q in p])[:, None],
                                  torch.tensor([q.top_k for q in p]), torch.tensor([q.top_p for q in p]),
                                  torch.tensor([q.min_p for q in p])).softmax(-1)
    cdf = ref.double().cumsum(-1)
    for _ in range(30):
        got = sample(logits, reqs).tokens
        u = torch.stack([torch.rand((), dtype=torch.float64, generator=g) for g in twins])
        assert got == [int((c > x * c[-1]).nonzero()[0]) for c, x in zip(cdf, u)]


def test_top_p_draws_follow_the_renormalised_nucleus():
    probs = torch.tensor([0.4, 0.2, 0.2, 0.15, 0.05])
    torch.manual_seed(1)
    r = req(temperature=1.0, top_p=0.6)  # the 0.2 tie straddles p: 0.4, 0.2, 0.2 stay
    draws = [sample(probs.log()[None], [r]).tokens[0] for _ in range(4000)]
    freq = torch.bincount(torch.tensor(draws), minlength=5) / 4000
    assert torch.allclose(freq, torch.tensor([0.5, 0.25, 0.25, 0.0, 0.0]), atol=0.03)


def test_inverse_cdf_draws_match_the_distribution():
    """A chi-square test over 40 categories (20,000 draws, fixed seed): at the critical value used, 95.0
    (p = 1e-4 for 39 degrees of freedom), a correct sampler fails one seed in 10,000. Zero-probability
    categories (a filtered row) must never be drawn."""
    gen = torch.Generator().manual_seed(5)
    probs = torch.rand(40, generator=gen) ** 3
    probs[::7] = 0
    probs /= probs.sum()
    n = 20000
    draws = inverse_cdf(probs.expand(n, -1), torch.rand(n, dtype=torch.float64, generator=gen))
    counts = torch.bincount(draws, minlength=40).double()
    assert counts[probs == 0].sum() == 0
    expected = probs.double() * n
    on = expected > 0
    chi2 = float(((counts[on] - expected[on]) ** 2 / expected[on]).sum())
    assert chi2 < 95.0, chi2


def test_inverse_cdf_edges():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]])
    assert inverse_cdf(probs, torch.tensor([0.0, 0.0], dtype=torch.float64)).tolist() == [1, 4]
    almost_one = torch.tensor([1 - 2**-53, 1 - 2**-53], dtype=torch.float64)
    assert inverse_cdf(probs, almost_one).tolist() == [3, 4]
    assert inverse_cdf(probs, torch.tensor([0.5, 0.5], dtype=torch.float64)).tolist() == [3, 4]


def test_floor_from_the_tail_equals_the_sorted_floor():
    """Broad rows over a large vocabulary are read from the least likely end: with ties (integer logits),
    zeros left by a mask, and every p, the floor is the sorted one."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randint(0, 3, (8, 40_000), generator=gen).float() * 0.2
    logits[::2, 25_000:] = float("-inf")  # zeros at the bottom of half the rows
    top_p = torch.tensor([0.95, 0.5, 0.999, 0.9, 0.7, 0.99, 0.3, 0.8])
    probs = logits.softmax(-1)
    desc = probs.sort(-1, descending=True).values
    n = (desc.double().cumsum(-1) < top_p[:, None].double()).sum(-1).clamp(max=39_999)
    want = desc.gather(-1, n[:, None]).squeeze(-1)
    assert torch.equal(nucleus_floor(probs, top_p), want)
