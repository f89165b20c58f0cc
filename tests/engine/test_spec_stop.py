"""Verification stops at an accepted stop token: a draft that is EOS (or a stop id) and is accepted ends the
row's tokens there. The drafts after it are neither emitted nor committed to the KDA state, and a grammar
never sees tokens past its end (it would fail the request). Before ``min_tokens`` or with ``ignore_eos`` the
EOS is an ordinary token and verification goes on."""

from __future__ import annotations

import json

import torch

from k3serve.engine.request import Request
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.spec.config import SpeculativeConfig
from k3serve.engine.spec.rejection import accept_greedy, cut_at_stop, verify_drafts

EOS, V = 3, 16


def _logits(argmaxes: list[int]) -> torch.Tensor:
    x = torch.zeros(len(argmaxes), V)
    for j, t in enumerate(argmaxes):
        x[j, t] = 5.0
    return x


def _req(**params) -> Request:
    r = Request("r", [1, 2], SamplingParams(**{"temperature": 0, "max_tokens": 20, **params}), eos_token_ids=(EOS,))
    return r


def test_verification_ends_at_an_accepted_eos():
    drafts = [7, EOS, 9]
    logits = _logits([7, EOS, 9, 11])  # every draft is the argmax
    assert verify_drafts(logits, _req(), drafts)[0] == [7, EOS]
    assert verify_drafts(logits, _req(logprobs=1), drafts)[0] == [7, EOS]
    assert cut_at_stop(_req(), accept_greedy([7, EOS, 9, 11], drafts)) == [7, EOS]
    # a stop id ends it too; ignore_eos and min_tokens make EOS an ordinary token
    assert verify_drafts(logits, _req(stop_token_ids=[7]), drafts)[0] == [7]
    assert cut_at_stop(_req(stop_token_ids=[7]), [7, EOS, 9, 11]) == [7]
    assert verify_drafts(logits, _req(ignore_eos=True), drafts)[0] == [7, EOS, 9, 11]
    assert cut_at_stop(_req(min_tokens=2), [7, EOS, 9, 11]) == [7, EOS, 9, 11]
    assert cut_at_stop(_req(min_tokens=1), [7, EOS, 9, 11]) == [7, EOS]


def test_verification_at_temperature_ends_at_an_accepted_eos():
    x = torch.full((3, V), -30.0)
    x[0, EOS] = 30.0  # p(EOS) = 1 at position 0: the draft is accepted for sure
    out, _ = verify_drafts(x, _req(temperature=1.0), [EOS, 9])
    assert out == [EOS]


class _After:
    """Drafts the spec-off continuation and, past its end, a few more tokens (what a drafter copying text
    after an EOS would do)."""

    def __init__(self, prompt, ref):
        self.prompt, self.ref = prompt, ref

    def propose(self, ids, k):
        n = len(self.prompt)
        if ids[:n] != self.prompt or ids[n:] != self.ref[:len(ids) - n]:
            return []
        return (self.ref[len(ids) - n:] + [11, 12, 13, 14, 15, 16, 17, 18])[:k]


def test_a_json_schema_request_whose_drafts_run_past_its_eos(eh):
    from k3serve.engine.guided import GuidedDecoding

    model = eh.get_model("k3-tiny-fullvocab-random")
    schema = {"enum": ["red", "green"]}  # the random model ends this one (an object runs on in whitespace)
    prompt = [10, 20, 30, 40]

    def run(spec, drafter=None):
        engine = eh.make_engine(model, speculative_config=spec)
        if drafter is not None:
            engine.scheduler.speculator.drafter = drafter
        gd = GuidedDecoding(engine.vocab_size, engine.eos_token_ids[0], enabled=True)
        proc = gd.processor(json.dumps({"grammars": [{"json_schema": schema}]}), {}, "g")
        engine.add_request("g", prompt, SamplingParams(temperature=0, max_tokens=40), logits_processor=proc)
        out = eh.drain(engine)["g"]
        return out, gd.take_failures(), engine

    off, failures, engine = run(None)
    assert off.finish_reason == "stop" and not failures and off.token_ids[-1] in engine.eos_token_ids
    on, failures, engine = run(SpeculativeConfig(num_speculative_tokens=6), _After(prompt, off.token_ids))
    assert not failures and on.token_ids == off.token_ids and on.finish_reason == "stop"
    assert engine.scheduler.num_accepted_tokens == len(off.token_ids) - 1 - engine.scheduler.num_spec_rows
