"""A differentiable chunked KDA prefill for training, registered as backend "train" of op "kda_chunk".

The serving form (`ops/kda/chunk.py`) writes into preallocated buffers (``out=``, in-place decay), which
autograd refuses. This one computes the same WY chunk form out of place. Shapes as in `ops/kda/naive.py`:
q, k, g ``[1, T, H, K]`` packed (or ``[B, T, H, K]``), v ``[.., V]``, beta ``[.., H]``, cu_seqlens ``[N+1]``.

Per chunk of C tokens and head, Gamma = in-chunk inclusive cumsum of g ``[C, K]``, incoming state S:
  D[r, j] = exp(Gamma_r - Gamma_j) for j <= r (factored into matmul operands that cannot overflow, see _intra)
  A_kk[r, j] = sum_c k_r k_j D (j < r);  A_qk[r, j] = scale sum_c q_r k_j D (j <= r)
  delta = (I + diag(beta) A_kk)^-1 diag(beta) (V - (exp(Gamma) k) S)
  O = scale (exp(Gamma) q) S + A_qk delta;   S <- exp(Gamma_C) S + (exp(Gamma_C - Gamma) k)^T delta
The in-chunk terms are batched over all chunks, including each chunk's hand-off written as one affine map of
S; only applying those maps loops over chunk steps. Each
sequence is cut into its own chunks (no padding to the longest), and the hand-off at step n advances only
sequences with an n-th chunk.
"""

from __future__ import annotations

import torch

from k3serve.ops import registry
from k3serve.ops.kda.intra import FLOOR
from k3serve.ops.kda.validate import check_prefill, default_scale

# 32, not the serving kernel's 64: a K3 gate (>= -5 a token) cannot decay a chunk of 32 by more than 2 MAX_EXP,
# so _intra takes its two-matmul form; at 64 it needs the sub-blocked one, whose backward under autograd
# ran ~4.5x its forward. A 1.7k-token training pack (6 sequences, H = 4, K = 32): 46.6 ms forward and
# backward at 32, 68.4 at 64 (the state hand-off has twice the steps at 32, each cheap).
CHUNK = 32


# exp(x) for |x| <= MAX_EXP stays a normal fp32 number, and so does a product of two such factors.
MAX_EXP = 80.0
# Sub-block of the in-chunk terms when a chunk decays too far to factor through one reference (see _intra).
SUB = 16


def _decay(exponent: torch.Tensor) -> torch.Tensor:
    """exp(max(x, -FLOOR)) for an exponent x <= 0, as the serving kernel floors its decays (``ops/kda/intra.py``):
    the floored part is below fp32 resolution of what it is added to, and exp of anything under ~-87 takes
    a slow path on CPU (~90x slower per element than in range; the in-chunk cumulative gate reaches -160)."""
    return exponent.clamp(min=-FLOOR).exp()


def _intra(q: torch.Tensor, k: torch.Tensor, gamma: torch.Tensor, g_min: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A_qk (j <= r) and A_kk (j < r) ``[M, H, C, C]`` from q (scaled), k, gamma ``[M, H, C, K]``.

    exp(Gamma_r - Gamma_j) is never formed pairwise when it can be factored into two matmul operands:
      * the chunk cannot decay by more than 2 MAX_EXP: factor through the chunk midpoint,
        exp(Gamma_r - Gamma_m) exp(Gamma_m - Gamma_j), each within exp(+-MAX_EXP) (two matmuls);
      * otherwise split it into sub-blocks of SUB: a pair of sub-blocks jb < rb factors through the last
        position e of jb, exp(Gamma_r - Gamma_e) exp(Gamma_e - Gamma_j), both <= 1 since the gate never
        rises (no overflow; what underflows is truly below fp32), and the diagonal sub-blocks recurse.
    Only a sub-block whose own decay exceeds 2 MAX_EXP (a gate below -10 at SUB = 16) takes the pairwise
    ``[C, C, K]`` form, masked before exp; before sub-blocking the whole chunk did, ~12x slower."""
    C = q.shape[2]
    if -g_min * C <= 2 * MAX_EXP:
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        ref = gamma[..., C // 2 : C // 2 + 1, :]
        rows, cols = (gamma - ref).exp(), (ref - gamma).exp()
        a_qk = ((q * rows) @ (k * cols).mT).masked_fill(~causal, 0.0)
        a_kk = ((k * rows) @ (k * cols).mT).tril(-1)
        return a_qk, a_kk
    if C > SUB and C % SUB == 0:
        return _intra_blocked(q, k, gamma, g_min)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    diff = gamma.unsqueeze(3) - gamma.unsqueeze(2)  # [M, H, r, j, K]
    decay = torch.where(causal[..., None], diff, float("-inf")).exp()
    a_qk = torch.einsum("...rc,...jc,...rjc->...rj", q, k, decay)
    a_kk = torch.einsum("...rc,...jc,...rjc->...rj", k, k, decay).tril(-1)
    return a_qk, a_kk


def _intra_blocked(q: torch.Tensor, k: torch.Tensor, gamma: torch.Tensor, g_min: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``_intra`` by sub-blocks of SUB (C a multiple of SUB): column block by column block."""
    M, H, C, K = q.shape
    nb, S = C // SUB, SUB

    def blocks(x: torch.Tensor) -> torch.Tensor:  # [M, H, C, K] -> [M, H * nb, S, K]
        return x.reshape(M, H * nb, S, K)

    d_qk, d_kk = (a.view(M, H, nb, S, S) for a in _intra(blocks(q), blocks(k), blocks(gamma), g_min))
    cols_qk, cols_kk = [], []
    for jb in range(nb):
        a, e = jb * S, (jb + 1) * S  # block jb spans [a, e); its last position e - 1 is the reference
        above = q.new_zeros(M, H, a, S)
        col_qk, col_kk = [above, d_qk[:, :, jb]], [above, d_kk[:, :, jb]]
        if e < C:  # rows after block jb [M, H, C - e, *]
            ref = gamma[..., e - 1 : e, :]
            cols = k[..., a:e, :] * _decay(ref - gamma[..., a:e, :])  # [M, H, S, K]
            later = _decay(gamma[..., e:, :] - ref)
            col_qk.append((q[..., e:, :] * later) @ cols.mT)
            col_kk.append((k[..., e:, :] * later) @ cols.mT)
        cols_qk.append(torch.cat(col_qk, 2))
        cols_kk.append(torch.cat(col_kk, 2))
    return torch.cat(cols_qk, 3), torch.cat(cols_kk, 3)


def _chunk_layout(bounds: list[tuple[int, int]], C: int, device: torch.device
                  ) -> tuple[torch.Tensor, list[int], list[int]]:
    """Each sequence's tokens in its own run of zero-padded chunks (no padding to the longest sequence).

    Returns the flat destination of every packed token in ``[n_chunks * C]``, the first chunk of each
    sequence, and each sequence's chunk count."""
    counts = [-(-(e - s) // C) for s, e in bounds]
    firsts = [0]
    for c in counts[:-1]:
        firsts.append(firsts[-1] + c)
    dst = torch.cat([torch.arange(e - s, device=device) + f * C for (s, e), f in zip(bounds, firsts)])
    return dst, firsts, counts


def chunk_kda_train(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                    scale: float | None = None, initial_state: torch.Tensor | None = None,
                    cu_seqlens: torch.Tensor | None = None, chunk_size: int = CHUNK
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    bounds = check_prefill(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    V, C, N = v.shape[-1], chunk_size, len(bounds)
    scale = default_scale(scale, K)
    dst, firsts, counts = _chunk_layout(bounds, C, q.device)
    M = sum(counts)

    def pad(x: torch.Tensor) -> torch.Tensor:
        """Packed ``[B*T, H, d]`` -> chunks ``[M, H, C, d]`` fp32, zero padding (g = beta = 0: inert)."""
        x = x.reshape(B * T, H, -1).float()
        out = x.new_zeros(M * C, H, x.shape[-1]).index_copy(0, dst, x)
        return out.view(M, C, H, -1).transpose(1, 2)

    qc, kc, vc, gc, bc = pad(q), pad(k), pad(v), pad(g), pad(beta)
    gamma = gc.cumsum(2)  # [M, H, C, K]
    a_qk, a_kk = _intra(qc * scale, kc, gamma, float(g.detach().min()) if g.numel() else 0.0)
    lhs = torch.eye(C, device=q.device) + bc * a_kk  # unit lower-triangular
    exp_g = _decay(gamma)
    wu = torch.linalg.solve_triangular(lhs, torch.cat([bc * exp_g * kc, bc * vc], -1), upper=False,
                                       unitriangular=True)
    w, u = wu.split([K, V], -1)
    last = gamma[..., -1:, :]  # [M, H, 1, K]
    k_suf_t = (_decay(last - gamma) * kc).mT  # [M, H, K, C]
    # Each chunk's state hand-off is one affine map, S' = A S + b, and its output O = Q' S + c, with
    #   A = diag(exp(Gamma_C)) - k_suf^T W,  b = k_suf^T U,  Q' = scale q exp(Gamma) - A_qk W,  c = A_qk U,
    # all batched over the chunks here: the sequential loop is then one baddbmm a step (it was five ops), and
    # the outputs one batched product after it.
    hand_a = torch.diag_embed(_decay(last[..., 0, :])) - k_suf_t @ w  # [M, H, K, K]
    hand_b = k_suf_t @ u  # [M, H, K, V]
    q_out = scale * exp_g * qc - a_qk @ w  # [M, H, C, K]
    c_out = a_qk @ u  # [M, H, C, V]

    # Sequences ranked by chunk count: the ones still running at step n are a prefix of the ranking. The
    # chunk tensors are put in step-major order once (step 0's chunks of every sequence, then step 1's ...)
    # and split per step: each step then reads plain views, and the backward joins the steps' gradients in
    # one cat, where per-step gathers cost a full-size zero-filled scatter each.
    order = sorted(range(N), key=lambda i: -counts[i])
    active = [sum(1 for c in counts if c > n) for n in range(max(counts, default=0))]
    perm = torch.tensor([firsts[i] + n for n, a in enumerate(active) for i in order[:a]], device=q.device)
    # (chunk, head) pairs flattened into one batch dim, so each product is a single bmm / baddbmm
    steps_a, steps_b = (t.index_select(0, perm).flatten(0, 1).split([a * H for a in active])
                        for t in (hand_a, hand_b))
    state = q.new_zeros(N, H, K, V, dtype=torch.float32) if initial_state is None else initial_state.float()
    state = state[order].flatten(0, 1)  # [N * H, K, V], ranking order
    incoming, done = [], []  # each chunk's incoming state (step-major); the states of finished sequences
    for a, a_n, b_n in zip(active, steps_a, steps_b):
        if state.shape[0] > a * H:  # the lowest-ranked sequences have no n-th chunk: their states are final
            done.append(state[a * H:])
            state = state[:a * H]
        incoming.append(state)
        state = torch.baddbmm(b_n, a_n, state)
    state = torch.cat([state, *reversed(done)]).view(N, H, K, V)
    o = torch.baddbmm(c_out.index_select(0, perm).flatten(0, 1), q_out.index_select(0, perm).flatten(0, 1),
                      torch.cat(incoming))
    o = o.view(M, H, C, V)[perm.argsort()]  # back to chunk order [M, H, C, V]
    o = o.transpose(1, 2).reshape(M * C, H, V)[dst]
    final = torch.empty_like(state)
    final[order] = state
    return o.reshape(B, T, H, V).to(v.dtype), final


registry.register("kda_chunk", "train")(chunk_kda_train)
