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
from k3serve.ops.short_conv.naive import naive_causal_conv1d_update


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


def naive_kda_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    scale: float | None = None,
    out_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of N sequences (q, k, g ``[N, H, K]``, v ``[N, H, V]``, beta ``[N, H]``, state
    ``[N, H, K, V]``): the recurrence above with T = 1; the new state is written to ``out_state`` when given."""
    o, new_state = naive_recurrent_kda(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], scale=scale,
                                       initial_state=state)
    if out_state is not None:
        new_state = out_state.copy_(new_state)
    return o[:, 0], new_state


def naive_kda_decode_step(qkv: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor, f: torch.Tensor,
                          dt_bias: torch.Tensor, a_log: torch.Tensor, b: torch.Tensor, state: torch.Tensor, *,
                          lower_bound: float | None, scale: float | None = None, l2_eps: float = 1e-6) -> torch.Tensor:
    """The whole decode step (``step.py``'s contract: conv and recurrent states updated in place, o fp32) from
    the textbook pieces: the naive short conv + SiLU, q and k divided by sqrt(||·||² + l2_eps), the gate
    g = -exp(a_log) softplus(f + dt_bias) (Kimi-Linear) or lower_bound sigmoid(exp(a_log) (f + dt_bias)) (K3),
    beta = sigmoid(b), then one token of the recurrence."""
    N, H, K = f.shape
    y, _ = naive_causal_conv1d_update(qkv.float(), conv_weight, conv_state, out_state=conv_state)
    q, k = (y[:, i * H * K:(i + 1) * H * K].reshape(N, H, K) for i in range(2))
    q, k = (t / torch.sqrt((t * t).sum(-1, keepdim=True) + l2_eps) for t in (q, k))
    x = f.float() + dt_bias.float().reshape(H, K)
    rate = a_log.float().exp().reshape(H, 1)
    if lower_bound is None:  # softplus as torch's: linear past 20
        g = -rate * torch.where(x > 20, x, torch.log1p(torch.exp(x)))
    else:
        g = lower_bound * torch.sigmoid(rate * x)
    o, _ = naive_kda_decode(q, k, y[:, 2 * H * K:].reshape(N, H, -1), g, torch.sigmoid(b.float()), state,
                            scale=scale, out_state=state)
    return o.float()
