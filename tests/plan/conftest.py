from __future__ import annotations

import pytest

from k3serve.plan.model_source import load_model_config


@pytest.fixture(scope="session")
def k3():
    return load_model_config("kimi-k3")[1]


@pytest.fixture(scope="session")
def cfgs():
    names = ("kimi-k3", "k3-tiny", "k3-tiny-grouped", "kimi-linear-48b", "kimi-linear-tiny")
    return {n: load_model_config(n)[1] for n in names}
