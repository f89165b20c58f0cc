"""MLA attention on the paged latent cache: expanded prefill and absorbed batched decode.

Cache ``[num_blocks, block_size, C + R]`` per layer; ``block_table`` rows map a sequence's positions to
blocks. Prefill expands the gathered latents to per-head K/V and runs one SDPA per sequence (cheap when
queries are many). Decode absorbs W_UK into the query and W_UV into the output, so scores are taken
directly against the 576-wide cache rows (MQA with head dim C + R for scores and C for values):
  q̃_h = W_UK_hᵀ q_nope_h ``[C]``;  s_t = [q̃_h | q_rot_h]·latent_t;  o_h = W_UV_h Σ_t p_t c_t
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
    """One sequence: q ``[T, H, Dn + R]`` at the last T of L positions, latents ``[L, C + R]`` -> ``[T, H, Dv]``."""
    T, H, _ = q.shape
    L = latents.shape[0]
    C = kv_b.shape[1]
    kv = F.linear(latents[:, :C].to(q.dtype), kv_b).view(L, H, nope_dim + v_dim)
    k_rot = latents[:, C:].to(q.dtype)[:, None, :].expand(L, H, -1)
    k = torch.cat([kv[..., :nope_dim], k_rot], dim=-1)
    v = kv[..., nope_dim:]
    mask = None
    if T != L:  # queries sit at positions L-T..L-1 and see everything up to themselves
        pos_q = torch.arange(L - T, L)[:, None]
        mask = torch.arange(L)[None, :] <= pos_q
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       attn_mask=mask, is_causal=mask is None, scale=scale)
    return o.transpose(0, 1)


def mla_decode_absorbed(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                        context_lens: torch.Tensor, kv_b: torch.Tensor, *, nope_dim: int, v_dim: int,
                        scale: float) -> torch.Tensor:
    """One new token per sequence: q ``[B, H, Dn + R]`` -> ``[B, H, Dv]`` (fp32 scores and softmax)."""
    B, H, _ = q.shape
    C = kv_b.shape[1]
    bs = cache.shape[1]
    max_len = int(context_lens.max())
    nblk = (max_len + bs - 1) // bs
    idx = block_tables[:, :nblk].clamp(min=0).reshape(-1)
    lat = cache.index_select(0, idx).reshape(B, nblk * bs, -1)[:, :max_len].float()
    w = kv_b.float().view(H, nope_dim + v_dim, C)
    q_lat = torch.einsum("bhn,hnc->bhc", q[..., :nope_dim].float(), w[:, :nope_dim])
    scores = torch.einsum("bhc,blc->bhl", q_lat, lat[..., :C])
    scores += torch.einsum("bhr,blr->bhl", q[..., nope_dim:].float(), lat[..., C:])
    valid = torch.arange(max_len)[None, :] < context_lens[:, None]
    scores = (scores * scale).masked_fill(~valid[:, None, :], float("-inf"))
    o_lat = torch.einsum("bhl,blc->bhc", torch.softmax(scores, dim=-1), lat[..., :C])
    return torch.einsum("bhc,hvc->bhv", o_lat, w[:, nope_dim:]).to(q.dtype)
