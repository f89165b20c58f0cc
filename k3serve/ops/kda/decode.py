"""KDA single-token decode step for a batch of N sequences, each with its own state.

q, k, g `[N, H, K]`, v `[N, H, V]`, beta `[N, H]`, state `[N, H, K, V]` fp32. One step of the recurrence
in `naive.py`, batched over sequences and heads: S <- Diag(exp(g)) S; S <- S + k (beta (v - S^T k))^T;
o = S^T (scale q). Returns o `[N, H, V]` in v's dtype and the new state; with `out_state` (which may be
`state` itself, for an in-place update) the new state is written there and returned.
"""

from __future__ import annotations

import torch

from k3serve.ops.kda.validate import check_state, default_scale


def kda_decode(
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
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be a 3-D tensor [N, H, K], got {getattr(q, 'shape', type(q).__name__)}")
    N, H, K = q.shape
    for name, t in (("k", k), ("g", g)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (N, H, K):
            got = list(getattr(t, "shape", []))
            raise ValueError(f"{name} must have shape [N, H, K] = {[N, H, K]}, got {got}")
    if not isinstance(v, torch.Tensor) or v.dim() != 3 or tuple(v.shape[:2]) != (N, H):
        raise ValueError(f"v must have shape [N, H, V] with N, H = {N, H}, got {list(getattr(v, 'shape', []))}")
    if not isinstance(beta, torch.Tensor) or tuple(beta.shape) != (N, H):
        raise ValueError(f"beta must have shape [N, H] = {[N, H]}, got {list(getattr(beta, 'shape', []))}")
    V = v.shape[-1]
    if state is None:
        raise ValueError("state must be a float32 tensor [N, H, K, V], got None")
    check_state("state", state, (N, H, K, V))
    check_state("out_state", out_state, (N, H, K, V))
    scale = default_scale(scale, K)
    if out_state is None:
        out_state = torch.empty(N, H, K, V, dtype=torch.float32, device=state.device)
    elif not out_state.is_contiguous():
        raise ValueError("out_state must be contiguous")
    qf, kf, vf = q.float().reshape(N * H, K), k.float().reshape(N * H, K), v.float().reshape(N * H, V)
    # `state` is only read by this first op, so out_state may alias it.
    torch.mul(state, g.float().exp()[..., None], out=out_state)
    S = out_state.view(N * H, K, V)
    u = torch.bmm(kf[:, None], S)[:, 0]
    delta = beta.float().reshape(N * H, 1) * (vf - u)
    S.baddbmm_(kf[:, :, None], delta[:, None])
    o = torch.bmm((scale * qf)[:, None], S).view(N, H, V)
    return o.to(v.dtype), out_state
