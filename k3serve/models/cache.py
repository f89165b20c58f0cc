"""Cache geometry of a model and allocation of its cache tensors (see ``core.context`` for layouts).

``cache_spec(model)`` reports, per layer, the MLA bytes per token and the KDA bytes per sequence slot, which
is what an engine needs to size its block pool and slot pool from one memory budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from k3serve.core.context import ModelCaches
from k3serve.layers.kda import KimiDeltaAttention
from k3serve.layers.mla import MLAttention


@dataclass(frozen=True)
class CacheSpec:
    mla_layers: dict[int, tuple[tuple[int, ...], torch.dtype]]  # layer -> (per-token shape, dtype)
    kda_state_layers: dict[int, tuple[tuple[int, ...], torch.dtype]]  # layer -> (per-slot shape, dtype)
    kda_conv_layers: dict[int, tuple[tuple[int, ...], torch.dtype]]

    @staticmethod
    def _bytes(shapes: dict[int, tuple[tuple[int, ...], torch.dtype]]) -> int:
        return sum(torch.Size(s).numel() * torch.empty(0, dtype=dt).element_size() for s, dt in shapes.values())

    @property
    def mla_bytes_per_token(self) -> int:
        return self._bytes(self.mla_layers)

    @property
    def kda_bytes_per_slot(self) -> int:
        return self._bytes(self.kda_state_layers) + self._bytes(self.kda_conv_layers)


def cache_spec(model: nn.Module, dtype: torch.dtype) -> CacheSpec:
    mla, state, conv = {}, {}, {}
    for m in model.modules():
        if isinstance(m, MLAttention):
            (shape, dt), = m.state_shapes().values()
            mla[m.layer_idx] = (shape, dt or dtype)
        elif isinstance(m, KimiDeltaAttention):
            shapes = m.state_shapes()
            state[m.layer_idx] = (shapes["kda_state"][0], shapes["kda_state"][1] or dtype)
            conv[m.layer_idx] = (shapes["kda_conv"][0], shapes["kda_conv"][1] or dtype)
    return CacheSpec(mla, state, conv)


def allocate_caches(spec: CacheSpec, *, num_blocks: int, block_size: int, num_slots: int,
                    device: torch.device | str = "cpu") -> ModelCaches:
    if num_blocks < 1 or block_size < 1 or num_slots < 1:
        raise ValueError("num_blocks, block_size and num_slots must all be >= 1")
    return ModelCaches(
        mla={i: torch.zeros(num_blocks, block_size, *s, dtype=dt, device=device) for i, (s, dt) in spec.mla_layers.items()},
        kda_state={i: torch.zeros(num_slots, *s, dtype=dt, device=device)
                   for i, (s, dt) in spec.kda_state_layers.items()},
        kda_conv={i: torch.zeros(num_slots, *s, dtype=dt, device=device)
                  for i, (s, dt) in spec.kda_conv_layers.items()},
        block_size=block_size,
    )
