"""MoE and MLPs under tensor parallelism: every expert split by its intermediate width.

Each rank holds ``I/partitions`` of every routed expert's intermediate rows (w1, w3 rows and the matching w2
columns), of the shared experts' and of the dense MLP's; the router, LatentMoE's down/up projections and the
latent norm are replicated. x ``[N, d]``:
  w, ids = router(x) (replicated);  u = W_down x  ``[N, ℓ]`` (LatentMoE) or x
  piece p: y_p = Σ_k w_k W2_e[:, I_p] glu(W1_e[I_p] u, W3_e[I_p] u)   ``[N, ℓ or d]``;  s_p = shared_p(x) ``[N, d]``
  one all-reduce of Σ_p [y_p | s_p] (LatentMoE: ``[N, ℓ + d]``, the latent reduced before its norm), or of
  Σ_p (y_p + s_p) ``[N, d]``;  LatentMoE then out = W_up RMSNorm(y) + s
MXFP4 experts keep whole 32-element scale blocks: a shard whose rows do not start and end on a block edge
holds the blocks it touches with the other ranks' elements zeroed (zero rows of w1/w3, zero codes of w2), so
its padded positions add exact zeros (``ExpertShard``). Expert parallelism (whole experts per rank) is another
layout (``ep > 1``), not built here.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from k3serve.core.config import TextConfig
from k3serve.core.distributed import Parallel, reduce_pieces
from k3serve.layers.activation import make_glu
from k3serve.layers.moe import MoEGate, RoutedExperts, add_latent_projections
from k3serve.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear, merge_slots, shard_slot
from k3serve.layers.weights import WeightSlot

MX_BLOCK = 32


class ParallelGatedMLP(nn.Module):
    """``W_down(glu(W_gate x, W_up x))`` with gate/up column-parallel and down row-parallel."""

    def __init__(self, d: int, inter: int, cfg: TextConfig, par: Parallel):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(d, inter, par)
        self.up_proj = ColumnParallelLinear(d, inter, par)
        self.down_proj = RowParallelLinear(inter, d, par)
        self.glu = make_glu(cfg.hidden_act, cfg.situ_beta, cfg.situ_linear_beta)
        self.num_pieces = par.local_pieces

    def piece_partial(self, x: torch.Tensor, p: int) -> torch.Tensor:
        h = self.glu(F.linear(x, self.gate_proj.piece_weight(p)), F.linear(x, self.up_proj.piece_weight(p)))
        return self.down_proj.piece_partial(h, p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.reduce([self.piece_partial(x, p) for p in range(self.num_pieces)])


class ExpertShard(RoutedExperts):
    """Intermediate rows ``[start, start + n)`` of every expert (all of w1/w3's rows there, w2's columns), at
    ``offset`` inside a local width padded to whole MXFP4 blocks (no padding for dense experts)."""

    def __init__(self, cfg: TextConfig, mxfp4: bool, start: int, n: int):
        first = start // MX_BLOCK * MX_BLOCK if mxfp4 else start
        width = -(-(start + n - first) // MX_BLOCK) * MX_BLOCK if mxfp4 else n
        super().__init__(dataclasses.replace(cfg, moe_intermediate_size=width), mxfp4)
        self.full_inter, self.start, self.n, self.offset, self.first = cfg.moe_intermediate_size, start, n, start - first, first

    def checkpoint_slots(self, prefix: str) -> list[WeightSlot]:
        I, W, D, a, n, off = self.full_inter, self.inter, self.width, self.start, self.n, self.offset
        rows = dict(length=n, offset=off)
        slots = []
        for e in range(self.num_experts):
            p = f"{prefix}{e}."
            if not self.mxfp4:
                slots += [shard_slot(p + "w1.weight", self.w13[e, :W], (I, D), 0, a, **rows),
                          shard_slot(p + "w3.weight", self.w13[e, W:], (I, D), 0, a, **rows),
                          shard_slot(p + "w2.weight", self.w2[e], (D, I), 1, a, **rows)]
                continue
            for name, half in (("w1", slice(0, W)), ("w3", slice(W, 2 * W))):
                slots += [shard_slot(p + name + ".weight_packed", self.w13_packed[e, half], (I, D // 2), 0, a, **rows),
                          shard_slot(p + name + ".weight_scale", self.w13_scale[e, half], (I, D // 32), 0, a, **rows)]
            slots += [self._w2_codes_slot(p + "w2.weight_packed", e),
                      shard_slot(p + "w2.weight_scale", self.w2_scale[e], (D, I // 32), 1, self.first // MX_BLOCK)]
        return slots

    def _w2_codes_slot(self, key: str, e: int) -> WeightSlot:
        """w2's codes ``[D, W/2]``: the whole blocks this shard touches, other ranks' elements set to code 0 (+0)."""
        target = self.w2_packed[e]
        slot = shard_slot(key, target, (self.width, self.full_inter // 2), 1, self.first // 2)
        if self.n == self.inter:
            return slot
        keep = torch.zeros(self.inter, dtype=torch.bool)
        keep[self.offset:self.offset + self.n] = True
        mask = (keep[0::2].to(torch.uint8) * 0x0F) | (keep[1::2].to(torch.uint8) * 0xF0)  # low nibble = even element

        def load(t: torch.Tensor) -> None:
            slot.load(t)
            target.bitwise_and_(mask.to(target.device))

        return dataclasses.replace(slot, load=load)


class ShardedExperts(nn.ModuleList):
    """The held pieces of the routed experts, one ``ExpertShard`` each; checkpoint keys as ``RoutedExperts``."""

    slots_cover_all = True

    def __init__(self, cfg: TextConfig, mxfp4: bool, par: Parallel):
        I = cfg.moe_intermediate_size
        start = par.held(I)[0]
        super().__init__(ExpertShard(cfg, mxfp4, start + s.start, s.stop - s.start) for s in par.pieces_of(I))

    def checkpoint_slots(self, prefix: str) -> list[WeightSlot]:
        return merge_slots([s for shard in self for s in shard.checkpoint_slots(prefix)])


class TensorParallelMoE(nn.Module):
    """``SparseMoE`` with its experts split by intermediate width; the same checkpoint keys."""

    def __init__(self, cfg: TextConfig, mxfp4: bool, par: Parallel):
        super().__init__()
        if par.ep > 1:
            raise ValueError("with ep > 1 the experts run whole per rank: layers.moe_ep.EPSparseMoE")
        d = cfg.hidden_size
        self.par = par
        self.gate = MoEGate(d, cfg)
        self.experts = ShardedExperts(cfg, mxfp4, par)
        add_latent_projections(self, cfg)
        self.shared_experts = (ParallelGatedMLP(d, cfg.moe_intermediate_size * cfg.num_shared_experts, cfg, par)
                               if cfg.num_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        u = self.routed_expert_down_proj(x) if self.latent else x
        parts = []
        for p, shard in enumerate(self.experts):
            y = shard(u, weights, ids).to(x.dtype)
            if self.shared_experts is not None:
                s = self.shared_experts.piece_partial(x, p)
                y = torch.cat([y, s], dim=-1) if self.latent else y + s
            parts.append(y)
        total = reduce_pieces(parts, self.par)  # the one all-reduce of the layer
        if not self.latent:
            return total
        y, s = total.split([u.shape[-1], total.shape[-1] - u.shape[-1]], dim=-1)
        if self.routed_expert_norm is not None:
            y = self.routed_expert_norm(y)
        y = self.routed_expert_up_proj(y)
        return y + s if self.shared_experts is not None else y
