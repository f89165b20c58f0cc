"""``retain_freed_memory``: a CPU engine asks glibc to keep freed memory (``memory.keep_freed_memory``)."""

from __future__ import annotations

import ctypes

import pytest

import k3serve.engine.engine as engine_module
from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.memory import keep_freed_memory
from k3serve.models.loader import load_model


def test_keep_freed_memory_applies_on_glibc():
    try:
        ctypes.CDLL(None).gnu_get_libc_version
    except AttributeError:
        pytest.skip("not glibc")
    assert keep_freed_memory() is True


@pytest.mark.parametrize("retain", [True, False])
def test_engine_applies_it_only_when_configured(retain, monkeypatch):
    calls = []
    monkeypatch.setattr(engine_module, "keep_freed_memory", lambda: calls.append(1) or True)
    model, cfg = load_model("kimi-linear-tiny-random", progress=False)
    LLMEngine(model, model_config=cfg, config=EngineConfig(kv_cache_memory=8 * 2**20, max_model_len=256,
                                                           retain_freed_memory=retain))
    assert calls == ([1] if retain else [])
