"""An idle data-parallel rank's dummy step (``LLMEngine.dummy_step``) touches no request's cache: a checksum of
every running request's KDA state and conv rows, every cached snapshot and every request's MLA blocks is the
same before and after dummy steps, and the requests then finish exactly as without them. A negative control
points the same one-token step at a real slot and block and must change the checksum."""

from __future__ import annotations

import hashlib

import pytest
import torch

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine, dummy_inputs
from k3serve.engine.sampling_params import SamplingParams
from k3serve.models.loader import load_model

PROMPTS = [[5 + i, 7, 9, 11] * 6 for i in range(3)] + [[5, 7, 9, 11] * 6 + [3, 4]]  # the last hits a snapshot


@pytest.fixture(scope="module")
def tiny():
    return load_model("k3-tiny-random", dtype=torch.float32, progress=False)


def engine_with_requests(tiny) -> LLMEngine:
    model, config = tiny
    engine = LLMEngine(model, model_config=config,
                       config=EngineConfig(max_num_seqs=4, max_model_len=128, kv_cache_memory=16 * 2**20,
                                           max_num_batched_tokens=32))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, params)
    for _ in range(4):  # prefills done (chunked), decodes under way, a snapshot published
        engine.step()
    return engine


def checksum(engine: LLMEngine) -> str:
    caches, rows = engine.runner.caches, engine.runner.state_rows
    slots = sorted({r.slot for r in engine.scheduler.requests.values() if r.slot is not None}
                   | set(engine.states.snapshot_of.values()))
    blocks = sorted({b for r in engine.scheduler.requests.values() for b in r.block_ids})
    h = hashlib.sha256()
    for s in slots:
        for t in (*caches.kda_state.values(), *caches.kda_conv.values()):
            h.update(t[rows.row_of[s]].numpy().tobytes())
    for t in caches.mla.values():
        h.update(t[blocks].numpy().tobytes())
    return h.hexdigest()


def finish(engine: LLMEngine) -> dict[str, list[int]]:
    out = {}
    while engine.has_unfinished_requests():
        out.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
    return out


def test_dummy_steps_leave_every_request_state_alone(tiny):
    plain = finish(engine_with_requests(tiny))
    engine = engine_with_requests(tiny)
    assert engine.states.num_snapshots > 0 and len(engine.scheduler.running) > 1
    before = checksum(engine)
    for _ in range(3):
        engine.dummy_step()
    assert checksum(engine) == before
    assert finish(engine) == plain


def test_negative_control_a_step_on_a_real_slot_changes_the_checksum(tiny):
    engine = engine_with_requests(tiny)
    before = checksum(engine)
    req = engine.scheduler.running[0]
    engine.runner.execute(dummy_inputs(req.block_ids[0], req.slot, 1))
    assert checksum(engine) != before
