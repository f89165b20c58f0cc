"""KDA chunked parallel (WY) form for prefill; equals `naive_recurrent_kda` up to fp32 rounding.

Shapes as in `naive.py`: q, k, g `[B, T, H, K]`, v `[B, T, H, V]`, beta `[B, T, H]`, initial_state
`[N, H, K, V]` fp32, cu_seqlens `[N+1]`. Every sequence is cut into chunks of C tokens, the last one
zero-padded (g = 0 and beta = 0 there, so padding neither decays nor writes the state). For one chunk and
head with incoming state S, Gamma = in-chunk cumsum of g `[C, K]`:

    A_kk[r, j] = beta_r sum_c k_r k_j exp(Gamma_r - Gamma_j)   (j < r)
    A_qk[r, j] = scale  sum_c q_r k_j exp(Gamma_r - Gamma_j)   (j <= r)
    [W | U]    = (I + A_kk)^-1 Diag(beta) [exp(Gamma) * K | V]
    V_new = U - W S;   O = scale (exp(Gamma) * Q) S + A_qk V_new
    S <- Diag(exp(Gamma_C)) S + (exp(Gamma_C - Gamma) * K)^T V_new

`chunk_size=None` picks C from the sequence lengths (`auto_chunk_size`). Chunks of all sequences are laid out
step-major (chunk n of every sequence that has one, side by side), their in-chunk terms are computed in
batched ops, and only the state hand-off loops over steps.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from k3serve.ops.kda.intra import intra_chunk
from k3serve.ops.kda.validate import check_prefill, default_scale

# Elements per in-chunk tensor in one group of chunks (about 1 MiB of fp32): small enough to stay in cache.
GROUP_ELEMENTS = 1 << 18
# Chunk lengths `auto_chunk_size` chooses from, and the padding it accepts for a longer chunk.
AUTO_CHUNK_SIZES = (64, 32, 16)
AUTO_PADDING_SLACK = 1.1


def auto_chunk_size(lens: list[int]) -> int:
    """The longest chunk whose zero-padded token count stays within AUTO_PADDING_SLACK of the shortest's.

    Long chunks make fewer state hand-off steps (best for a few long sequences), but each sequence is padded to
    whole chunks and the in-chunk work grows with C: a continuous-batching step that packs many short pieces
    (decode tokens, chunked-prefill tails) is faster with short chunks."""
    def padded(c: int) -> int:
        return sum(-(-n // c) * c for n in lens)

    floor = padded(AUTO_CHUNK_SIZES[-1])
    return next(c for c in AUTO_CHUNK_SIZES if padded(c) <= AUTO_PADDING_SLACK * floor)


def _layout(
    bounds: list[tuple[int, int]], C: int, device: torch.device
) -> tuple[torch.Tensor, list[int], list[int], list[int]]:
    """Place tokens in step-major chunk slots.

    Sequences are ranked by chunk count (descending); chunk n of the rank-j sequence goes to slot
    offset[n] + j, so the chunks advanced at step n form one contiguous slice of `active[n]` slots.
    Returns the padded position of every token, the sequence order, active counts and slot offsets.
    """
    lens = [e - s for s, e in bounds]
    nchunks = [-(-n // C) for n in lens]
    order = sorted(range(len(bounds)), key=lambda i: -nchunks[i])
    rank = [0] * len(bounds)
    for j, i in enumerate(order):
        rank[i] = j
    steps = max(nchunks, default=0)
    active = [sum(1 for nc in nchunks if nc > n) for n in range(steps)]
    offsets = [0]
    for a in active:
        offsets.append(offsets[-1] + a)
    lens_t = torch.tensor(lens, device=device)
    seq_id = torch.repeat_interleave(torch.arange(len(bounds), device=device), lens_t, output_size=sum(lens))
    starts = torch.tensor([s for s, _ in bounds], device=device)
    pos = torch.arange(seq_id.numel(), device=device) - starts[seq_id]
    slot = torch.tensor(offsets[:-1] or [0], device=device)[pos // C] + torch.tensor(rank, device=device)[seq_id]
    return slot * C + pos % C, order, active, offsets


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    bounds = check_prefill(q, k, v, g, beta, initial_state, cu_seqlens)
    if chunk_size is None:
        chunk_size = auto_chunk_size([e - s for s, e in bounds])
    if not isinstance(chunk_size, int) or chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a positive power of two, got {chunk_size!r}")
    B, T, H, K = q.shape
    V, C, N = v.shape[-1], chunk_size, len(bounds)
    scale = default_scale(scale, K)
    dev, f32 = q.device, torch.float32
    dst, order, active, offsets = _layout(bounds, C, dev)
    slots = offsets[-1]
    T_seq = bounds[0][1] - bounds[0][0] if bounds else 0

    # Equal-length sequences filling whole chunks need no padding: step-major order is then a transpose.
    uniform = N > 0 and all(e - s == T_seq for s, e in bounds) and T_seq % C == 0
    steps = len(active)

    # Row of each (token, head) in the head-major chunk layout `[slots, H, C]`: tokens are scattered into and
    # gathered out of that layout directly, without a `[slots, C, H]` buffer and a transposed copy of it.
    rows_th = None if uniform else (((dst // C) * (H * C) + dst % C)[:, None]
                                    + torch.arange(H, device=dev) * C).reshape(-1)

    def to_chunks(x: torch.Tensor) -> torch.Tensor:
        """Packed `[B*T, H, D]` -> zero-padded chunks `[slots * H, C, D]` fp32."""
        d = x.shape[3] if x.dim() == 4 else 1
        if uniform:
            x = x.reshape(N, steps, C, H, d).permute(1, 0, 3, 2, 4)
            return x.to(f32).reshape(slots * H, C, d)
        out = torch.zeros(slots * H * C, d, dtype=f32, device=dev)
        out.index_copy_(0, rows_th, x.reshape(B * T * H, d).to(f32))
        return out.view(slots * H, C, d)

    qc, kc, gc, vc = to_chunks(q.float() * scale), to_chunks(k), to_chunks(g), to_chunks(v)
    bc = to_chunks(beta).view(slots, H, C, 1)
    state = torch.zeros(N, H, K, V, dtype=f32, device=dev)
    if initial_state is not None:
        state.copy_(initial_state[order])
    o = torch.empty(slots, H, C, V, dtype=f32, device=dev)
    # Steps are processed in groups whose in-chunk tensors stay cache-sized; within a group the in-chunk
    # work is batched and only the state hand-off runs step by step.
    group_slots = max(1, GROUP_ELEMENTS // (H * C * max(K, V)))
    n0 = 0
    while n0 < len(active):
        n1 = n0 + 1
        while n1 < len(active) and offsets[n1 + 1] - offsets[n0] <= group_slots:
            n1 += 1
        lo, hi = offsets[n0], offsets[n1]
        rows = slice(lo * H, hi * H)
        t = _chunk_terms(qc[rows], kc[rows], gc[rows], vc[rows], bc[lo:hi], H)
        s_in = torch.empty(hi - lo, H, K, V, dtype=f32, device=dev)
        v_new = torch.empty(hi - lo, H, C, V, dtype=f32, device=dev)
        for n in range(n0, n1):
            a = active[n]
            sl = slice(offsets[n] - lo, offsets[n] - lo + a)
            s = state[:a]
            s_in[sl] = s
            torch.baddbmm(t.u[sl].flatten(0, 1), t.w[sl].flatten(0, 1), s.flatten(0, 1), alpha=-1,
                          out=v_new[sl].flatten(0, 1))
            s.mul_(t.chunk_decay[sl])
            s.flatten(0, 1).baddbmm_(t.k_suffix_t[sl].flatten(0, 1), v_new[sl].flatten(0, 1))
        o[lo:hi] = t.q_decay @ s_in + t.a_q @ v_new
        n0 = n1
    final = torch.empty_like(state)
    final[order] = state
    if uniform:
        o = o.view(steps, N, H, C, V).permute(1, 0, 3, 2, 4)
    else:
        o = o.view(slots * H * C, V).index_select(0, rows_th)
    return o.reshape(B, T, H, V).to(v.dtype), final


class ChunkTerms(NamedTuple):
    w: torch.Tensor
    u: torch.Tensor
    a_q: torch.Tensor
    q_decay: torch.Tensor
    k_suffix_t: torch.Tensor
    chunk_decay: torch.Tensor


def _chunk_terms(
    q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, H: int
) -> ChunkTerms:
    """Per-chunk terms for G chunks: q (scaled), k, g `[G * H, C, K]`, v `[G * H, C, V]`, beta `[G, H, C, 1]`.

    Returns W `[G, H, C, K]`, U `[G, H, C, V]`, A_qk `[G, H, C, C]`, scale * q exp(Gamma) `[G, H, C, K]`,
    (k exp(Gamma_C - Gamma))^T `[G, H, K, C]` and exp(Gamma_C) `[G, H, K, 1]`.
    """
    G, C, K, V = beta.shape[0], q.shape[1], q.shape[2], v.shape[2]
    intra = intra_chunk(q, k, g)
    i_plus_l = intra.a_k.view(G, H, C, C).mul_(beta)
    i_plus_l.diagonal(dim1=-2, dim2=-1).fill_(1.0)
    rhs = torch.empty(G, H, C, K + V, dtype=q.dtype, device=q.device)
    torch.mul(intra.k_decay.view(G, H, C, K), beta, out=rhs[..., :K])
    torch.mul(v.view(G, H, C, V), beta, out=rhs[..., K:])
    # Solved as X^T (I + A_kk)^T = rhs^T: the transposed views are already in LAPACK's column-major order,
    # which saves two copies and halves the solve's time on CPU.
    wu = torch.linalg.solve_triangular(i_plus_l.mT, rhs.mT, upper=True, left=False, unitriangular=True).mT
    return ChunkTerms(
        wu[..., :K],
        wu[..., K:],
        intra.a_q.view(G, H, C, C),
        intra.q_decay.view(G, H, C, K),
        intra.k_suffix.view(G, H, C, K).mT,
        intra.chunk_decay.view(G, H, K, 1),
    )
