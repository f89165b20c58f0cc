"""MXFP4 for the routed experts: straight-through fake quantisation while training, packing at export.

``enable_qat(model)`` parametrises every float ``RoutedExperts.w13`` / ``w2`` ``[E, rows, cols]`` so the
forward sees ``dequant(quant(w))`` (blocks of 32 along the input dim, E8M0 scale "floor", as the writer
packs) while the gradient flows to the float master unchanged. ``pack_experts(float_model, packed_model)``
quantises the masters into a model built with ``experts_mxfp4=True``: the same values the QAT forward used.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

from k3serve.layers.moe import RoutedExperts
from k3serve.ops.mx import mxfp4_fake_quant, mxfp4_quantize


def fake_quant_mxfp4(w: torch.Tensor) -> torch.Tensor:
    """MXFP4 round trip of ``w [..., K]`` with a straight-through gradient."""
    q = mxfp4_fake_quant(w.detach())
    return w + (q - w).detach()


class FakeQuantMXFP4(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return fake_quant_mxfp4(w)


def expert_modules(model: nn.Module) -> list[RoutedExperts]:
    return [m for m in model.modules() if isinstance(m, RoutedExperts)]


def enable_qat(model: nn.Module) -> None:
    for m in expert_modules(model):
        if m.mxfp4:
            raise ValueError("QAT needs float master experts (build the model with experts_mxfp4=False)")
        for name in ("w13", "w2"):
            if not parametrize.is_parametrized(m, name):
                parametrize.register_parametrization(m, name, FakeQuantMXFP4())


def master(m: RoutedExperts, name: str) -> torch.Tensor:
    """The float master weight, whether or not QAT is on."""
    if parametrize.is_parametrized(m, name):
        return getattr(m.parametrizations, name).original
    return getattr(m, name)


@torch.no_grad()
def pack_experts(float_model: nn.Module, packed_model: nn.Module) -> None:
    src, dst = expert_modules(float_model), expert_modules(packed_model)
    if len(src) != len(dst) or not all(d.mxfp4 for d in dst):
        raise ValueError("packed_model must have the same routed experts, built with experts_mxfp4=True")
    for s, d in zip(src, dst):
        d.w13_packed[:], d.w13_scale[:] = mxfp4_quantize(master(s, "w13").float())
        d.w2_packed[:], d.w2_scale[:] = mxfp4_quantize(master(s, "w2").float())
