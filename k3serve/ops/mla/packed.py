"""Causal MLA prefill of a packed batch of fresh sequences (nothing cached before the step).

q ``[N, H, Dn + R]``, latents ``[N, C + R]`` (the sequences' own, in token order), cu_seqlens ``[B+1]`` (host)
-> ``[N, H, Dv]``; the spec is ``mla_prefill`` (``paged.py``) on each sequence alone.

  * ``loop`` ("torch", the default): exactly that, one call per sequence; the CPU-tuned path.
  * ``bucketed``: the sequences, longest first, are grouped into buckets whose padded size stays within
    ``WASTE`` of their tokens; each bucket is right-padded to its longest sequence and runs as one batched
    causal SDPA. Right padding needs no mask beyond the causal one: a real query never sees a later key.
    A few large calls instead of one per sequence, which is what a GPU wants when a training step packs
    hundreds of sequences (per call overhead, not arithmetic, bounds a model this small there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3serve.ops.mla.paged import mla_prefill

# Bound on a bucket's padded size over its real tokens. Sequences range ~30-2,500 tokens in training: 1.5
# gives about a dozen buckets; a tighter bound adds calls, a looser one adds padded work.
WASTE = 1.5


def mla_prefill_loop(q: torch.Tensor, latents: torch.Tensor, cu_seqlens: torch.Tensor, kv_b: torch.Tensor, *,
                     nope_dim: int, v_dim: int, scale: float) -> torch.Tensor:
    o = q.new_empty(q.shape[0], q.shape[1], v_dim)
    cu = cu_seqlens.tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        o[a:b] = mla_prefill(q[a:b], latents[a:b], kv_b, nope_dim=nope_dim, v_dim=v_dim, scale=scale)
    return o


def buckets(lens: list[int], waste: float = WASTE) -> list[list[int]]:
    """Sequence indices grouped longest first; a bucket's ``count x longest`` stays <= ``waste x`` its tokens."""
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    out: list[list[int]] = []
    total = 0
    for i in order:
        if out and (len(out[-1]) + 1) * lens[out[-1][0]] <= waste * (total + lens[i]):
            out[-1].append(i)
            total += lens[i]
        else:
            out.append([i])
            total = lens[i]
    return out


def mla_prefill_bucketed(q: torch.Tensor, latents: torch.Tensor, cu_seqlens: torch.Tensor, kv_b: torch.Tensor, *,
                         nope_dim: int, v_dim: int, scale: float, waste: float = WASTE) -> torch.Tensor:
    N, H, D = q.shape
    C = kv_b.shape[1]
    f32 = torch.float32
    kv = F.linear(latents[:, :C].to(q.dtype), kv_b).view(N, H, nope_dim + v_dim).to(f32)
    k = torch.cat([kv[..., :nope_dim], latents[:, None, C:].to(f32).expand(N, H, D - nope_dim)], -1)
    # values padded to the query/key width: SDPA's fused kernels want one head size
    v = F.pad(kv[..., nope_dim:], (0, max(0, D - v_dim)))
    # one zero row at index N: padding positions gather it
    rows = [torch.cat([t, t.new_zeros(1, H, t.shape[-1])]) for t in (q.to(f32), k, v)]
    cu = cu_seqlens.tolist()
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    outs, dst = [], []
    for group in buckets(lens, waste):
        L = lens[group[0]]
        idx = [N] * (len(group) * L)
        real = []
        for j, s in enumerate(group):
            idx[j * L:j * L + lens[s]] = range(cu[s], cu[s + 1])
            real.extend(range(j * L, j * L + lens[s]))
            dst.extend(range(cu[s], cu[s + 1]))
        index = torch.tensor(idx, device=q.device)
        qb, kb, vb = (r.index_select(0, index).view(len(group), L, H, -1).transpose(1, 2) for r in rows)
        ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)  # [n, H, L, D]
        outs.append(ob.transpose(1, 2).reshape(len(group) * L, H, -1).index_select(
            0, torch.tensor(real, device=q.device)))
    order = torch.empty(N, dtype=torch.long, device="cpu")  # host side: token -> its row in cat(outs)
    order[torch.tensor(dst, device="cpu")] = torch.arange(N, device="cpu")
    return torch.cat(outs).index_select(0, order.to(q.device))[..., :v_dim].to(q.dtype)
