"""Speculative decoding's verification keeps the target distribution (temperature > 0), is reproducible for a
seed, checks drafts against a grammar's mask; its drafters and its config.

The distribution test draws the first and second emitted tokens many times from ``verify_drafts`` over a tiny
model's real next-token distributions (temperature 0.9, top-k 6) with a draft that is sometimes right, and
compares them with the sampler's distribution by a chi-square test. Each check has false-alarm rate 1e-3."""

from __future__ import annotations

import json

import pytest
import torch

from k3serve.core.context import forward_context
from k3serve.engine.request import Request
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.spec.config import SpeculativeConfig
from k3serve.engine.spec.drafters import NgramDrafter, SuffixDrafter
from k3serve.engine.spec.rejection import target_probs, verify_drafts

ALPHA = 1e-3


def _tiny_logits(eh, T):
    """Logits ``[T, V]`` of the tiny model at the last T positions of a fixed prompt (no caches: T fresh)."""
    engine = eh.make_engine(eh.get_model("k3-tiny-random"))
    prompt = list(range(100, 112))
    req = engine.add_request("x", prompt, SamplingParams(max_tokens=1))
    batch = engine.scheduler.schedule()
    engine.runner.state_rows.arrange([r.slot for r in batch.requests])
    s = engine.runner.inputs(batch, [], [])
    ids, ctx = torch.tensor(s.input_ids), engine.runner.context(s)
    with torch.inference_mode(), forward_context(ctx):
        hidden = engine.runner.model(ids, ctx)
        logits = engine.runner.model.compute_logits(hidden[-T:])
    return req, logits.float()


def _chi2(samples: list[int], probs: torch.Tensor) -> float:
    support = torch.nonzero(probs > 0).flatten().tolist()
    counts = torch.bincount(torch.tensor(samples), minlength=probs.numel())
    assert counts.sum() == counts[support].sum(), "a token outside the target's support was emitted"
    expected = probs[support].double() / probs[support].double().sum() * len(samples)
    observed = counts[support].double()
    stat = ((observed - expected) ** 2 / expected).sum()
    dof = len(support) - 1
    # Pearson's test: P(chi2_dof >= stat), the regularised upper incomplete gamma Q(dof/2, stat/2)
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2).item()


def test_rejection_sampling_keeps_the_target_distribution(eh):
    req, logits = _tiny_logits(eh, 3)
    req.params = SamplingParams(temperature=0.9, top_k=6, max_tokens=8)
    p0 = target_probs(logits[0], req)
    second_best = int(p0.topk(2).indices[1])
    drafts = [second_best, int(target_probs(logits[1], req).argmax())]
    torch.manual_seed(0)
    first, second = [], []
    for _ in range(6000):
        out, _ = verify_drafts(logits, req, drafts)
        first.append(out[0])
        if out[0] == drafts[0]:
            second.append(out[1])
    assert _chi2(first, p0) > ALPHA
    assert len(second) > 500 and _chi2(second, target_probs(logits[1], req)) > ALPHA
    # the control: without the residual the first token over-weights the draft, and the test sees it
    biased = [drafts[0] if torch.rand(()) < 0.5 else f for f in first[:3000]]
    assert _chi2(biased, p0) < ALPHA


def test_greedy_verification_accepts_exactly_the_argmax_prefix(eh):
    req, logits = _tiny_logits(eh, 4)
    req.params = SamplingParams(temperature=0, max_tokens=8)
    top = logits.argmax(-1).tolist()
    assert verify_drafts(logits, req, top[:3])[0] == top
    assert verify_drafts(logits, req, [top[0], top[1] + 1, top[2]])[0] == top[:2]
    assert verify_drafts(logits[:1], req, [])[0] == top[:1]


def test_seeded_speculative_sampling_is_reproducible(tiny, eh):
    def run():
        engine = eh.make_engine(tiny, speculative_config=SpeculativeConfig(num_speculative_tokens=3))
        engine.scheduler.speculator.drafter = NgramDrafter(1, 2)
        prompt = [5, 6, 7, 8] * 6
        engine.add_request("s", prompt, SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True))
        return eh.drain(engine)["s"].token_ids

    assert run() == run()


def test_drafters():
    ids = [1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 7, 8, 1, 2, 3]
    assert NgramDrafter(2, 4).propose(ids, 3) == [4, 7, 8]  # the most recent match
    assert NgramDrafter(2, 4).propose(ids, 0) == []
    assert NgramDrafter(2, 4).propose([1, 2, 3], 4) == []  # no earlier occurrence: zero drafts
    loop = [5, 6, 7, 1, 5, 6, 7, 1, 5, 6, 7, 2, 5, 6]
    assert SuffixDrafter().propose(loop, 4) == [7, 1, 5, 6]  # the continuation most occurrences agree on
    assert SuffixDrafter(min_support=0.9).propose(loop, 4) == [7]  # stops where they disagree
    assert SuffixDrafter().propose([3, 4], 2) == []


@pytest.mark.parametrize("text, why", [
    ('{"method": "foo"}', "unknown method 'foo'"),
    ('{"method": "ngram", "num_speculative_tokens": -1}', "num_speculative_tokens must be an integer >= 0"),
    ("{bad", "not valid JSON"),
    ("[1]", "must be a JSON object"),
    ('{"method": "ngram", "k": 2}', "unknown key 'k'"),
    ('{"num_speculative_tokens": 2}', "'method' is required"),
    ('{"method": "suffix", "prompt_lookup_min": 5, "prompt_lookup_max": 3}', "above prompt_lookup_max"),
])
def test_bad_configs_say_why_in_one_line(text, why):
    with pytest.raises(ValueError) as e:
        SpeculativeConfig.parse(text)
    assert why in str(e.value) and "\n" not in str(e.value) and str(e.value).startswith("speculative_config: ")


def test_good_config():
    c = SpeculativeConfig.parse(json.dumps({"method": "suffix", "num_speculative_tokens": 0}))
    assert c.method == "suffix" and c.num_speculative_tokens == 0 and c.rollback == "slots"


def _guided_run(eh, model, spec, drafter, schema):
    from k3serve.engine.guided import GuidedDecoding

    engine = eh.make_engine(model, speculative_config=spec)
    if drafter is not None:
        engine.scheduler.speculator.drafter = drafter
    gd = GuidedDecoding(engine.vocab_size, engine.eos_token_ids[0], enabled=True)
    grammar = json.dumps({"grammars": [{"json_schema": schema}]})
    out = {}
    for i in range(2):
        proc = gd.processor(grammar, {}, str(i))
        engine.add_request(str(i), [10 + i, 20, 30, 40], SamplingParams(temperature=0, max_tokens=16),
                           logits_processor=proc)
    for o in eh.drain(engine).values():
        out[o.request_id] = o.token_ids
    assert not gd.take_failures()
    return [out["0"], out["1"]], engine


def test_json_schema_requests_under_speculation(eh):
    model = eh.get_model("k3-tiny-fullvocab-random")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
              "required": ["a", "b"], "additionalProperties": False}
    ref, _ = _guided_run(eh, model, None, None, schema)

    class Spoiled:  # the spec-off continuation with its last draft replaced by a token the grammar forbids
        def propose(self, ids, k):
            for r, p0 in zip(ref, (10, 11)):
                prompt = [p0, 20, 30, 40]
                if ids[:4] == prompt:
                    d = list(r[len(ids) - 4:][:k])
                    return d[:-1] + [7] if len(d) > 1 else d
            return []

    got, engine = _guided_run(eh, model, SpeculativeConfig(num_speculative_tokens=4), Spoiled(), schema)
    assert got == ref and engine.scheduler.num_accepted_tokens > 0


def test_plain_greedy_fast_path_agrees_with_verify_drafts(eh):
    from k3serve.engine.spec.rejection import accept_greedy

    req, logits = _tiny_logits(eh, 4)
    req.params = SamplingParams(temperature=0, max_tokens=8)
    top = logits.argmax(-1).tolist()
    for drafts in (top[:3], [top[0], top[1] + 1, top[2]], [top[0] + 1], []):
        T = len(drafts) + 1
        assert accept_greedy(top[:T], drafts) == verify_drafts(logits[:T], req, drafts)[0]
