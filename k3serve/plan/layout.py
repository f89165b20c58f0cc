"""How a parallel layout splits weights, KV cache and KDA state over the GPUs of one replica.

A layout is ``tp x pp x dp`` GPUs: ``pp`` pipeline stages of contiguous layers; inside a stage, ``dp``
attention-data-parallel groups of ``tp`` tensor-parallel ranks; routed experts are expert-parallel over the
whole stage (``ep = tp * dp``). What each part costs per GPU:

  * routed experts: ``/ (pp * ep)`` -- every GPU holds a distinct slice of the experts;
  * attention (MLA, KDA), shared experts, dense MLP: sharded by heads / columns ``/ tp``, stage's layers
    only, replicated across attention-DP groups;
  * router, LatentMoE down/up projections, norms and AttnRes vectors: replicated on every rank of the stage
    (as AIConfigurator models them);
  * embedding (first stage) and lm_head (last stage): vocab-sharded over the whole stage (``tp * dp``, as
    SGLang's ``--enable-dp-lm-head``); the vision tower is replicated on the first stage;
  * MLA latent KV: **not** head-sharded -- every TP rank stores the full ``kv_lora + rope`` row for all
    sequences of its DP group, for its stage's MLA layers;
  * KDA state: head-sharded ``/ tp``, own sequences per DP group, stage's KDA layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from k3serve.core.config import ModelConfig
from k3serve.plan.model_math import (
    PRECISIONS, components, kda_state_bytes_per_layer, mla_kv_bytes_per_token,
)

SPLIT_RULES = {
    "routed_experts": "1/(pp*ep) per GPU",
    "attention (MLA, KDA)": "stage layers, 1/tp heads; replicated over attention-DP",
    "shared_experts, dense_mlp": "stage layers, 1/tp columns; replicated over attention-DP",
    "router, LatentMoE projections, norms": "stage layers, replicated on every rank",
    "embedding / lm_head": "first / last stage, 1/(tp*dp) vocab rows",
    "vision tower": "first stage, replicated",
    "MLA latent KV": "stage MLA layers, full row on every TP rank, own sequences per attention-DP group",
    "KDA state": "stage KDA layers, 1/tp heads, own sequences per attention-DP group",
}


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        if min(self.tp, self.pp, self.dp) < 1:
            raise ValueError(f"layout tp={self.tp} pp={self.pp} dp={self.dp}: sizes must be >= 1")

    @property
    def ep(self) -> int:
        return self.tp * self.dp

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def __str__(self) -> str:
        return f"tp{self.tp}pp{self.pp}dp{self.dp}ep{self.ep}"


def layout_problem(cfg: ModelConfig, lay: Layout) -> str | None:
    """Why the model cannot be split this way, or ``None``."""
    t = cfg.text
    if t.num_attention_heads % lay.tp or t.linear_attn.num_heads % lay.tp:
        return (f"tp={lay.tp} does not divide the attention heads (MLA {t.num_attention_heads}, "
                f"KDA {t.linear_attn.num_heads})")
    if t.num_experts % lay.ep:
        return f"ep={lay.ep} does not divide num_experts={t.num_experts}"
    if lay.pp > t.num_hidden_layers:
        return f"pp={lay.pp} exceeds num_hidden_layers={t.num_hidden_layers}"
    return None


def stage_bounds(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """Contiguous stages of near-equal layer counts; the extra layers go one each to the stages before the
    last, counting backwards, keeping the last (lm_head) stage light, as vLLM's ``get_pp_indices`` does."""
    sizes = [num_layers // pp] * pp
    for i in range(num_layers % pp):
        sizes[max(pp - 2 - i, 0) if pp > 1 else 0] += 1
    out, start = [], 0
    for s in sizes:
        out.append((start, start + s))
        start += s
    return out


@dataclass(frozen=True)
class StageMemory:
    """Per-GPU bytes on one pipeline stage (weights by part) and per-sequence cache bytes per GPU."""

    layers: tuple[int, int]
    experts: float
    attention: float
    shared_dense: float
    replicated: float
    embedding: float
    lm_head: float
    vision: float
    kv_bytes_per_token: float  # this stage's MLA layers, full latent row (replicated over tp)
    state_bytes_per_seq: float  # this stage's KDA layers, / tp

    @property
    def weights(self) -> float:
        return (self.experts + self.attention + self.shared_dense + self.replicated + self.embedding + self.lm_head
                + self.vision)


def stage_memory(cfg: ModelConfig, lay: Layout, precision: str = "mxfp4", kv_dtype_bytes: float = 2,
                 state_dtype_bytes: int = 4) -> list[StageMemory]:
    t = cfg.text
    prec = PRECISIONS[precision]
    comps = components(cfg)
    each = {c.name: c.bytes_each(prec) for c in comps}
    vision = sum(c.bytes(prec) for c in comps if c.name.startswith("vision"))
    kinds = t.layer_kinds
    kv_per_mla_layer = mla_kv_bytes_per_token(t, kv_dtype_bytes) / max(kinds.count("mla"), 1)
    state_per_kda_layer = kda_state_bytes_per_layer(t, state_dtype_bytes)
    bounds = stage_bounds(t.num_hidden_layers, lay.pp)
    out = []
    for s, (a, b) in enumerate(bounds):
        idx = range(a, b)
        n_mla = sum(kinds[i] == "mla" for i in idx)
        n_kda = (b - a) - n_mla
        n_moe = sum(t.is_moe_layer(i) for i in idx)
        first, last = s == 0, s == len(bounds) - 1
        head = each["lm_head"] if last else 0
        if last and not first and t.tie_word_embeddings:
            head = each["embed_tokens"]  # a tied head on another stage than the embedding needs its own copy
        out.append(StageMemory(
            layers=(a, b),
            experts=n_moe * t.num_experts * each["routed_experts"] / lay.ep,
            attention=(n_mla * each["mla"] + n_kda * each["kda"]) / lay.tp,
            shared_dense=(n_moe * each["shared_experts"] + ((b - a) - n_moe) * each["dense_mlp"]) / lay.tp,
            replicated=n_moe * each["moe_fixed"] + (b - a) * each["layer_norms"]
            + (each["final_norms"] if last else 0),
            embedding=(each["embed_tokens"] if first else 0) / lay.ep,
            lm_head=head / lay.ep,
            vision=vision if first else 0,
            kv_bytes_per_token=n_mla * kv_per_mla_layer,
            state_bytes_per_seq=n_kda * state_per_kda_layer / lay.tp,
        ))
    return out


# AIConfigurator's activation factor c(TP) for 2 * tokens * (heads * head_dim) * c (base_backend.py)
_ACT_FACTOR = {1: 10, 2: 6, 4: 5}


def activation_bytes(cfg: ModelConfig, lay: Layout, max_batched_tokens: int) -> float:
    """Peak transient memory of one forward over ``max_batched_tokens`` tokens on one rank: attention
    activations (AIConfigurator's rule), the MoE dispatch workspace of the tokens landing on this rank's
    experts (input, gate/up and SiTU output in BF16), and the Block AttnRes buffer of completed blocks."""
    t = cfg.text
    width = max(t.num_attention_heads * t.v_head_dim, t.linear_attn.proj_size)
    # full (unsharded) width: conservative, the rule's c(TP) already shrinks with TP
    attn = 2 * max_batched_tokens * width * _ACT_FACTOR.get(lay.tp, 5)
    routed = max_batched_tokens * lay.dp * t.num_experts_per_token / lay.ep
    moe = routed * (t.expert_width + 3 * t.moe_intermediate_size) * 2
    attn_res = 0.0
    if t.attn_res_block_size:
        blocks = math.ceil(t.num_hidden_layers / t.attn_res_block_size) + 1
        attn_res = max_batched_tokens * blocks * t.hidden_size * 2
    return attn + moe + attn_res
