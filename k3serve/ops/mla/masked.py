"""MLA absorbed decode in a fixed-shape, host-sync-free form: the form a CUDA graph can capture.

q ``[B, H, Dn + R]`` (one new token per row), cache ``[num_blocks, block_size, C + R]``, block_tables
``[B, nblk]`` (-1 for unused columns; every row has the same ``nblk``), context_lens ``[B]`` (device tensor,
never read on the host) -> ``[B, H, Dv]``. The same math as ``paged.mla_decode_absorbed``:
  q̃_h = [W_UK_hᵀ q_nope_h | q_rot_h] · scale;  s_t = q̃_h · latent_t for every t < nblk · block_size
  s_t = -inf for t >= context_lens[b];  o_h = W_UV_h Σ_t softmax(s)_t c_t
but over all ``nblk`` columns of every row, with the lengths applied as a mask instead of a per-step chunk
plan: no ``.tolist()``, no sort, no shape that depends on a length. Rows go in fixed-size groups (the group
size depends only on the shapes) so the gathered latents stay bounded. Unused columns gather block 0 (masked).
"""

from __future__ import annotations

import torch

# Gathered latents per row group (elements; 4 MiB of fp32), as the paged form's chunks.
MASKED_GROUP_ELEMENTS = 1 << 20


def mla_decode_masked(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                      context_lens: torch.Tensor, kv_b: torch.Tensor, *, nope_dim: int, v_dim: int,
                      scale: float, **_: object) -> torch.Tensor:
    """See the module docstring; extra keywords (the paged form's ``workspace`` / ``plan``) are ignored."""
    B, H, _ = q.shape
    C = kv_b.shape[1]
    bs, width = cache.shape[1], cache.shape[2]
    nblk = block_tables.shape[1]
    L = nblk * bs
    w = kv_b.float().view(H, nope_dim + v_dim, C)
    qf = q.float()
    q_cat = torch.cat([torch.bmm(qf[..., :nope_dim].transpose(0, 1), w[:, :nope_dim]).transpose(0, 1),
                       qf[..., nope_dim:]], dim=-1) * scale  # [B, H, C + R]
    # True past each row's context: positions are a fixed arange, the lengths stay on the device
    pad = torch.arange(L, device=q.device)[None, :] >= context_lens.to(q.device)[:, None]  # [B, L]
    blocks = block_tables.clamp(min=0)
    rows = max(1, MASKED_GROUP_ELEMENTS // max(1, L * width))
    o_lat = torch.empty(B, H, C, dtype=torch.float32, device=q.device)
    for a in range(0, B, rows):
        b = min(B, a + rows)
        lat = cache.index_select(0, blocks[a:b].reshape(-1)).view(b - a, L, width).float()
        scores = torch.bmm(q_cat[a:b], lat.transpose(1, 2))  # [n, H, L]
        scores.masked_fill_(pad[a:b, None, :], float("-inf"))
        o_lat[a:b] = torch.bmm(torch.softmax(scores, dim=-1), lat[..., :C])
    return torch.bmm(o_lat.transpose(0, 1), w[:, nope_dim:].transpose(1, 2)).transpose(0, 1).to(q.dtype)
