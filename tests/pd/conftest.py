"""P/D test fixtures: the tiny random K3 model (fp32, loaded once) and ``pd``, helpers that run a request
through a prefill engine and a decode engine in this process (tests import nothing from here)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.pd.handoff import export, held_hashes, import_manifest, reserve
from k3serve.models.loader import load_model

_loaded: dict[str, tuple] = {}


def get_model(name: str):
    if name not in _loaded:
        _loaded[name] = load_model(name, dtype=torch.float32, progress=False)
    return _loaded[name]


@pytest.fixture(scope="session")
def tiny():
    return get_model("k3-tiny-random")


@pytest.fixture(scope="session")
def fullvocab():
    """k3-tiny with the Kimi vocabulary: grammars (structured outputs) need its special ids."""
    return get_model("k3-tiny-fullvocab-random")


@pytest.fixture(scope="session")
def default():
    """The shipped trained model (k3-default): real activations, not random ones."""
    return get_model("k3-default")


def make_engine(tiny, **cfg) -> LLMEngine:
    model, config = tiny
    cfg.setdefault("kv_cache_memory", 16 * 2**20)
    cfg.setdefault("max_model_len", 256)
    cfg.setdefault("max_num_seqs", 4)
    return LLMEngine(model, model_config=config, config=EngineConfig(**cfg))


def prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(0, 2000, (k,), generator=g).tolist() for k in lens]


def drain(engine: LLMEngine, outs: dict | None = None) -> dict:
    """Step until idle; every output by request id, in order."""
    outs = {} if outs is None else outs
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def colocated(engine: LLMEngine, rid: str, prompt: list[int], params, **kw) -> list:
    """``kw``: ``images``, ``logits_processor`` (as ``add_request`` takes them)."""
    engine.add_request(rid, prompt, params, **kw)
    return drain(engine)[rid]


def prefill(p: LLMEngine, rid: str, prompt: list[int], params, **kw):
    p.add_request(rid, prompt, params, prefill_only=True, **kw)
    out = drain(p)[rid]
    assert out[-1].finished and rid in p.scheduler.held
    return out


def transfer(p: LLMEngine, d: LLMEngine, rid: str, prompt: list[int], params, tamper=None, **kw):
    """Reserve on d, export from p (skipping what d holds), optionally ``tamper(manifest, payloads)``, ack p,
    import into d; returns (first output, manifest, payloads). ``kw``: ``images``, ``logits_processor`` for d."""
    req = reserve(d, rid, prompt, params, **kw)
    assert req is not None
    try:
        manifest, payloads = export(p, rid, held_hashes(req), d.blocks.block_size)
        p.scheduler.finish(p.scheduler.held[rid], "handoff")  # the ack
        if tamper is not None:
            manifest, payloads = tamper(manifest, payloads)
        first = import_manifest(d, req, manifest, payloads)
    except Exception:
        d.abort_request(rid)
        raise
    return first, manifest, payloads


def disaggregated(p: LLMEngine, d: LLMEngine, rid: str, prompt: list[int], params, *, images=(),
                  processors=(None, None)) -> list:
    """``processors``: the prefill side's and the decode side's logits processor (two fresh ones)."""
    prefill(p, rid, prompt, params, images=images, logits_processor=processors[0])
    first, _, _ = transfer(p, d, rid, prompt, params, images=tuple(images), logits_processor=processors[1])
    return drain(d, {rid: [first]})[rid]


def same(a: list, b: list) -> None:
    """Two runs' outputs: the same tokens, step by step, and top-k logprobs within 1e-5."""
    assert a[-1].token_ids == b[-1].token_ids
    assert [o.delta_token_ids for o in a] == [o.delta_token_ids for o in b]
    la, lb = a[-1].logprobs or [], b[-1].logprobs or []
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert list(x) == list(y) and max(abs(x[k] - y[k]) for k in x) <= 1e-5


def pools_full(e: LLMEngine) -> bool:
    return (e.blocks.num_used == 0 and e.states.num_running_free == e.states.max_running
            and not e.scheduler.held and not e.scheduler.requests)


@pytest.fixture
def pd():
    return SimpleNamespace(make_engine=make_engine, prompts=prompts, drain=drain, colocated=colocated,
                           prefill=prefill, transfer=transfer, disaggregated=disaggregated, pools_full=pools_full,
                           same=same)
