"""Shared fixtures: a per-session cache directory for built-in random models, deterministic torch, the
in-repo Mooncake trace slice."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Triton decides at kernel decoration (import) whether to interpret: set before any test imports k3serve.ops,
# so the GPU backends' tests run their kernels on CPU tensors where no GPU is present (a no-op without triton).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True, scope="session")
def _k3serve_cache(tmp_path_factory):
    os.environ.setdefault("K3SERVE_CACHE", str(tmp_path_factory.mktemp("k3serve-cache")))
    # The tiny models run many small ops: one intra-op thread is faster than two (no barrier waits), and
    # it leaves the second core to the servers some tests start.
    torch.set_num_threads(1)
    yield


@pytest.fixture(scope="session")
def mooncake_trace() -> Path:
    """The last 200 requests of Mooncake's synthetic trace (see tests/data/README.md): real prefix reuse."""
    return Path(__file__).resolve().parent / "data" / "mooncake_synthetic_tail200.jsonl"
