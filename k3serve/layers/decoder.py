"""One decoder layer (KDA or MLA attention, dense MLP or MoE), with either residual scheme.

Plain pre-norm residual (Kimi-Linear):  h += attn(norm_in(h));  h += ffn(norm_post(h))
Block AttnRes (K3, block size S), for layer ℓ with depth state (blocks, partial):
  h = mix_attn(blocks, partial);  if ℓ % S == 0: snapshot partial into blocks and reset it
  partial += attn(norm_in(h));  h = mix_mlp(blocks, partial);  partial += ffn(norm_post(h))
The mixed h is never accumulated; only sublayer outputs are.
"""

from __future__ import annotations

import torch
from torch import nn

from k3serve.core.config import TextConfig
from k3serve.core.context import ForwardContext
from k3serve.core.distributed import SINGLE, Parallel
from k3serve.layers.attn_res import AttnResState, AttnResWeights
from k3serve.layers.kda import KimiDeltaAttention
from k3serve.layers.mla import MLAttention
from k3serve.layers.moe import GatedMLP, SparseMoE
from k3serve.layers.moe_ep import EPSparseMoE
from k3serve.layers.moe_tp import ParallelGatedMLP, TensorParallelMoE
from k3serve.layers.norm import KimiRMSNorm
from k3serve.ops import registry


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int, *, model_type: str, mxfp4_experts: bool,
                 par: Parallel = SINGLE):
        super().__init__()
        d = cfg.hidden_size
        self.layer_idx, self.eps = layer_idx, cfg.rms_norm_eps
        if cfg.layer_kinds[layer_idx] == "kda":
            self.self_attn = KimiDeltaAttention(cfg, layer_idx, model_type=model_type, par=par)
        else:
            self.self_attn = MLAttention(cfg, layer_idx, par)
        if cfg.is_moe_layer(layer_idx):
            # ep > 1: whole experts spread over the tp ranks; else each expert split by width over tp
            moe = EPSparseMoE if par.ep > 1 else TensorParallelMoE if par.sharded else SparseMoE
            self.block_sparse_moe = moe(cfg, mxfp4_experts, par)
        else:
            self.mlp = ParallelGatedMLP(d, cfg.intermediate_size, cfg, par) if par.sharded else \
                GatedMLP(d, cfg.intermediate_size, cfg)
        self.input_layernorm = KimiRMSNorm(d, cfg.rms_norm_eps)
        self.post_attention_layernorm = KimiRMSNorm(d, cfg.rms_norm_eps)
        self.block_size = cfg.attn_res_block_size
        if self.block_size is not None:
            self.self_attention_res_proj = nn.Linear(d, 1, bias=False)
            self.self_attention_res_norm = AttnResWeights(d)
            self.mlp_res_proj = nn.Linear(d, 1, bias=False)
            self.mlp_res_norm = AttnResWeights(d)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_sparse_moe(x) if hasattr(self, "block_sparse_moe") else self.mlp(x)

    def forward(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), ctx)
        return h + self.ffn(self.post_attention_layernorm(h))

    def forward_attn_res(self, state: AttnResState, ctx: ForwardContext) -> None:
        mix = registry.get("attn_res_mix")
        h = mix(state.blocks, state.partial, self.self_attention_res_proj.weight,
                self.self_attention_res_norm.weight, self.eps)
        if self.layer_idx % self.block_size == 0:
            state.snapshot()
        state.add(self.self_attn(self.input_layernorm(h), ctx))
        h = mix(state.blocks, state.partial, self.mlp_res_proj.weight, self.mlp_res_norm.weight, self.eps)
        state.add(self.ffn(self.post_attention_layernorm(h)))
