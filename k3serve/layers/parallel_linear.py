"""Tensor-parallel linear layers and the checkpoint slot that loads a full tensor into a shard.

``W`` is ``[out, in]`` in the checkpoint; ``par.held(n)`` is the ``[start, end)`` of a split dimension this rank
holds, cut into ``par.local_pieces`` equal pieces (one per rank in a real TP run, N in a one-process
``pieces=N`` run; see ``core.distributed``).

  ColumnParallelLinear   W rows split:    y ``[..., out_held]`` = x ``[..., in]`` · W_heldᵀ (each piece its own
                         GEMM, concatenated); ``gather=True`` all-gathers the last dim into ``[..., out]``
  RowParallelLinear      W columns split: x ``[..., in_held]`` -> Σ_pieces x_p · W_pᵀ (in piece order), then the
                         all-reduce over ranks -> ``[..., out]``
  VocabParallelEmbedding rows of the table split: a masked lookup (0 outside the held rows), then the all-reduce
                         (one non-zero term per token, so every reduction order gives the same bits)

With one rank and one piece each is exactly ``nn.Linear`` / ``nn.Embedding`` and loads by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3serve.core.distributed import SINGLE, Parallel, all_reduce, gather_last_dim, reduce_pieces
from k3serve.layers.weights import CheckpointError, WeightSlot


def shard_slot(key: str, target: torch.Tensor, full_shape: tuple[int, ...], dim: int, start: int, *,
               length: int | None = None, offset: int = 0, accept=None) -> WeightSlot:  # noqa: ANN001
    """A slot for a checkpoint tensor of ``full_shape`` of which ``target`` holds ``length`` entries of ``dim``
    from ``start`` (all of ``target.shape[dim]`` by default), copied to ``target`` at ``offset`` along ``dim``;
    a padded target (longer than ``length``) is zero elsewhere. ``accept`` maps an alternative stored layout
    to ``full_shape`` first. Written checkpoints come from one process, so a shard has no ``dump``."""
    full_shape = tuple(full_shape)
    n = target.shape[dim] if length is None else length

    def load(t: torch.Tensor) -> None:
        src = accept(t) if accept else t
        if tuple(src.shape) != full_shape:
            raise CheckpointError(f"tensor '{key}' has shape {list(t.shape)}, expected {list(full_shape)}")
        if src.dtype.is_floating_point != target.dtype.is_floating_point:
            raise CheckpointError(f"tensor '{key}' has dtype {t.dtype}, expected {target.dtype}")
        part = src.narrow(dim, start, n)
        with torch.no_grad():
            if n == target.shape[dim]:
                target.copy_(part)
            else:
                target.zero_()
                target.narrow(dim, offset, n).copy_(part)

    def dump() -> torch.Tensor:
        raise CheckpointError(f"'{key}' is a tensor-parallel shard; write checkpoints from a one-process model")

    return WeightSlot(key, full_shape, target.dtype, load, dump)


def merge_slots(slots: list[WeightSlot]) -> list[WeightSlot]:
    """Slots of several pieces that read the same checkpoint key, as one slot loading into each."""
    by_key: dict[str, list[WeightSlot]] = {}
    for s in slots:
        by_key.setdefault(s.key, []).append(s)

    def fan_out(group: list[WeightSlot]):  # noqa: ANN202
        def load(t: torch.Tensor) -> None:
            for s in group:
                s.load(t)
        return load

    return [g[0] if len(g) == 1 else WeightSlot(k, g[0].shape, g[0].dtype, fan_out(g), g[0].dump)
            for k, g in by_key.items()]


class ColumnParallelLinear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, par: Parallel = SINGLE, *, gather: bool = False):
        start, end = par.held(out_features)
        super().__init__(in_features, end - start, bias=False)
        self.par, self.full_out, self.start, self.gather = par, out_features, start, gather
        self.pieces = par.pieces_of(out_features)
        self.tied_to: str | None = None  # the module whose slot loads this weight (a tied LM head)

    @property
    def slots_cover_all(self) -> bool:
        return self.tied_to is not None

    def piece_weight(self, p: int) -> torch.Tensor:
        """Rows of piece ``p`` (a view)."""
        return self.weight if len(self.pieces) == 1 else self.weight[self.pieces[p]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.pieces) == 1:
            y = F.linear(x, self.weight)
        else:
            y = torch.cat([F.linear(x, self.piece_weight(p)) for p in range(len(self.pieces))], dim=-1)
        return gather_last_dim(y, self.par) if self.gather else y

    def checkpoint_slots(self, prefix: str) -> list[WeightSlot]:
        if self.tied_to is not None or self.weight.shape[0] == self.full_out:
            return []  # tied: nothing of its own; whole: loads by name
        return [shard_slot(prefix + "weight", self.weight, (self.full_out, self.in_features), 0, self.start)]


class RowParallelLinear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, par: Parallel = SINGLE):
        start, end = par.held(in_features)
        super().__init__(end - start, out_features, bias=False)
        self.par, self.full_in, self.start = par, in_features, start
        self.pieces = par.pieces_of(in_features)

    def piece_weight(self, p: int) -> torch.Tensor:
        """Columns of piece ``p``, contiguous as a rank holds them (a copy when there are several pieces)."""
        return self.weight if len(self.pieces) == 1 else self.weight[:, self.pieces[p]].contiguous()

    def piece_partial(self, x_p: torch.Tensor, p: int) -> torch.Tensor:
        """Piece ``p``'s term of the output for its input columns ``x_p`` ``[..., in/partitions]``."""
        return F.linear(x_p, self.piece_weight(p))

    def reduce(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return reduce_pieces(parts, self.par)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.pieces) == 1 and self.par.tp == 1:
            return F.linear(x, self.weight)
        return self.reduce([self.piece_partial(x[..., s].contiguous(), p) for p, s in enumerate(self.pieces)])

    def checkpoint_slots(self, prefix: str) -> list[WeightSlot]:
        if self.weight.shape[1] == self.full_in:
            return []
        return [shard_slot(prefix + "weight", self.weight, (self.out_features, self.full_in), 1, self.start)]


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, vocab: int, dim: int, par: Parallel = SINGLE):
        start, end = par.held(vocab) if par.tp > 1 else (0, vocab)  # pieces in one process: the whole table
        super().__init__(end - start, dim)
        self.par, self.vocab, self.start = par, vocab, start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.par.tp == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[..., None], 0.0)
        return all_reduce(out, self.par)

    def checkpoint_slots(self, prefix: str) -> list[WeightSlot]:
        if self.num_embeddings == self.vocab:
            return []
        return [shard_slot(prefix + "weight", self.weight, (self.vocab, self.embedding_dim), 0, self.start)]
