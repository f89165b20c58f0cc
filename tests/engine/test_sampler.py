"""Sampler: filters, penalties and min_tokens on hand-made logits; seeded draws independent of the batch;
logprobs (sampled + top-k, and prompt logprobs) equal the log-softmax of the model's own logits."""

from __future__ import annotations

import pytest
import torch

from k3serve.engine.request import Request
from k3serve.engine.sampler import draw_top_p, filter_logits_reference, inverse_cdf, mask_top_k, sample
from k3serve.engine.sampling_params import SamplingParams
from k3serve.models.generate import SimpleRunner


def req(rid="r", prompt=(1, 2), **kw) -> Request:
    return Request(rid, list(prompt), SamplingParams(**kw), eos_token_ids=(3,))


def test_filters_keep_the_expected_sets():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    out = filter_logits_reference(logits, top_k=torch.tensor([2, 0, 0]), top_p=torch.tensor([1.0, 0.7, 1.0]),
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


def test_reference_without_filters_is_identity():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    off = filter_logits_reference(logits, torch.zeros(3, dtype=torch.long), torch.ones(3), torch.zeros(3))
    assert torch.equal(off, logits)
    full = filter_logits_reference(logits, torch.full((3,), 50), torch.ones(3), torch.zeros(3))
    assert torch.equal(full, logits)


def _params(M):
    """Per-row filters mixing top-p (tiny to 1), top-k and min-p, different in every row."""
    top_p = torch.tensor([[0.95, 1.0, 1e-6, 0.5, 0.999, 0.3, 0.9][i % 7] for i in range(M)])
    top_k = torch.tensor([[0, 0, 0, 40, 0, 3, 1000][i % 7] for i in range(M)])
    min_p = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.01, 0.0, 0.05][i % 7] for i in range(M)])
    return top_k, top_p, min_p


def _draws(logits, top_k, top_p, min_p, rounds, seed=0):
    """``rounds`` draws of ``draw_top_p`` per row: ``[rounds, M]``."""
    gen = torch.Generator().manual_seed(seed)
    probs = mask_top_k(logits, top_k).softmax(-1)
    return torch.stack([draw_top_p(probs, top_p, min_p,
                                   lambda rows: torch.rand(rows.numel(), dtype=torch.float64, generator=gen))
                        for _ in range(rounds)])


@pytest.mark.parametrize("shape", [(1, 7), (3, 1000), (7, 4099), (9, 20011), (5, 65537)])
@pytest.mark.parametrize("scale", [0.05, 0.3, 3.0, 12.0])  # near-flat to peaked
def test_draws_stay_in_the_reference_set(shape, scale):
    gen = torch.Generator().manual_seed(shape[1])
    logits = torch.randn(*shape, generator=gen) * scale
    top_k, top_p, min_p = _params(shape[0])
    kept = torch.isfinite(filter_logits_reference(logits, top_k, top_p, min_p))
    draws = _draws(logits, top_k, top_p, min_p, rounds=40)
    assert kept.gather(1, draws.T).all()


def test_draws_reach_exactly_the_reference_set_with_ties_and_zeros():
    """Integer logits (many tied probabilities, the set's edge inside a tie), rows with masked-out zeros, every
    filter: over enough draws the tokens drawn are exactly the reference set, no more, no fewer."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randint(0, 4, (12, 24), generator=gen).float()
    logits[::3, 16:] = float("-inf")
    top_p = torch.rand(12, generator=gen).clamp(min=0.05)
    top_p[5] = 1.0
    top_k = torch.tensor([0, 0, 5, 0, 0, 0, 0, 12, 0, 0, 1, 0])
    min_p = torch.tensor([0, 0, 0, 0.3, 0, 0, 0, 0, 0.9, 0, 0, 0])
    kept = torch.isfinite(filter_logits_reference(logits, top_k, top_p, min_p))
    draws = _draws(logits, top_k, top_p, min_p, rounds=600, seed=1)
    seen = torch.zeros_like(kept).scatter_(1, draws.T, True)
    assert torch.equal(seen, kept)


def test_ties_are_kept_or_dropped_together():
    logits = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.2, 0.0]] * 2)).float()
    logits[1] = torch.tensor([3.0, 2.0, 2.0, 0.0, -1.0])
    # top-p 0.5: the mass reaches p inside the tie of 0.2s, so all three stay
    out = filter_logits_reference(logits[:1], torch.tensor([0]), torch.tensor([0.5]), torch.tensor([0.0]))
    assert torch.isfinite(out).tolist() == [[True, True, True, True, False]]
    drawn = _draws(logits[:1], torch.tensor([0]), torch.tensor([0.5]), torch.tensor([0.0]), rounds=300)
    assert set(drawn.flatten().tolist()) == {0, 1, 2, 3}
    # top-k 2 with the 2nd and 3rd logits equal keeps both
    out = filter_logits_reference(logits[1:], torch.tensor([2]), torch.tensor([1.0]), torch.tensor([0.0]))
    assert torch.isfinite(out).tolist() == [[True, True, True, False, False]]
    assert torch.isfinite(mask_top_k(logits[1:], torch.tensor([2]))).tolist() == [[True, True, True, False, False]]


@pytest.mark.parametrize("scale", [8.0, 1.0, 0.05])  # peaked, broad, near-flat
def test_top_p_does_not_sort_the_vocabulary(monkeypatch, scale):
    logits = torch.randn(4, 50_000, generator=torch.Generator().manual_seed(0)) * scale
    kept = torch.isfinite(filter_logits_reference(logits, torch.zeros(4, dtype=torch.long), torch.full((4,), 0.95),
                                                  torch.zeros(4)))

    def no_sort(*a, **kw):
        raise AssertionError("full-vocabulary sort")

    monkeypatch.setattr(torch.Tensor, "sort", no_sort)
    monkeypatch.setattr(torch, "sort", no_sort)
    reqs = [req(str(i), temperature=1.0, top_p=0.95, seed=i) for i in range(4)]
    for _ in range(5):
        toks = torch.tensor(sample(logits, reqs).tokens)
        assert kept.gather(1, toks[:, None]).all()


def test_seeded_draws_follow_the_reference_filter():
    """Temperature, top-k, top-p and min-p reach the draw as the reference applies them: every seeded draw
    is in the reference set, and the same seeds draw the same tokens again."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 3000, generator=gen) * 4
    kw = [dict(top_p=0.95), dict(top_p=0.5, top_k=20), dict(top_p=1.0, min_p=0.1), dict(top_p=1e-6),
          dict(top_p=0.8, temperature=0.6), dict(top_k=5)]

    def reqs():
        return [req(str(i), seed=7 + i, **{"temperature": 1.0, **k}) for i, k in enumerate(kw)]

    p = [r.params for r in reqs()]
    kept = torch.isfinite(filter_logits_reference(logits / torch.tensor([q.temperature for q in p])[:, None],
                                                  torch.tensor([q.top_k for q in p]),
                                                  torch.tensor([q.top_p for q in p]),
                                                  torch.tensor([q.min_p for q in p])))
    first, again = reqs(), reqs()
    runs = [[sample(logits, rs).tokens for _ in range(30)] for rs in (first, again)]
    assert runs[0] == runs[1]
    assert kept.gather(1, torch.tensor(runs[0]).T).all()
    assert len({tuple(r) for r in runs[0]}) > 1  # the rounds do not all repeat one draw


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


def test_draws_match_the_renormalised_reference_distribution():
    """Chi-square (20,000 draws over 40 categories, fixed seed; critical value 95.0 is p = 1e-4 at 39 degrees
    of freedom) of ``draw_top_p`` against the reference set renormalised, for rows that need several rejection
    rounds (top-p 0.3 over a broad row) and for top-p with min-p."""
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(40, generator=gen) * 0.7
    n = 20000
    for top_p, min_p in ((0.3, 0.0), (0.9, 0.4)):
        tp, mp = torch.full((n,), top_p), torch.full((n,), min_p)
        want = filter_logits_reference(logits[None], torch.zeros(1, dtype=torch.long), tp[:1], mp[:1]).softmax(-1)[0]
        draws = draw_top_p(logits.softmax(-1).expand(n, -1), tp, mp,
                           lambda rows: torch.rand(rows.numel(), dtype=torch.float64, generator=gen))
        counts = torch.bincount(draws, minlength=40).double()
        expected = want.double() * n
        on = expected > 0
        assert counts[~on].sum() == 0 and 3 < int(on.sum()) < 40
        chi2 = float(((counts[on] - expected[on]) ** 2 / expected[on]).sum())
        assert chi2 < 95.0, (top_p, min_p, chi2)


def test_a_top_p_that_rounds_to_zero_still_draws_the_most_likely_token():
    """top_p 5e-324 is 0 in fp32; the draw must still end (it spun forever) with the argmax token."""
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(2))
    reqs = [req(str(i), temperature=1.0, top_p=5e-324) for i in range(3)]
    assert sample(logits, reqs).tokens == logits.argmax(-1).tolist()
