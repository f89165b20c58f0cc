"""A request's cache rows between the full (tp 1) layout and the shards of tp-N ranks, in full head order.

A hand-off always carries the full layout, whatever the tp of either side: the prefill side gathers its ranks'
shards (``gather``), the decode side scatters them to its own ranks (``scatter``); so tp 2 -> tp 1, tp 1 -> tp 2
and tp 2 -> tp 4 are one code path, and the checksums cover exactly what a tp-1 server would send.

Per slot, for H heads of dim K (P = H*K channels per projection), conv kernel W, N ranks, rank r holding heads
``[r*H/N, (r+1)*H/N)`` (``Parallel.held``):

    kda_state.<l>  full [H, K, V]                 rank r: its heads                      [H/N, K, V]
    kda_conv.<l>   full [3P, W-1] = q | k | v     rank r: the channels of its heads in q, in k and in v,
                   (each [P, W-1], by head)       each [r*P/N, (r+1)*P/N), concatenated  [3P/N, W-1]
    mla.<l>        [T, D_latent]                  replicated: every rank holds the whole latent
    generator      sampler state                  rank 0 only (rank 0 samples)

The conv window is NOT a flat slice of the 3P channels (rank 0 would get all of q and half of k): that bug
shipped in SGLang's heterogeneous-TP path (sglang#22060). ``shard_naive`` / ``gather_naive`` are the reference:
every channel's (segment, head, dim) looked up one by one.
"""

from __future__ import annotations

import torch

STATE, CONV, MLA = "kda_state.", "kda_conv.", "mla."


def _kind(name: str) -> str:
    for prefix in (STATE, CONV, MLA):
        if name.startswith(prefix):
            return prefix
    return ""


def _check_split(name: str, n: int, tp: int) -> None:
    if n % tp:
        raise ValueError(f"{name}: {n} rows cannot be split over {tp} ranks")


def shard(name: str, full: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """Rank r's part of the full item ``name`` for each r in ``range(tp)`` (views where possible)."""
    kind = _kind(name)
    if kind == STATE:
        _check_split(name, full.shape[0], tp)
        return list(full.chunk(tp, dim=0))
    if kind == CONV:
        _check_split(name, full.shape[0], 3 * tp)
        segments = [seg.chunk(tp, dim=0) for seg in full.chunk(3, dim=0)]  # q, k, v, each by rank
        return [torch.cat([seg[r] for seg in segments]) for r in range(tp)]
    if kind == MLA:
        return [full] * tp
    return [full] + [None] * (tp - 1)


def gather(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full item from every rank's part (inverse of ``shard``). A replicated item must be equal on every
    rank: a rank whose copy differs has diverged, and a hand-off of it would decode from an unknown state."""
    kind, tp = _kind(name), len(shards)
    if kind == STATE:
        return torch.cat(shards, dim=0)
    if kind == CONV:
        for s in shards:
            _check_split(name, s.shape[0], 3)
        parts = [s.chunk(3, dim=0) for s in shards]  # per rank: its q, k, v channels
        return torch.cat([parts[r][j] for j in range(3) for r in range(tp)])
    if kind == MLA:
        if any(not torch.equal(s, shards[0]) for s in shards[1:]):
            raise ValueError(f"{name}: the replicated latents differ between tensor-parallel ranks")
    return shards[0]


def scatter(tensors: dict[str, torch.Tensor], tp: int) -> list[dict[str, torch.Tensor]]:
    """Per rank, its items of a full-layout ``tensors`` (rank 0 also gets the unsharded ones)."""
    per_rank: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for name, full in tensors.items():
        for r, part in enumerate(shard(name, full, tp)):
            if part is not None:
                per_rank[r][name] = part
    return per_rank


def gather_all(per_rank: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The full-layout items from every rank's (rank 0 holds every name; the others the sharded ones)."""
    out = {}
    for name in per_rank[0]:
        if _kind(name) in (STATE, CONV):
            out[name] = gather(name, [r[name] for r in per_rank])
        elif _kind(name) == MLA:
            out[name] = gather(name, [r.get(name, per_rank[0][name]) for r in per_rank])
        else:
            out[name] = per_rank[0][name]
    return out


def reshard(per_rank: list[dict[str, torch.Tensor]], to_tp: int) -> list[dict[str, torch.Tensor]]:
    """Shards of one tp size to another, through the full layout."""
    return scatter(gather_all(per_rank), to_tp)


def full_shape(name: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """The full-layout shape of an item of which one rank of ``tp`` holds ``shape`` (per slot or per token)."""
    if _kind(name) in (STATE, CONV):
        return (shape[0] * tp, *shape[1:])
    return tuple(shape)


# naive reference: channel by channel -----------------------------------------------------------------------

def _conv_channels(num_heads: int, head_dim: int, tp: int, rank: int) -> list[int]:
    """Full-layout conv channels rank ``rank`` holds, in its order: q, k, v of its heads, head by head."""
    P, per = num_heads * head_dim, num_heads // tp
    heads = range(rank * per, (rank + 1) * per)
    return [seg * P + h * head_dim + d for seg in range(3) for h in heads for d in range(head_dim)]


def shard_naive(name: str, full: torch.Tensor, tp: int, num_heads: int) -> list[torch.Tensor]:
    kind, per = _kind(name), num_heads // tp
    if kind == STATE:
        return [torch.stack([full[h] for h in range(r * per, (r + 1) * per)]) for r in range(tp)]
    if kind == CONV:
        head_dim = full.shape[0] // (3 * num_heads)
        return [torch.stack([full[c] for c in _conv_channels(num_heads, head_dim, tp, r)]) for r in range(tp)]
    return [full.clone() for _ in range(tp)]


def gather_naive(name: str, shards: list[torch.Tensor], num_heads: int) -> torch.Tensor:
    tp, kind = len(shards), _kind(name)
    if kind not in (STATE, CONV):
        return shards[0].clone()
    rows = shards[0].shape[0] * tp
    full = torch.empty((rows, *shards[0].shape[1:]), dtype=shards[0].dtype)
    per = num_heads // tp
    for r, s in enumerate(shards):
        if kind == STATE:
            for i, h in enumerate(range(r * per, (r + 1) * per)):
                full[h] = s[i]
        else:
            head_dim = rows // (3 * num_heads)
            for i, c in enumerate(_conv_channels(num_heads, head_dim, tp, r)):
                full[c] = s[i]
    return full
