"""MLA attention on the paged latent cache: expanded prefill and absorbed batched decode.

Cache ``[num_blocks, block_size, C + R]`` per layer; ``block_table`` rows map a sequence's positions to
blocks. Prefill expands the gathered latents to per-head K/V and runs causal attention per sequence (cheap
when queries are many). Decode absorbs W_UK into the query and W_UV into the output, so scores are taken
directly against the 576-wide cache rows (MQA with head dim C + R for scores and C for values):
  q̃_h = W_UK_hᵀ q_nope_h ``[C]``;  s_t = [q̃_h | q_rot_h]·latent_t;  o_h = W_UV_h Σ_t p_t c_t
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

# Gathered latents per decode chunk (elements; 4 MiB of fp32). Small chunks keep the latents in L2 for both
# bmm, but each chunk costs ~15 ops: on one CPU core at batch 38-56, 4 MiB chunks measured ~8% faster per
# layer than 1 MiB (and 8 MiB no better).
DECODE_CHUNK_ELEMENTS = 1 << 20
# Attention scores per prefill query tile (elements; 1 MiB of fp32): bounds the memory of long prompts, and
# keeps the tile's scores in L2 for masking, softmax and the second bmm. On one CPU core (H = 4, 48-wide
# heads) 1 MiB tiles ran a 512-token prompt ~1.7x faster than 4 MiB ones, 1024 tokens ~1.7x; more, smaller
# tiles also skip more of the causal triangle.
PREFILL_SCORE_ELEMENTS = 1 << 18


def write_latents(cache: torch.Tensor, slot_mapping: torch.Tensor, latents: torch.Tensor) -> None:
    """Store new tokens' latents ``[N, C + R]`` at flat cache slots ``[N]``."""
    cache.view(-1, cache.shape[-1])[slot_mapping] = latents.to(cache.dtype)


def gather_latents(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` latents of one sequence: ``[length, C + R]``."""
    bs = cache.shape[1]
    blocks = block_table[: (length + bs - 1) // bs]
    # index_select is several times faster than advanced indexing for this row gather on CPU
    return cache.index_select(0, blocks).reshape(-1, cache.shape[-1])[:length]


def mla_prefill(q: torch.Tensor, latents: torch.Tensor, kv_b: torch.Tensor, *, nope_dim: int, v_dim: int,
                scale: float) -> torch.Tensor:
    """One sequence: q ``[T, H, Dn + R]`` at the last T of L positions, latents ``[L, C + R]`` -> ``[T, H, Dv]``.

    fp32 scores and softmax, as plain bmm / softmax / bmm over query tiles of at most PREFILL_SCORE_ELEMENTS
    scores (faster than CPU SDPA at these head sizes); each tile takes only the keys its last query can see."""
    T, H, _ = q.shape
    L = latents.shape[0]
    C = kv_b.shape[1]
    f32 = torch.float32
    kv = F.linear(latents[:, :C].to(q.dtype), kv_b).view(L, H, nope_dim + v_dim)
    k = torch.empty(H, L, q.shape[-1], dtype=f32, device=q.device)  # heads first, for bmm
    k[..., :nope_dim] = kv[..., :nope_dim].transpose(0, 1)
    k[..., nope_dim:] = latents[:, C:]
    v = kv[..., nope_dim:].transpose(0, 1).to(f32)
    qh = (q.float() * scale).transpose(0, 1)
    o = torch.empty(H, T, v_dim, dtype=f32, device=q.device)
    rows = max(1, PREFILL_SCORE_ELEMENTS // (H * L))
    for a in range(0, T, rows):
        b = min(T, a + rows)
        first, end = L - T + a, L - T + b  # positions of the tile's first query and one past its last
        scores = torch.bmm(qh[:, a:b], k[:, :end].mT)  # [H, b - a, end]
        # query r of the tile (position first + r) sees keys up to first + r: only the last b - a columns mask
        hidden = torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).triu_(1)
        scores[..., first:].masked_fill_(hidden, float("-inf"))
        o[:, a:b] = torch.bmm(torch.softmax(scores, dim=-1), v[:, :end])
    return o.transpose(0, 1).to(q.dtype)


def decode_workspace_numel(max_context_len: int, block_size: int, width: int) -> int:
    """Elements of the ``workspace`` that ``mla_decode_absorbed`` uses for contexts up to ``max_context_len``."""
    return max(DECODE_CHUNK_ELEMENTS, -(-max_context_len // block_size) * block_size * width)


class DecodeChunk(NamedTuple):
    rows: torch.Tensor | None  # [n] batch rows of the chunk; None: the whole batch, in natural order
    blocks: torch.Tensor  # [n · nblk] cache blocks to gather (unused table entries clamped to block 0)
    n: int
    nblk: int
    pad: torch.Tensor  # [n, nblk · block_size] bool, True past the row's context


def plan_decode(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                width: int) -> list[DecodeChunk]:
    """The decode chunks of a batch: sequences in order of length, grouped so that each chunk's gathered
    latents (padded to its longest context) stay under DECODE_CHUNK_ELEMENTS. Depends only on the tables and
    lengths, so the layers of one step can share it (``mla_decode_absorbed(plan=...)``)."""
    B = block_tables.shape[0]
    lens = context_lens.tolist()
    blocks = [-(-n // block_size) for n in lens]
    order = sorted(range(B), key=blocks.__getitem__)
    positions = torch.arange(max(blocks) * block_size, device=block_tables.device)
    lens_t = context_lens.to(block_tables.device)
    chunks = []
    i = 0
    while i < B:
        j = i + 1
        while j < B and (j + 1 - i) * blocks[order[j]] * block_size * width <= DECODE_CHUNK_ELEMENTS:
            j += 1
        n, nblk = j - i, blocks[order[j - 1]]
        whole = n == B  # one chunk: natural order, no row gathers
        rows = None if whole else torch.tensor(order[i:j], device=block_tables.device)
        table = block_tables if whole else block_tables.index_select(0, rows)
        pad = positions[: nblk * block_size] >= (lens_t if whole else lens_t.index_select(0, rows))[:, None]
        chunks.append(DecodeChunk(rows, table[:, :nblk].clamp(min=0).reshape(-1), n, nblk, pad))
        i = j
    return chunks


def mla_decode_absorbed(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                        context_lens: torch.Tensor, kv_b: torch.Tensor, *, nope_dim: int, v_dim: int,
                        scale: float, workspace: torch.Tensor | None = None,
                        plan: list[DecodeChunk] | None = None) -> torch.Tensor:
    """One new token per sequence: q ``[B, H, Dn + R]`` -> ``[B, H, Dv]`` (fp32 scores and softmax).

    ``workspace``: optional flat buffer in the cache's dtype for the gathered latents, used when it has at
    least ``decode_workspace_numel(max(context_lens), block_size, C + R)`` elements. ``plan``: this batch's
    ``plan_decode`` (for these tables, lengths and cache shape), computed here when not given."""
    B, H, _ = q.shape
    C = kv_b.shape[1]
    bs, width = cache.shape[1], cache.shape[2]
    w = kv_b.float().view(H, nope_dim + v_dim, C)
    qf = q.float()
    # Absorb W_UK into q and fold in the softmax scale: q_cat = [W_UK^T q_nope | q_rot] · scale, [B, H, C + R].
    q_cat = torch.empty(B, H, width, dtype=torch.float32, device=q.device)
    torch.bmm(qf[..., :nope_dim].transpose(0, 1), w[:, :nope_dim], out=q_cat[..., :C].transpose(0, 1))
    q_cat[..., C:] = qf[..., nope_dim:]
    q_cat.mul_(scale)
    if plan is None:
        plan = plan_decode(block_tables, context_lens, bs, width)
    need = max(c.n * c.nblk for c in plan) * bs * width
    if workspace is None or workspace.numel() < need or workspace.dtype != cache.dtype:
        workspace = torch.empty(need, dtype=cache.dtype, device=cache.device)
    # Sequences go in chunks of similar length (sorted), each gathered into the same small buffer: the gathered
    # latents then stay in cache for both bmm (scores against the full C + R rows, values against the first C),
    # so the latents cross memory once, and each chunk is padded only to its own longest context.
    o_lat = torch.empty(B, H, C, dtype=torch.float32, device=q.device)
    for c in plan:
        n, nblk = c.n, c.nblk
        lat = torch.index_select(cache, 0, c.blocks, out=workspace[: n * nblk * bs * width].view(n * nblk, bs, width))
        lat = lat.view(n, nblk * bs, width).float()
        scores = torch.bmm(q_cat if c.rows is None else q_cat.index_select(0, c.rows), lat.transpose(1, 2))
        scores.masked_fill_(c.pad[:, None, :], float("-inf"))  # [n, H, L]
        out = torch.bmm(torch.softmax(scores, dim=-1), lat[..., :C])  # [n, H, C]
        if c.rows is None:
            o_lat = out
        else:
            o_lat.index_copy_(0, c.rows, out)
    return torch.bmm(o_lat.transpose(0, 1), w[:, nope_dim:].transpose(1, 2)).transpose(0, 1).to(q.dtype)
