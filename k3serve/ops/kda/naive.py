"""KDA token-by-token recurrence: the reference every faster form is tested against.

Per sequence and head the state S is a `[K, V]` fp32 matrix; for each token t (all math in fp32):

    S <- Diag(exp(g_t)) S;  u = S^T k_t;  delta = beta_t (v_t - u);  S <- S + k_t delta^T;  o_t = S^T (scale q_t)

Shapes: q, k, g `[B, T, H, K]` (q, k already L2-normalised, g = log decay <= 0), v `[B, T, H, V]`,
beta `[B, T, H]` (already sigmoid-ed), initial_state `[N, H, K, V]` fp32 or None (zeros). With cu_seqlens
`[N+1]` the batch is B = 1 and T packs N sequences; otherwise N = B. Returns o `[B, T, H, V]` in v's dtype
and final_state `[N, H, K, V]` fp32.
"""

from __future__ import annotations

import torch

from k3serve.ops.kda.validate import check_prefill, default_scale


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_prefill(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = default_scale(scale, K)
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    state = torch.zeros(N, H, K, V, dtype=torch.float32, device=q.device)
    if initial_state is not None:
        state.copy_(initial_state)
    o = torch.zeros(B, T, H, V, dtype=torch.float32, device=q.device)
    if cu_seqlens is None:
        _recur(q, k, v, g, beta, state, o, scale)
    else:
        for n, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
            t = slice(start, end)
            _recur(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state[n : n + 1], o[:, t], scale)
    return o.to(v.dtype), state


def _recur(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    S: torch.Tensor,
    o: torch.Tensor,
    scale: float,
) -> None:
    """Run b equal-length sequences `[b, t, H, *]` through the recurrence; S `[b, H, K, V]` and o
    `[b, t, H, V]` are updated in place."""
    for t in range(q.shape[1]):
        q_t, k_t, v_t = q[:, t].float(), k[:, t].float(), v[:, t].float()
        S.mul_(g[:, t].float().exp()[..., None])
        u = (S * k_t[..., None]).sum(-2)
        delta = beta[:, t].float()[..., None] * (v_t - u)
        S.add_(k_t[..., None] * delta[..., None, :])
        o[:, t] = (S * (scale * q_t)[..., None]).sum(-2)
