"""A request's cache rows between rank 0 (the engine core, which hands off) and the other ranks of its
tensor-parallel group, over the group's step channel (``engine/tp_group.py``), between two steps.

Each rank holds its heads' KDA state and conv window per slot; the MLA latents are the same on every rank. So:

    ROWS_OUT  header [ROWS_OUT, slot]      every rank packs its KDA rows of ``slot`` (one uint8 buffer, every
                                           layer's state then conv window) -> gathered on rank 0, rank order
    ROWS_IN   header [ROWS_IN, slot, T]    rank 0 broadcasts T flat MLA cache rows ``[T]`` int64, scatters each
                                           rank's packed KDA rows, broadcasts the latents of those T positions
                                           ``[T, D]`` of every MLA layer (packed); each rank writes them

Slots, not rows, cross: each rank resolves a slot to its own cache row (``StateRows``; they move in step on
every rank). Rank 0 calls ``gather_rows`` / ``scatter_rows``; a worker's loop (``engine/worker.py``) calls
``follow_rows`` on the two headers. Shapes are each rank's own (``reshard`` turns them into the full layout).
"""

from __future__ import annotations

import torch

from k3serve.engine.step_inputs import ROWS_IN, ROWS_OUT, header


def _kda_caches(engine) -> list[tuple[str, torch.Tensor]]:
    c = engine.runner.caches
    return [(f"kda_state.{i}", t) for i, t in c.kda_state.items()] + \
           [(f"kda_conv.{i}", t) for i, t in c.kda_conv.items()]


def _pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One flat uint8 CPU buffer of ``tensors``' bytes, in order."""
    flat = [t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    return torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8)


def _unpack(buf: torch.Tensor, like: list[tuple[str, tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
    out, at = {}, 0
    for name, shape, dtype in like:
        n = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        out[name] = buf[at:at + n].clone().view(dtype).reshape(shape)
        at += n
    if at != buf.numel():
        raise ValueError(f"rank rows: {buf.numel()} bytes arrived, {at} expected")
    return out


def _kda_like(engine) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [(name, tuple(t.shape[1:]), t.dtype) for name, t in _kda_caches(engine)]


def local_rows(engine, slot: int) -> dict[str, torch.Tensor]:
    """This rank's KDA rows of ``slot`` (views into the cache)."""
    row = engine.runner.state_rows.rows([slot])[0]
    return {name: t[row] for name, t in _kda_caches(engine)}


def write_rows(engine, slot: int, tensors: dict[str, torch.Tensor]) -> None:
    row = engine.runner.state_rows.rows([slot])[0]
    for name, t in _kda_caches(engine):
        t[row].copy_(tensors[name])


def write_latents(engine, flat_rows: torch.Tensor, latents: dict[int, torch.Tensor]) -> None:
    """MLA latents ``[T, D]`` per layer into the cache rows ``flat_rows`` ``[T]`` (cache viewed as rows)."""
    device = engine.runner.device
    rows = flat_rows.to(device)
    for i, cache in engine.runner.caches.mla.items():
        cache.view(-1, cache.shape[-1]).index_copy_(0, rows, latents[i].to(device=device, dtype=cache.dtype))


# rank 0 ---------------------------------------------------------------------------------------------------

def gather_rows(engine, group, slot: int) -> list[dict[str, torch.Tensor]]:
    """Every rank's KDA rows of ``slot``, in rank order (rank 0's own first)."""
    h = header(ROWS_OUT)
    h[1] = slot
    group.broadcast(h)
    mine = local_rows(engine, slot)
    parts = group.gather(_pack(list(mine.values())))
    like = _kda_like(engine)  # every rank holds the same number of heads: the same shapes
    return [{k: v.clone() for k, v in mine.items()}] + [_unpack(p, like) for p in parts[1:]]


def scatter_rows(engine, group, slot: int, per_rank: list[dict[str, torch.Tensor]], flat_rows: torch.Tensor,
                 latents: dict[int, torch.Tensor]) -> None:
    """Send rank r (r > 0) its KDA rows ``per_rank[r]`` for ``slot`` and the MLA ``latents`` of ``flat_rows``;
    rank 0 writes its own part itself."""
    names = [name for name, _ in _kda_caches(engine)]
    h = header(ROWS_IN)
    h[1], h[2] = slot, flat_rows.numel()
    group.broadcast(h)
    parts = [_pack([r[n] for n in names]) for r in per_rank]
    group.scatter(torch.empty_like(parts[0]), parts)
    if flat_rows.numel():  # none when the decode side's prefix hit covers the whole prompt
        group.broadcast(flat_rows.to("cpu", torch.long).contiguous())
        group.broadcast(_pack([latents[i] for i in engine.runner.caches.mla]))


# workers --------------------------------------------------------------------------------------------------

def follow_rows(engine, group, kind: int, h: torch.Tensor) -> None:
    """A worker's side of ``gather_rows`` (ROWS_OUT) or ``scatter_rows`` (ROWS_IN), after its header."""
    slot = int(h[1])
    if kind == ROWS_OUT:
        group.gather(_pack(list(local_rows(engine, slot).values())))
        return
    if kind != ROWS_IN:
        raise ValueError(f"rank rows: unknown kind {kind}")
    num = int(h[2])
    like = _kda_like(engine)
    size = sum(torch.Size(s).numel() * torch.empty(0, dtype=d).element_size() for _, s, d in like)
    write_rows(engine, slot, _unpack(group.scatter(torch.empty(size, dtype=torch.uint8)), like))
    if not num:
        return
    flat_rows = group.broadcast(torch.empty(num, dtype=torch.long))
    mla = engine.runner.caches.mla
    mla_like = [(str(i), (num, c.shape[-1]), c.dtype) for i, c in mla.items()]
    size = sum(num * c.shape[-1] * c.element_size() for c in mla.values())
    latents = _unpack(group.broadcast(torch.empty(size, dtype=torch.uint8)), mla_like)
    write_latents(engine, flat_rows, {int(k): v for k, v in latents.items()})
