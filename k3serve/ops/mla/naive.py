"""MLA attention over the compressed latent cache, naive reference (the spec).

One sequence at a time, latents expanded to per-head keys and values, plain causal softmax:
  latents ``[L, C + R]`` = ``[c (kv_lora_rank C) | k_rot (R)]`` for the sequence's positions ``0..L-1``
  q ``[T, H, Dn + R]`` for its last T positions (``L - T .. L - 1``)
  kv_b ``[H·(Dn + Dv), C]``: per head, rows ``[k_nope (Dn) | v (Dv)]``
  k_h = ``[W_UK_h c | k_rot]`` (k_rot shared by all heads, never rotated: NoPE), v_h = ``W_UV_h c``
  o ``[T, H, Dv]`` = softmax(q·k / sqrt(Dn + R), causal) · v
The packed prefill and the paged decode forms are this, one sequence at a time (the decode reading each of a
sequence's positions from its cache block and offset).
"""

from __future__ import annotations

import torch


def naive_mla_attention(q: torch.Tensor, latents: torch.Tensor, kv_b: torch.Tensor, *, nope_dim: int,
                        v_dim: int, scale: float | None = None) -> torch.Tensor:
    T, H, qk_dim = q.shape
    L = latents.shape[0]
    C = kv_b.shape[1]
    scale = scale if scale is not None else qk_dim ** -0.5
    c, k_rot = latents[:, :C].float(), latents[:, C:].float()
    kv = (c @ kv_b.float().t()).view(L, H, nope_dim + v_dim)
    out = torch.empty(T, H, v_dim, dtype=torch.float32)
    for h in range(H):
        k = torch.cat([kv[:, h, :nope_dim], k_rot], dim=-1)  # [L, Dn + R]
        v = kv[:, h, nope_dim:]
        for t in range(T):
            pos = L - T + t
            s = (k[: pos + 1] @ q[t, h].float()) * scale
            out[t, h] = torch.softmax(s, dim=0) @ v[: pos + 1]
    return out.to(q.dtype)


def naive_mla_prefill_packed(q: torch.Tensor, latents: torch.Tensor, cu_seqlens: torch.Tensor, kv_b: torch.Tensor,
                             *, nope_dim: int, v_dim: int, scale: float | None = None) -> torch.Tensor:
    """Fresh sequences packed along tokens: q ``[N, H, Dn + R]``, latents ``[N, C + R]``, cu_seqlens ``[B+1]``."""
    cu = cu_seqlens.tolist()
    parts = [naive_mla_attention(q[a:b], latents[a:b], kv_b, nope_dim=nope_dim, v_dim=v_dim, scale=scale)
             for a, b in zip(cu[:-1], cu[1:])]
    return torch.cat(parts) if parts else q.new_empty(0, q.shape[1], v_dim)


def naive_mla_decode(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                     kv_b: torch.Tensor, *, nope_dim: int, v_dim: int, scale: float | None = None,
                     workspace: torch.Tensor | None = None, plan: object = None) -> torch.Tensor:
    """One new token per sequence: q ``[B, H, Dn + R]`` against its first ``context_lens[b]`` cached latents
    (position p at block ``block_tables[b, p // block_size]``, row ``p % block_size``). ``workspace`` and
    ``plan`` (the torch form's buffers) are accepted and unused."""
    bs = cache.shape[1]
    out = []
    for b, n in enumerate(context_lens.tolist()):
        rows = torch.stack([cache[int(block_tables[b, p // bs]), p % bs] for p in range(n)])
        out.append(naive_mla_attention(q[b:b + 1], rows, kv_b, nope_dim=nope_dim, v_dim=v_dim, scale=scale)[0])
    return torch.stack(out) if out else q.new_empty(0, q.shape[1], v_dim)
