"""Shared fixtures: a per-session cache directory for built-in random models, deterministic torch."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _k3serve_cache(tmp_path_factory):
    os.environ.setdefault("K3SERVE_CACHE", str(tmp_path_factory.mktemp("k3serve-cache")))
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    yield
