"""Issue 50: a fresh grammar compiles on the grammar thread, not on the engine loop. While it compiles,
other requests are added and stepped; the request joins the batch once its grammar is ready, or fails
alone when it cannot compile. The engine here is a stand-in that records what it is given; the compile
is held on an event, so "not blocked" is shown by ordering, not timing."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from k3serve.engine.core import EngineCore
from k3serve.engine.guided import GuidedDecoding
from k3serve.engine.messages import AbortRequest, AddRequest
from k3serve.engine.sampling_params import SamplingParams

GRAMMAR = 'start: "yes" | "no"\n'


def _core(monkeypatch):
    core = EngineCore.__new__(EngineCore)
    added, aborted = [], []
    core.engine = SimpleNamespace(add_request=lambda rid, *a, **kw: added.append(rid),
                                  abort_request=aborted.append)
    core.guide = GuidedDecoding(163840, 163586, enabled=True)
    core.compiling = {}
    core.pd = SimpleNamespace(ticket=lambda rid: None, abort=lambda rid: None, prefill_only=False)  # colocated
    entered, release = threading.Event(), threading.Event()
    compile_now = core.guide._compile

    def held(grammar):
        entered.set()
        release.wait(timeout=30)  # on the engine loop (the bug) this wait would hold every other request
        return compile_now(grammar)

    monkeypatch.setattr(core.guide, "_compile", held)
    return core, added, aborted, entered, release


def _add(rid: str, grammar: str | None = None) -> AddRequest:
    return AddRequest(rid, [1, 2, 3], SamplingParams(), grammar=grammar)


def _drain(core):
    out = []
    for _, fut in list(core.compiling.values()):
        fut.exception(timeout=60)
    out += core.admit_compiled()
    return out


def test_other_requests_run_while_a_grammar_compiles(monkeypatch):
    core, added, _, entered, release = _core(monkeypatch)
    assert core.handle(_add("g", GRAMMAR)) == []
    assert entered.wait(30)
    assert core.handle(_add("plain")) == [] and added == ["plain"]  # not behind the compile
    assert core.admit_compiled() == [] and added == ["plain"]  # still compiling: not added yet
    release.set()
    assert _drain(core) == [] and added == ["plain", "g"]
    assert core.handle(_add("g2", GRAMMAR)) == [] and added[-1] == "g2"  # compiled once: added at once


def test_a_bad_grammar_fails_only_its_request(monkeypatch):
    core, added, _, _, release = _core(monkeypatch)
    release.set()
    core.handle(_add("bad", "start: nosuchrule\n"))
    (out,) = _drain(core)
    assert out.request_id == "bad" and out.finished and out.error.startswith("grammar:") and not added


def test_abort_while_compiling_drops_the_request(monkeypatch):
    core, added, aborted, entered, release = _core(monkeypatch)
    core.handle(_add("g", GRAMMAR))
    assert entered.wait(30)
    core.handle(AbortRequest(["g"]))
    release.set()
    assert _drain(core) == [] and not added and not aborted and not core.compiling
