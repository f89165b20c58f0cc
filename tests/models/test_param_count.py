"""The analytic parameter model (plan.model_math) agrees with the real module tree, built on the meta device,
for every packaged config including the full Kimi K3 (~2.78T) — so the published totals come from the model
k3serve actually builds, not only from formulas."""

from __future__ import annotations

import pytest
import torch

from k3serve.core.config import ModelConfig
from k3serve.layers.moe import RoutedExperts
from k3serve.models.kimi import build_model
from k3serve.models.registry import packaged_config
from k3serve.plan.model_math import ParamSummary


def _module_params(cfg: ModelConfig) -> int:
    with torch.device("meta"):
        model = build_model(cfg)
    n = sum(p.numel() for p in model.parameters())
    for m in model.modules():
        if isinstance(m, RoutedExperts) and m.mxfp4:
            n += m.w13_packed.numel() * 2 + m.w2_packed.numel() * 2  # two E2M1 codes per byte
    return n


@pytest.mark.parametrize("name", ["k3-tiny", "k3-tiny-grouped", "kimi-linear-tiny", "kimi-linear-48b", "kimi-k3"])
def test_module_tree_matches_formulas(name):
    cfg = ModelConfig.from_file(packaged_config(name))
    assert _module_params(cfg) == ParamSummary.of(cfg).total


def test_published_k3_totals():
    s = ParamSummary.of(ModelConfig.from_file(packaged_config("kimi-k3")))
    assert abs(s.total / 1e12 - 2.78) < 0.005
    assert abs(s.active / 1e9 - 104.2) < 0.5
