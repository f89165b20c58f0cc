"""Parallel layout and the collectives the layers use: one home for "which rank holds what".

``ParallelLayout(tp, ep, dp)`` is data, validated up front against a model's shapes (``check``), so a
layout that cannot work is one clear error before any weight is read. ``Parallel`` is this process's place
in it: its ranks and the torch.distributed groups (gloo on CPU, NCCL on GPUs). Layers receive a
``Parallel`` (``SINGLE`` when the model runs in one process) and call the collectives below; with one rank
every collective is the identity, so the single-process path runs the same layer code.

World rank layout (dp outermost): ``rank = dp_rank * tp + tp_rank``. Expert parallelism runs either across the
``tp`` ranks of one dp group (``ep == tp``, the tp group is the ep group), or across the whole world
(``ep == tp * dp``: attention data parallel with the experts over every GPU, as vLLM's ``-dp D -tp T
--enable-expert-parallel`` and SGLang's ``--enable-dp-attention``). Then each dp group runs its own batch: the
attention collectives stay in its tp group, and only the MoE dispatch/combine spans the ep group (the world).

Reduction modes: ``"fast"`` is ``all_reduce`` (the backend picks the order, so TP-N differs from TP-1 in
the last bits); ``"ordered"`` all-gathers the partials and sums them in rank order, which is the order a
single process sums the same partials in, so TP-N is bit-exact to TP-1 on gloo in fp32.

Pieces: a layout splits every tensor-parallel dimension into ``partitions = max(tp, pieces)`` equal pieces, and
each rank holds ``pieces // tp`` of them (``local_pieces``). The sharded layers compute each held piece as a
rank would (its own GEMMs over its slice) and add the partials in piece order (``sum_partials``) before the
all-reduce. So one process with ``pieces=N`` runs exactly the arithmetic of ``tp=N``: with ``"ordered"``
TP-N equals TP-1(pieces=N) bit for bit. Plain TP-1 (pieces 1) sums the same terms in one GEMM: equal within
rounding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

REDUCE_MODES = ("fast", "ordered")


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1  # tensor-parallel ranks per replica (attention heads, projections, vocabulary, MoE width)
    ep: int = 1  # expert-parallel ranks (1: experts split by width over tp; tp or tp*dp: whole experts per rank)
    dp: int = 1  # attention data-parallel groups, each its own scheduler and caches
    reduce_mode: str = "fast"
    pieces: int = 1  # partials per reduction (see the module docstring); 1 or a multiple of tp

    def __post_init__(self) -> None:
        for name in ("tp", "ep", "dp", "pieces"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.ep not in (1, self.tp, self.tp * self.dp):
            raise ValueError(f"expert parallelism spans the tensor-parallel ranks or all tp x dp ranks: ep must be "
                             f"1, tp ({self.tp}) or tp*dp ({self.tp * self.dp}), got {self.ep}")
        if self.dp > 1 and self.ep not in (1, self.tp * self.dp):
            raise ValueError(f"with dp {self.dp} the experts span every rank: ep must be tp*dp "
                             f"({self.tp * self.dp}), got {self.ep}")
        if self.reduce_mode not in REDUCE_MODES:
            raise ValueError(f"reduce_mode must be one of {REDUCE_MODES}, got {self.reduce_mode!r}")
        if self.pieces > 1 and self.pieces % self.tp:
            raise ValueError(f"pieces must be 1 or a multiple of tp ({self.tp}), got {self.pieces}")

    @property
    def partitions(self) -> int:
        """How many equal pieces every tensor-parallel dimension is cut into."""
        return max(self.tp, self.pieces)

    @property
    def world_size(self) -> int:
        return self.tp * self.dp

    @property
    def lockstep(self) -> bool:
        """Whether the dp groups share MoE collectives, so every forward needs all of them (engine/dp_sync.py)."""
        return self.dp > 1 and self.ep > 1

    def check(self, **counts: int) -> None:
        """Refuse a layout the model cannot be split by: ``counts`` names what tp divides (``heads=...``,
        ``kv_heads=...``, ``vocab=...``, ``moe_intermediate=...``) and what ep divides (``experts=...``)."""
        for what, n in counts.items():
            ways = self.ep if what == "experts" else self.partitions
            if n % ways:
                flag = ("--expert-parallel" if what == "experts" else
                        "--tensor-parallel-size" if ways == self.tp else "pieces")
                raise ValueError(f"{what.replace('_', ' ')} ({n}) cannot be split over {ways} ranks "
                                 f"({flag} {ways}): {n} is not a multiple of {ways}")


@dataclass(frozen=True)
class Parallel:
    """This process's place in a layout; ``tp_group`` is None when tp == 1 (and in ``SINGLE``); ``ep_group`` is
    the tp group when ep == tp, the world's group when ep == tp * dp."""

    layout: ParallelLayout = field(default_factory=ParallelLayout)
    rank: int = 0
    tp_group: Any = None
    ep_group: Any = None

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.layout.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.layout.tp

    @property
    def ep(self) -> int:
        return self.layout.ep

    @property
    def ep_rank(self) -> int:
        if self.layout.ep == 1:
            return 0
        return self.tp_rank if self.layout.ep == self.layout.tp else self.rank

    @property
    def local_pieces(self) -> int:
        return self.layout.partitions // self.tp

    @property
    def sharded(self) -> bool:
        """Whether the layers split their weights (over ranks, or into pieces in this process)."""
        return self.layout.partitions > 1

    def held(self, n: int) -> tuple[int, int]:
        """[start, end) of the part of a tensor-parallel dimension of size ``n`` this rank holds."""
        per = n // self.layout.partitions * self.local_pieces
        return self.tp_rank * per, (self.tp_rank + 1) * per

    def pieces_of(self, n: int) -> list[slice]:
        """The held pieces of a dimension of size ``n``, as slices of the held part (one slice per piece)."""
        per = n // self.layout.partitions
        return [slice(p * per, (p + 1) * per) for p in range(self.local_pieces)]


SINGLE = Parallel()


def init_parallel(layout: ParallelLayout, *, backend: str | None = None) -> Parallel:
    """Join the process group started by the launcher (torchrun env: RANK, WORLD_SIZE, MASTER_ADDR/PORT) and
    build the tp groups. Every rank must call this, in the same order."""
    if not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if torch.cuda.is_available() else "gloo"))
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != layout.world_size:
        raise ValueError(f"the layout needs {layout.world_size} processes (tp {layout.tp} x dp {layout.dp}), "
                         f"but {world} were started")
    mine = None
    for d in range(layout.dp):  # new_group must be called by every rank for every group
        ranks = list(range(d * layout.tp, (d + 1) * layout.tp))
        group = dist.new_group(ranks) if layout.tp > 1 else None
        if rank in ranks:
            mine = group
    ep_group = None if layout.ep == 1 else mine if layout.ep == layout.tp else dist.group.WORLD
    return Parallel(layout, rank, mine, ep_group)


def all_reduce(x: torch.Tensor, par: Parallel) -> torch.Tensor:
    """Sum of ``x`` over the tp group (the identity with one rank). "ordered" sums in rank order."""
    if par.tp == 1:
        return x
    if par.layout.reduce_mode == "fast":
        dist.all_reduce(x, group=par.tp_group)
        return x
    return sum_partials(all_gather(x, par))


def all_gather(x: torch.Tensor, par: Parallel) -> list[torch.Tensor]:
    """Every tp rank's ``x`` (same shape on all), in rank order."""
    if par.tp == 1:
        return [x]
    parts = [torch.empty_like(x) for _ in range(par.tp)]
    dist.all_gather(parts, x.contiguous(), group=par.tp_group)
    return parts


def gather_last_dim(x: torch.Tensor, par: Parallel) -> torch.Tensor:
    """Concatenate the tp ranks' shards of the last dimension (a column-parallel output made whole)."""
    return x if par.tp == 1 else torch.cat(all_gather(x, par), dim=-1)


# Pieces: the partials one rank adds up itself before the all-reduce (see the module docstring).


def sum_partials(parts: list[torch.Tensor]) -> torch.Tensor:
    """Partials summed left to right, as the "ordered" all-reduce adds ranks: one piece is returned as is."""
    out = parts[0]
    if len(parts) > 1:
        out = out.clone()
        for p in parts[1:]:
            out += p
    return out


def reduce_pieces(parts: list[torch.Tensor], par: Parallel) -> torch.Tensor:
    """A row-parallel output made whole: this rank's pieces in order, then the all-reduce over ranks."""
    return all_reduce(sum_partials(parts), par)


# Expert-parallel exchange: variable-length all-to-all over the ep ranks (the tp group when ep == tp, the
# world when ep == tp * dp). torch's all_to_all_single takes uneven splits on gloo (CPU) and NCCL alike; the
# receiver must size its buffer first, hence the count exchange before every payload. A rank with no tokens
# sends and receives empty parts but joins every call: the others' calls pair up with its.


def exchange_counts(send_counts: list[int], par: Parallel) -> list[int]:
    """Rows this rank will receive from each ep rank, given the rows it sends to each (``[ep]`` ints)."""
    if par.ep == 1:
        return list(send_counts)
    send = torch.tensor(send_counts, dtype=torch.int64)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=par.ep_group)
    return recv.tolist()


def ep_all_reduce(x: torch.Tensor, par: Parallel) -> torch.Tensor:
    """Sum of ``x`` over the ep ranks (in place; the identity with one)."""
    if par.ep > 1:
        dist.all_reduce(x, group=par.ep_group)
    return x


def all_to_all(x: torch.Tensor, send_counts: list[int], recv_counts: list[int], par: Parallel) -> torch.Tensor:
    """x ``[sum(send_counts), ...]``, rows grouped by destination ep rank -> ``[sum(recv_counts), ...]``, rows
    grouped by source ep rank (in rank order; each source's rows in the order it sent them)."""
    if par.ep == 1:
        return x
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=par.ep_group)
    return out


def all_gather_rows(x: torch.Tensor, counts: list[int], par: Parallel) -> torch.Tensor:
    """Concatenate each tp rank's ``x`` ``[counts[r], ...]`` in rank order (rows may differ per rank)."""
    if par.tp == 1:
        return x
    width = max(counts)
    if width == 0:  # nobody has a row: still one (empty) result, no collective needed by anyone
        return x
    padded = x.new_zeros((width, *x.shape[1:]))
    padded[:x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in range(par.tp)]
    dist.all_gather(parts, padded, group=par.tp_group)
    return torch.cat([p[:c] for p, c in zip(parts, counts)])
