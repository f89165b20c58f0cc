"""The whole KDA decode step of a batch as one op, torch form (the spec of the fused kernels):
short conv + SiLU, L2 norm of q and k, the log-decay gate, beta, and the delta-rule step.

qkv ``[N, 2HK + HV]`` pre-conv q|k|v (one token per sequence), conv_weight ``[2HK + HV, W]``,
conv_state ``[N, 2HK + HV, W-1]`` (updated in place), f ``[N, H, K]`` gate projection, dt_bias ``[H·K]``,
a_log ``[H]``, b ``[N, H]`` beta logits, state ``[N, H, K, V]`` fp32 (updated in place) -> o ``[N, H, V]`` fp32.
  g = -exp(a_log_h) softplus(f + dt_bias)  (Kimi-Linear, lower_bound None)
    | lower_bound sigmoid(exp(a_log_h) (f + dt_bias))  (K3)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3serve.ops import registry

L2_EPS = 1e-6


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """x / ||x|| over the last dim in fp32, eps inside the sqrt."""
    xf = x.float()
    return xf / torch.sqrt((xf * xf).sum(-1, keepdim=True) + eps)


def kda_gate(f: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor,
             lower_bound: float | None) -> torch.Tensor:
    """Log decay g ``[N, H, K]`` from the low-rank gate projection f ``[N, H, K]`` (fp32 math)."""
    H, K = f.shape[-2:]
    x = f.float() + dt_bias.float().view(H, K)
    rate = a_log.float().exp().view(H, 1)
    if lower_bound is None:
        return -rate * F.softplus(x, beta=1.0, threshold=20.0)
    return lower_bound * torch.sigmoid(rate * x)


def kda_decode_step(qkv: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor, f: torch.Tensor,
                    dt_bias: torch.Tensor, a_log: torch.Tensor, b: torch.Tensor, state: torch.Tensor, *,
                    lower_bound: float | None, scale: float | None = None, l2_eps: float = L2_EPS) -> torch.Tensor:
    N, H, K = f.shape
    y, _ = registry.get("short_conv_update")(qkv.float(), conv_weight, conv_state, out_state=conv_state)
    # q and k are normalised together (same per-head math, half the ops)
    qk = l2_normalize(y[:, : 2 * H * K].reshape(N, 2 * H, K), l2_eps)
    q, k, v = qk[:, :H], qk[:, H:], y[:, 2 * H * K:].reshape(N, H, -1)
    g = kda_gate(f, dt_bias, a_log, lower_bound)
    o, _ = registry.get("kda_decode")(q, k, v, g, torch.sigmoid(b.float()), state, scale=scale, out_state=state)
    return o
