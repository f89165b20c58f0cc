"""Kimi Delta Attention layer (both flavours) over packed variable-length batches.

x ``[N, d]`` packed tokens of the active ``ForwardContext``:
  q, k, v = W_{q,k,v} x                     ``[N, P]``, P = H·K
  short causal conv (kernel W) + SiLU on q|k|v, carried in ``kda_conv[layer]`` ``[slots, 3P, W-1]``
  q, k <- L2-normalised per head (fp32, eps inside the sqrt)
  g (log decay, fp32) ``[N, H, K]``:
      Kimi-Linear: ``-exp(A_log_h) · softplus(f + dt_bias)``,            f = W_fb W_fa x
      K3:          ``lower_bound · sigmoid(exp(A_log_h) · (f + dt_bias))``
  beta = sigmoid(W_b x) ``[N, H]``
  delta-rule recurrence (ops ``kda_chunk`` / ``kda_decode``), state ``kda_state[layer]`` ``[slots, H, K, V]``
  out = W_o · GatedRMSNorm(o, z); z = W_g x (K3, full rank) or W_gb W_ga x (Kimi-Linear)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3serve.core.config import TextConfig
from k3serve.core.context import ForwardContext
from k3serve.layers.norm import GatedRMSNorm
from k3serve.layers.weights import WeightSlot, a_log_slot, keep_fp32
from k3serve.ops import registry

L2_EPS = 1e-6


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return xf / torch.sqrt((xf * xf).sum(-1, keepdim=True) + L2_EPS)


def kda_gate(f: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor,
             lower_bound: float | None) -> torch.Tensor:
    """Log decay g ``[N, H, K]`` from the low-rank gate projection f ``[N, H, K]`` (fp32 math)."""
    H, K = f.shape[-2:]
    x = f.float() + dt_bias.float().view(H, K)
    rate = a_log.float().exp().view(H, 1)
    if lower_bound is None:
        return -rate * F.softplus(x, beta=1.0, threshold=20.0)
    return lower_bound * torch.sigmoid(rate * x)


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int, *, model_type: str = "kimi_linear"):
        super().__init__()
        la = cfg.linear_attn
        d, H, K, P, W = cfg.hidden_size, la.num_heads, la.head_dim, la.proj_size, la.conv_kernel_size
        self.layer_idx, self.num_heads, self.head_dim, self.conv_size = layer_idx, H, K, W
        self.lower_bound = la.gate_lower_bound
        self.full_rank_gate = la.use_full_rank_gate
        # K3 stores A_log as [head_dim] (first H live); Kimi-Linear as [1, 1, H, 1].
        self.a_log_layout = "k3" if model_type == "kimi_k3" else "kimi_linear"
        self.q_proj = nn.Linear(d, P, bias=False)
        self.k_proj = nn.Linear(d, P, bias=False)
        self.v_proj = nn.Linear(d, P, bias=False)
        self.q_conv1d = nn.Conv1d(P, P, W, groups=P, bias=False, dtype=torch.float32)
        self.k_conv1d = nn.Conv1d(P, P, W, groups=P, bias=False, dtype=torch.float32)
        self.v_conv1d = nn.Conv1d(P, P, W, groups=P, bias=False, dtype=torch.float32)
        self.f_a_proj = nn.Linear(d, K, bias=False)
        self.f_b_proj = nn.Linear(K, P, bias=False)
        self.dt_bias = keep_fp32(nn.Parameter(torch.zeros(P, dtype=torch.float32)))
        self.A_log = keep_fp32(nn.Parameter(torch.zeros(H, dtype=torch.float32)))
        for conv in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
            keep_fp32(conv.weight)
        self.b_proj = nn.Linear(d, H, bias=False)
        if self.full_rank_gate:
            self.g_proj = nn.Linear(d, P, bias=False)
        else:
            self.g_a_proj = nn.Linear(d, K, bias=False)
            self.g_b_proj = nn.Linear(K, P, bias=False)
        self.o_norm = GatedRMSNorm(K, cfg.rms_norm_eps)
        self.o_proj = nn.Linear(P, d, bias=False)

    def state_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
        """Per-slot cache shapes; ``None`` dtype means the model dtype."""
        H, K, P = self.num_heads, self.head_dim, self.num_heads * self.head_dim
        return {"kda_state": ((H, K, K), torch.float32), "kda_conv": ((3 * P, self.conv_size - 1), None)}

    def checkpoint_slots(self, prefix: str) -> list[WeightSlot]:
        # A_log is the only tensor whose stored shape differs from ours; the rest load by name.
        return [a_log_slot(prefix + "A_log", self.A_log, self.head_dim, self.a_log_layout)]

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        N, H, K = x.shape[0], self.num_heads, self.head_dim
        slots = ctx.state_slots
        fresh = ~ctx.has_initial_state

        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        conv_weight = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])[:, 0]
        any_fresh = not ctx.is_decode and bool(fresh.any())
        conv_cache = ctx.caches.kda_conv[self.layer_idx]
        # Each layer gathers its slots' states once, updates the gathered copy in place and writes it back once.
        conv_state = conv_cache.index_select(0, slots)
        if any_fresh:
            conv_state[fresh] = 0
        if ctx.is_decode:
            qkv, conv_state = registry.get("short_conv_update")(qkv.float(), conv_weight, conv_state,
                                                                out_state=conv_state)
        else:
            qkv, conv_state = registry.get("short_conv")(qkv.float(), conv_weight, conv_state=conv_state,
                                                         cu_seqlens=ctx.cu_seqlens)
        conv_cache.index_copy_(0, slots, conv_state.to(conv_cache.dtype))
        # q and k are normalised together (same per-head math, half the ops)
        qk = l2_normalize(qkv[:, : 2 * H * K].reshape(N, 2 * H, K))
        q, k, v = qk[:, :H], qk[:, H:], qkv[:, 2 * H * K:].float().reshape(N, H, K)

        g = kda_gate(self.f_b_proj(self.f_a_proj(x)).view(N, H, K), self.dt_bias, self.A_log, self.lower_bound)
        beta = torch.sigmoid(self.b_proj(x).float())

        state_cache = ctx.caches.kda_state[self.layer_idx]
        state = state_cache.index_select(0, slots)
        if any_fresh:
            state[fresh] = 0
        if ctx.is_decode:
            o, state = registry.get("kda_decode")(q, k, v, g, beta, state, out_state=state)
        else:
            o, state = registry.get("kda_chunk")(q[None], k[None], v[None], g[None], beta[None],
                                                 initial_state=state, cu_seqlens=ctx.cu_seqlens)
            o = o[0]
        state_cache.index_copy_(0, slots, state)

        z = self.g_proj(x) if self.full_rank_gate else self.g_b_proj(self.g_a_proj(x))
        o = self.o_norm(o, z.view(N, H, K)).to(x.dtype)
        return self.o_proj(o.reshape(N, H * K))
