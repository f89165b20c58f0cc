"""MoE: the noaux_tc router, routed experts (dense or packed MXFP4), shared experts, LatentMoE, dense MLP.

x ``[N, d]``:
  router (fp32): s = act(W_r x) ``[N, E]``; choose top-k of s + bias (bias for *selection* only, grouped
      top-k when num_expert_group > 1); w = s[idx], renormalised (sum + 1e-20), times routed_scaling_factor
  routed: ``Σ_k w_k · W2_e(glu(W1_e u, W3_e u))`` with u = x, or for LatentMoE u = W_down x ``[N, ℓ]`` and
      the sum passed through RMSNorm_ℓ then W_up
  out = routed + shared_experts(x)
Routed experts stay in their checkpoint form: ``[E, 2I, D]`` / ``[E, D, I]`` dense, or MXFP4 packed
(uint8 codes ``[E, rows, cols/2]`` + E8M0 scales ``[E, rows, cols/32]``), the hit experts dequantised per call.
In a static decode step (CUDA graphs) the routed experts take the gathered forms (``*_static`` ops): no counts
read back to the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3serve.core.config import TextConfig
from k3serve.core.context import in_static_decode
from k3serve.core.distributed import SINGLE, Parallel
from k3serve.layers.activation import make_glu
from k3serve.layers.norm import KimiRMSNorm
from k3serve.layers.weights import SwappedCache, WeightSlot, keep_fp32, param_slot
from k3serve.ops import registry

# Expert weights up to this size (each of w13, w2) also keep a swapped contiguous copy for the grouped
# combine's small-batch bmm (see ops/moe/grouped.py); larger models skip the extra copy.
SWAPPED_MAX_BYTES = 16 << 20


class GatedMLP(nn.Module):
    """Dense layer MLP and shared experts: ``W_down(glu(W_gate x, W_up x))``."""

    def __init__(self, d: int, inter: int, cfg: TextConfig):
        super().__init__()
        self.gate_proj = nn.Linear(d, inter, bias=False)
        self.up_proj = nn.Linear(d, inter, bias=False)
        self.down_proj = nn.Linear(inter, d, bias=False)
        self.glu = make_glu(cfg.hidden_act, cfg.situ_beta, cfg.situ_linear_beta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.glu(self.gate_proj(x), self.up_proj(x)))


def select_experts(logits: torch.Tensor, bias: torch.Tensor | None, *, top_k: int, activation: str,
                   num_groups: int, topk_groups: int, renormalize: bool,
                   scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 noaux_tc selection: logits ``[N, E]`` fp32 -> (weights ``[N, k]`` fp32, ids ``[N, k]``)."""
    scores = torch.sigmoid(logits) if activation == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores + bias if bias is not None else scores
    if num_groups > 1 and num_groups > topk_groups:
        N, E = choice.shape
        grouped = choice.view(N, num_groups, E // num_groups)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        keep = group_scores.topk(topk_groups, dim=-1, sorted=False).indices
        group_mask = torch.zeros(N, num_groups, dtype=torch.bool, device=choice.device).scatter_(1, keep, True)
        choice = grouped.masked_fill(~group_mask[..., None], float("-inf")).view(N, E)
    ids = choice.topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if renormalize and top_k > 1:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


class MoEGate(nn.Module):
    def __init__(self, d: int, cfg: TextConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, d))
        self.e_score_correction_bias = keep_fp32(nn.Parameter(torch.zeros(cfg.num_experts, dtype=torch.float32)))
        self.cfg = cfg

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        logits = F.linear(x.float(), self.weight.float())
        return select_experts(logits, self.e_score_correction_bias.float(), top_k=c.num_experts_per_token,
                              activation=c.moe_router_activation_func, num_groups=c.num_expert_group,
                              topk_groups=c.topk_group, renormalize=c.moe_renormalize,
                              scaling=c.routed_scaling_factor)


class RoutedExperts(nn.Module):
    """E experts at width D with intermediate I; checkpoint keys ``{e}.w1|w2|w3.weight[_packed|_scale]``."""

    slots_cover_all = True

    def __init__(self, cfg: TextConfig, mxfp4: bool, num_experts: int | None = None):
        super().__init__()
        # num_experts: how many expert slots this module holds (fewer than the config's under expert parallelism)
        E, D, I = num_experts or cfg.num_experts, cfg.expert_width, cfg.moe_intermediate_size
        self.num_experts, self.width, self.inter, self.mxfp4 = E, D, I, mxfp4
        self.glu = make_glu(cfg.hidden_act, cfg.situ_beta, cfg.situ_linear_beta)
        self.act_quant: str | None = None  # MXFP8 fake-quant of expert GEMM inputs ("rceil"/"floor")
        if mxfp4:
            if D % 32 or I % 32:
                raise ValueError(f"MXFP4 experts need widths divisible by 32, got {D} and {I}")
            u8 = dict(dtype=torch.uint8)
            self.register_buffer("w13_packed", torch.zeros(E, 2 * I, D // 2, **u8))
            self.register_buffer("w13_scale", torch.zeros(E, 2 * I, D // 32, **u8))
            self.register_buffer("w2_packed", torch.zeros(E, D, I // 2, **u8))
            self.register_buffer("w2_scale", torch.zeros(E, D, I // 32, **u8))
        else:
            self.w13 = nn.Parameter(torch.zeros(E, 2 * I, D))
            self.w2 = nn.Parameter(torch.zeros(E, D, I))
            self._w13_t, self._w2_t = SwappedCache(SWAPPED_MAX_BYTES), SwappedCache(SWAPPED_MAX_BYTES)

    def checkpoint_slots(self, prefix: str) -> list[WeightSlot]:
        return [s for e in range(self.num_experts) for s in self.expert_slots(e, f"{prefix}{e}.")]

    def expert_slots(self, e: int, p: str) -> list[WeightSlot]:
        """The checkpoint slots of the expert in slot ``e``, under key prefix ``p`` (``...experts.{id}.``)."""
        I = self.inter
        if self.mxfp4:
            slots = []
            for name, packed, scale in (("w1", self.w13_packed[e, :I], self.w13_scale[e, :I]),
                                        ("w3", self.w13_packed[e, I:], self.w13_scale[e, I:]),
                                        ("w2", self.w2_packed[e], self.w2_scale[e])):
                slots += [param_slot(p + name + ".weight_packed", packed),
                          param_slot(p + name + ".weight_scale", scale)]
            return slots
        return [param_slot(p + "w1.weight", self.w13[e, :I]), param_slot(p + "w3.weight", self.w13[e, I:]),
                param_slot(p + "w2.weight", self.w2[e])]

    def forward(self, u: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """u ``[N, D]``, weights/ids ``[N, k]`` -> ``Σ_k w·expert(u)`` ``[N, D]`` accumulated in fp32."""
        static = "_static" if in_static_decode() else ""
        if not self.mxfp4:
            if static:
                return registry.get("expert_combine_static")(u, weights, ids, self.w13, self.w2, self.glu)
            return registry.get("expert_combine")(u, weights, ids, self.w13, self.w2, self.glu,
                                                  w13_t=self._w13_t([self.w13]), w2_t=self._w2_t([self.w2]))
        # Packed experts stay packed; the op dequantises only the experts this batch hits, a bounded group at once.
        return registry.get("mxfp4_expert_combine" + static)(u, weights, ids, self.w13_packed, self.w13_scale, self.w2_packed,
                                                    self.w2_scale, self.glu, act_quant=self.act_quant)


def add_latent_projections(moe: nn.Module, cfg) -> None:
    """LatentMoE's down/up projections (hidden <-> latent width, replicated on every rank) and optional norm,
    under the checkpoint's names; ``moe.latent`` says whether the model has them."""
    moe.latent = cfg.routed_expert_hidden_size is not None
    if moe.latent:
        d, lat = cfg.hidden_size, cfg.routed_expert_hidden_size
        moe.routed_expert_down_proj = nn.Linear(d, lat, bias=False)
        moe.routed_expert_up_proj = nn.Linear(lat, d, bias=False)
        moe.routed_expert_norm = KimiRMSNorm(lat, cfg.rms_norm_eps) if cfg.latent_moe_use_norm else None


class SparseMoE(nn.Module):
    """Router + routed experts (optionally in a latent space) + shared experts."""

    def __init__(self, cfg: TextConfig, mxfp4: bool, par: Parallel = SINGLE):
        super().__init__()
        if par.ep > 1:
            raise ValueError("expert parallelism (ep > 1) is not wired yet: run the experts tensor-parallel (ep 1)")
        if par.sharded:
            raise ValueError("a sharded layout runs the MoE as layers.moe_tp.TensorParallelMoE")
        d = cfg.hidden_size
        self.gate = MoEGate(d, cfg)
        self.experts = RoutedExperts(cfg, mxfp4)
        add_latent_projections(self, cfg)
        self.shared_experts = (GatedMLP(d, cfg.moe_intermediate_size * cfg.num_shared_experts, cfg)
                               if cfg.num_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        if self.latent:
            y = self.experts(self.routed_expert_down_proj(x), weights, ids).to(x.dtype)
            if self.routed_expert_norm is not None:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        else:
            y = self.experts(x, weights, ids).to(x.dtype)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y
