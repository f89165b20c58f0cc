"""Issue 50 finding 6: when the grammar engine gives up mid-generation, the request ends with an error; it
never goes on unconstrained to a schema-violating success. The guide records the failure when its mask is
empty or a sampled token does not follow the grammar; the engine core drops that step's token for the
request, aborts it, and answers an error; the other requests of the batch are untouched."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import torch

from k3serve.engine.core import EngineCore
from k3serve.engine.guided import Guide, GuidedDecoding
from k3serve.engine.outputs import RequestOutput


class _Matcher:
    """A stand-in llguidance matcher: `mask` is what compute_bitmask answers, `accepts` what consume does."""

    def __init__(self, mask: bytes, accepts: bool = True, error: str = ""):
        self.mask, self.accepts, self.error = mask, accepts, error

    def consume_tokens(self, tokens):
        return self.accepts

    def compute_bitmask(self):
        return self.mask

    def get_error(self):
        return self.error

    def is_error(self):
        return bool(self.error)


def _guide(matcher, failures):
    return Guide(matcher, {}, ThreadPoolExecutor(1), "r1", failures)


def test_an_empty_mask_records_a_failure_and_leaves_the_row_finite():
    failures = []
    g = _guide(_Matcher(bytes(2), error="too complex"), failures)
    logits = torch.zeros(16)
    g.prepare([])
    g.apply(logits)
    assert failures == [("r1", "too complex")] and g.failed and torch.isfinite(logits).all()
    g.prepare([5])  # a failed guide stays quiet: one failure per request
    g.apply(logits)
    assert failures == [("r1", "too complex")]


def test_a_token_off_the_grammar_records_a_failure():
    failures = []
    g = _guide(_Matcher(b"\xff\xff", accepts=False, error="token 7 not allowed"), failures)
    g.prepare([7])
    assert failures == [("r1", "token 7 not allowed")]


def test_a_working_mask_constrains_the_row_and_records_nothing():
    failures = []
    g = _guide(_Matcher(b"\x05\x00"), failures)  # tokens 0 and 2 allowed
    logits = torch.zeros(16)
    g.prepare([])
    g.apply(logits)
    assert failures == [] and torch.isfinite(logits).nonzero().flatten().tolist() == [0, 2]


def test_the_core_ends_a_failed_request_with_an_error_and_drops_its_token():
    core = EngineCore.__new__(EngineCore)
    aborted = []
    step = [RequestOutput("g", [1], [9], delta_token_ids=[9]), RequestOutput("h", [1], [4], delta_token_ids=[4])]
    core.engine = SimpleNamespace(step=lambda: step, abort_request=aborted.append)
    core.guide = GuidedDecoding(163840, 163586, enabled=False)
    core.guide._failures.append(("g", "the grammar allows no next token"))
    core.pd = SimpleNamespace(ticket=lambda rid: None, abort=lambda rid: None, prefill_only=False)  # colocated
    core.group = core.dp_sync = None  # one process, no data-parallel lockstep
    out = {o.request_id: o for o in core.step()}
    assert aborted == ["g"]
    assert out["g"].finished and out["g"].token_ids == [] and "grammar" in out["g"].error
    assert out["h"].token_ids == [4] and out["h"].error is None
    again = core.step()  # reported once: the next step's outputs pass through
    assert [(o.request_id, o.error) for o in again] == [("g", None), ("h", None)]
