"""Engine test fixtures: the tiny random models (fp32, loaded once per session) and ``eh``, the helper
functions (tests import nothing from here: pytest runs with --import-mode=importlib)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.sampling_params import SamplingParams
from k3serve.models.loader import load_model

MODELS = ["kimi-linear-tiny-random", "k3-tiny-random"]


_loaded: dict[str, tuple] = {}


def get_model(name: str):
    if name not in _loaded:
        _loaded[name] = load_model(name, dtype=torch.float32, progress=False)
    return _loaded[name]


@pytest.fixture(scope="module", params=MODELS)
def tiny(request):
    """``(model, model_config)`` of each tiny config."""
    return get_model(request.param)


def random_prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(0, 2000, (k,), generator=g).tolist() for k in lens]


def make_engine(tiny, **cfg) -> LLMEngine:
    model, config = tiny
    cfg.setdefault("kv_cache_memory", 32 * 2**20)
    cfg.setdefault("max_model_len", 256)
    return LLMEngine(model, model_config=config, config=EngineConfig(**cfg))


def drain(engine: LLMEngine) -> dict[str, object]:
    """Step until idle; the final output of every request by id."""
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return done


def run_greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, prefix: str = "") -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", p, params)
    done = drain(engine)
    return [done[f"{prefix}{i}"].token_ids for i in range(len(prompts))]


@pytest.fixture(scope="session")
def eh():
    return SimpleNamespace(make_engine=make_engine, drain=drain, run_greedy=run_greedy, random_prompts=random_prompts,
                           get_model=get_model)
