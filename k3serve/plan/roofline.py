"""Roofline estimates of decode and prefill for one replica (planner_ep_sandbox.md §3.7).

Per pipeline stage and micro-batch, a GPU's time is ``max(bytes / (HBM_BW * BW_EFF), FLOPs / (peak * MFU))``.
These are upper bounds on throughput: collective latency (two all-reduces per layer under TP, dispatch +
combine per MoE layer under EP) and kernel launch gaps are not modelled, and they dominate at small batch
(8x B300 TP8 at batch 1 measures ~14 ms/step against a ~4 ms roofline).

Decode: ``B`` sequences, each ``context`` tokens deep, are split over ``dp`` attention groups and up to
``pp`` micro-batches (a full pipeline once ``B >= dp * pp``). Per step a GPU reads its non-expert
weights, the distinct routed experts its micro-batch touches (``E * (1 - (1 - k/E)^T)`` per layer for ``T``
tokens in the EP group, spread evenly over ``ep`` ranks), its sequences' full latent KV and 2x their KDA
state (read + write). Time per output token is ``pp`` stage times.

Prefill: one prompt of ``context`` tokens, compute-bound: ``2 * active`` FLOPs per token for the linear
layers plus causal MLA attention (``context^2 / 2`` query-key pairs), spread over all GPUs of the replica
(a full pipeline: with ``pp > 1`` a lone prompt shorter than ``pp`` chunks leaves stages idle).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from k3serve.core.config import ModelConfig
from k3serve.plan.gpus import GPU
from k3serve.plan.layout import Layout, StageMemory
from k3serve.plan.model_math import (
    ParamSummary, kda_flops_per_token, mla_decode_flops_per_context_token, mla_prefill_flops_per_token_pair,
)

BW_EFF = 0.8  # AIConfigurator's empirical HBM derate (mem_bw_empirical_scaling_factor)
MFU = 0.5  # compute efficiency assumed for large GEMMs (planner_ep_sandbox.md §3.7 prefill example)


def expert_flops_peak(gpu: GPU) -> float:
    """MXFP4 experts run W4A8 (FP8 tensor cores) on Blackwell, weight-only W4A16 (BF16) on Hopper."""
    return gpu.fp8_flops if gpu.has_fp4 else gpu.bf16_flops


def distinct_experts(num_experts: int, top_k: int, tokens: float) -> float:
    """Expected distinct experts hit by ``tokens`` uniform top-k draws (routing skew only lowers it)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


@dataclass(frozen=True)
class DecodeEstimate:
    concurrency: int
    context: int
    step_ms: float  # time per output token (TPOT)
    tokens_per_s: float  # replica output tokens/s
    tokens_per_s_per_gpu: float
    bound: str  # "memory" or "compute" on the slowest stage


@dataclass(frozen=True)
class PrefillEstimate:
    prompt_tokens: int
    seconds: float
    tokens_per_s: float
    attention_share: float  # fraction of FLOPs in MLA attention


def decode(cfg: ModelConfig, params: ParamSummary, gpu: GPU, lay: Layout, stages: list[StageMemory],
           expert_bytes_each: int, concurrency: int, context: int) -> DecodeEstimate:
    t = cfg.text
    kinds = t.layer_kinds
    micro = min(lay.pp, max(1, math.ceil(concurrency / lay.dp)))  # micro-batches in flight
    per_rank = concurrency / (lay.dp * micro)  # sequences per rank per micro-batch
    tokens_ep = per_rank * lay.dp
    experts_hit = distinct_experts(t.num_experts, t.num_experts_per_token, tokens_ep)
    n_moe_total = max(1, sum(t.is_moe_layer(i) for i in range(t.num_hidden_layers)))
    mla_flops = mla_decode_flops_per_context_token(t) / max(1, kinds.count("mla"))
    kda_flops = kda_flops_per_token(t) / max(1, kinds.count("kda"))
    dense_active = params.active - params.active_expert_params
    worst, bound = 0.0, "memory"
    for st in stages:
        a, b = st.layers
        n_mla = sum(kinds[i] == "mla" for i in range(a, b))
        n_moe = sum(t.is_moe_layer(i) for i in range(a, b))
        # decode reads embedding rows only and never the vision tower
        touched = n_moe * experts_hit * expert_bytes_each / lay.ep
        weight_bytes = st.weights - st.experts - st.embedding - st.vision + touched
        cache_bytes = per_rank * (context * st.kv_bytes_per_token + 2 * st.state_bytes_per_seq)
        mem_s = (weight_bytes + cache_bytes) / (gpu.hbm_bandwidth * BW_EFF)
        attn_flops = per_rank * (context * n_mla * mla_flops + (b - a - n_mla) * kda_flops) / lay.tp
        dense_flops = tokens_ep * 2 * dense_active * (b - a) / t.num_hidden_layers / lay.ep
        moe_flops = tokens_ep * 2 * params.active_expert_params * n_moe / n_moe_total / lay.ep
        comp_s = (attn_flops + dense_flops) / (gpu.bf16_flops * MFU) + moe_flops / (expert_flops_peak(gpu) * MFU)
        if max(mem_s, comp_s) > worst:
            worst, bound = max(mem_s, comp_s), "memory" if mem_s >= comp_s else "compute"
    step = worst * lay.pp
    tps = concurrency / step
    return DecodeEstimate(concurrency, context, step * 1e3, tps, tps / lay.gpus, bound)


def prefill(cfg: ModelConfig, params: ParamSummary, gpu: GPU, lay: Layout, prompt_tokens: int) -> PrefillEstimate:
    t = cfg.text
    moe = 2 * params.active_expert_params * prompt_tokens
    dense = (2 * (params.active - params.active_expert_params) + kda_flops_per_token(t)) * prompt_tokens
    attn = mla_prefill_flops_per_token_pair(t) * prompt_tokens * (prompt_tokens + 1) / 2
    seconds = ((dense + attn) / gpu.bf16_flops + moe / expert_flops_peak(gpu)) / (MFU * lay.gpus)
    return PrefillEstimate(prompt_tokens, seconds, prompt_tokens / seconds, attn / (dense + attn + moe))
