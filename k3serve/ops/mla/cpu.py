"""Absorbed MLA decode with the native CPU kernel: scores, softmax and the latent-weighted sum in one pass
over each sequence's paged cache rows, read in place (no gather, no padding, no chunk plan).

q ``[B, H, Dn + R]``, cache ``[num_blocks, block_size, C + R]``, block_tables ``[B, max_blocks]`` int64,
context_lens ``[B]`` -> ``[B, H, Dv]``, like ``paged.mla_decode_absorbed``; falls back to it when the kernel
does not apply (no extension, CUDA, a non-fp32 cache, grad mode).
"""

from __future__ import annotations

import torch

from k3serve.ops import native
from k3serve.ops.mla.paged import DecodeChunk, mla_decode_absorbed


def mla_decode_cpu(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                   kv_b: torch.Tensor, *, nope_dim: int, v_dim: int, scale: float,
                   workspace: torch.Tensor | None = None, plan: list[DecodeChunk] | None = None) -> torch.Tensor:
    kernels = native.kernels_or_none(q, cache, kv_b)
    if (kernels is None or not native.fits(q, cache, kv_b) or not cache.is_contiguous() or q.dim() != 3
            or block_tables.dtype != torch.int64 or block_tables.device.type != "cpu" or block_tables.dim() != 2
            or block_tables.stride(-1) != 1 or block_tables.shape[0] != q.shape[0]
            or context_lens.numel() != q.shape[0]):
        return mla_decode_absorbed(q, cache, block_tables, context_lens, kv_b, nope_dim=nope_dim, v_dim=v_dim,
                                   scale=scale, workspace=workspace, plan=plan)
    B, H, _ = q.shape
    C = kv_b.shape[1]
    num_blocks, bs, width = cache.shape
    w = kv_b.view(H, nope_dim + v_dim, C)
    # absorb W_UK into q and fold in the scale: q_cat = [W_UK^T q_nope | q_rot] · scale, [B, H, C + R]
    q_cat = torch.empty(B, H, width, dtype=torch.float32)
    torch.bmm(q[..., :nope_dim].transpose(0, 1), w[:, :nope_dim], out=q_cat[..., :C].transpose(0, 1))
    q_cat[..., C:] = q[..., nope_dim:]
    q_cat.mul_(scale)
    lens = context_lens.to(device="cpu", dtype=torch.int64).contiguous()
    o_lat = torch.empty(B, H, C, dtype=torch.float32)
    kernels.mla_decode(q_cat.data_ptr(), cache.data_ptr(), block_tables.data_ptr(), lens.data_ptr(), o_lat.data_ptr(),
                       B, H, width, C, num_blocks, bs, block_tables.stride(0))
    return torch.bmm(o_lat.transpose(0, 1), w[:, nope_dim:].transpose(1, 2)).transpose(0, 1)


# Callers may skip the workspace and chunk plan (used only by the torch fallback, which plans for itself).
mla_decode_cpu.reads_cache_in_place = True
