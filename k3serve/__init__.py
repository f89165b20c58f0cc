"""k3serve: a serving stack for Kimi K3-class models (KDA + MLA hybrids, LatentMoE, MXFP4 experts)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from k3serve.engine.llm import LLM
    from k3serve.engine.sampling_params import SamplingParams

# Imported on first use, so that ``import k3serve`` stays cheap (no torch).
_LAZY = {"LLM": "k3serve.engine.llm", "SamplingParams": "k3serve.engine.sampling_params"}
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'k3serve' has no attribute {name!r}")
