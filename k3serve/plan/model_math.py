"""Analytic parameter, weight-byte and cache-size model of a ``ModelConfig``.

The parameter inventory follows the checkpoint tensor list (design/model.md §8) one tensor family at a time,
so it is generic in the config: K3, Kimi-Linear-48B and the tiny test configs all go through the same code.
Parameters are what the ``nn.Module`` allocates; the one place this differs from the K3 checkpoint is
``A_log``, which the module holds as ``[num_heads]`` while the K3 file stores ``[head_dim]`` with only the
first ``num_heads`` live (96 vs 128 values per KDA layer; 2,208 values in all, immaterial for bytes).

Storage classes per tensor:
  * ``expert``: routed-expert w1/w2/w3, the only tensors the quantization schemes change.
  * ``f32``: the small tensors K3 keeps in F32 in every scheme (A_log, dt_bias, the short-conv weights,
    KDA o_norm, e_score_correction_bias); ~10M values for K3, counted at 4 bytes.
  * ``bf16``: everything else, 2 bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from k3serve.core.config import ModelConfig, TextConfig, VisionConfig

Storage = Literal["expert", "bf16", "f32"]
MX_BLOCK = 32  # OCP MX block: one E8M0 scale byte per 32 elements along the input dimension


@dataclass(frozen=True)
class TensorSpec:
    """One parameter tensor of one module instance, e.g. a KDA layer's ``q_proj.weight``."""

    name: str
    shape: tuple[int, ...]
    storage: Storage = "bf16"

    def __post_init__(self) -> None:
        if not self.shape or any(s <= 0 for s in self.shape):
            raise ValueError(f"tensor {self.name}: shape {self.shape} must be non-empty and positive")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Precision:
    """A weight storage scheme: how routed experts are stored; non-expert tensors stay BF16 / F32."""

    name: str
    expert_elem_bits: int
    expert_block_scaled: bool  # MX: one uint8 scale per 32 input elements

    def expert_bytes(self, t: TensorSpec) -> int:
        rows, cols = math.prod(t.shape[:-1]), t.shape[-1]
        packed = math.ceil(cols * self.expert_elem_bits / 8)
        scales = math.ceil(cols / MX_BLOCK) if self.expert_block_scaled else 0
        return rows * (packed + scales)

    def tensor_bytes(self, t: TensorSpec) -> int:
        if t.storage == "expert":
            return self.expert_bytes(t)
        return t.numel * (4 if t.storage == "f32" else 2)


PRECISIONS: dict[str, Precision] = {
    "mxfp4": Precision("mxfp4", 4, True),  # 4.25 bits/param: the published K3 checkpoint
    "mxfp8": Precision("mxfp8", 8, True),  # 8.25 bits/param
    "bf16": Precision("bf16", 16, False),
}


@dataclass(frozen=True)
class Component:
    """A family of identical module instances: ``count`` in the model, ``active`` of them used per token."""

    name: str
    tensors: tuple[TensorSpec, ...]
    count: int
    active: int

    def __post_init__(self) -> None:
        if not 0 <= self.active <= self.count:
            raise ValueError(f"component {self.name}: active {self.active} outside 0..{self.count}")

    @property
    def params_each(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def params(self) -> int:
        return self.params_each * self.count

    @property
    def active_params(self) -> int:
        return self.params_each * self.active

    def bytes_each(self, precision: Precision) -> int:
        return sum(precision.tensor_bytes(t) for t in self.tensors)

    def bytes(self, precision: Precision) -> int:
        return self.bytes_each(precision) * self.count


def mla_layer(t: TextConfig) -> tuple[TensorSpec, ...]:
    d, n = t.hidden_size, t.num_attention_heads
    if t.q_lora_rank:
        q = (TensorSpec("q_a_proj", (t.q_lora_rank, d)), TensorSpec("q_a_layernorm", (t.q_lora_rank,)),
             TensorSpec("q_b_proj", (n * t.qk_head_dim, t.q_lora_rank)))
    else:
        q = (TensorSpec("q_proj", (n * t.qk_head_dim, d)),)
    kv = (TensorSpec("kv_a_proj_with_mqa", (t.kv_lora_rank + t.qk_rope_head_dim, d)),
          TensorSpec("kv_a_layernorm", (t.kv_lora_rank,)),
          TensorSpec("kv_b_proj", (n * (t.qk_nope_head_dim + t.v_head_dim), t.kv_lora_rank)),
          TensorSpec("o_proj", (d, n * t.v_head_dim)))
    gate = (TensorSpec("g_proj", (n * t.v_head_dim, d)),) if t.mla_use_output_gate else ()
    return q + kv + gate


def kda_layer(t: TextConfig) -> tuple[TensorSpec, ...]:
    la, d = t.linear_attn, t.hidden_size
    h, k, p, w = la.num_heads, la.head_dim, la.proj_size, la.conv_kernel_size
    specs = [TensorSpec(f"{x}_proj", (p, d)) for x in "qkv"]
    specs += [TensorSpec(f"{x}_conv1d", (p, 1, w), "f32") for x in "qkv"]
    specs += [TensorSpec("f_a_proj", (k, d)), TensorSpec("f_b_proj", (p, k)),
              TensorSpec("dt_bias", (p,), "f32"), TensorSpec("A_log", (h,), "f32"),
              TensorSpec("b_proj", (h, d))]
    if la.use_full_rank_gate:
        specs.append(TensorSpec("g_proj", (p, d)))
    else:
        specs += [TensorSpec("g_a_proj", (k, d)), TensorSpec("g_b_proj", (p, k))]
    specs += [TensorSpec("o_norm", (k,), "f32"), TensorSpec("o_proj", (d, p))]
    return tuple(specs)


def _mlp(prefix: str, d: int, inter: int) -> tuple[TensorSpec, ...]:
    return (TensorSpec(f"{prefix}gate_proj", (inter, d)), TensorSpec(f"{prefix}up_proj", (inter, d)),
            TensorSpec(f"{prefix}down_proj", (d, inter)))


def routed_expert(t: TextConfig) -> tuple[TensorSpec, ...]:
    w, i = t.expert_width, t.moe_intermediate_size
    return (TensorSpec("w1", (i, w), "expert"), TensorSpec("w3", (i, w), "expert"),
            TensorSpec("w2", (w, i), "expert"))


def moe_fixed(t: TextConfig) -> tuple[TensorSpec, ...]:
    """Per-MoE-layer tensors besides experts and shared experts: router, its bias, LatentMoE projections."""
    d, e = t.hidden_size, t.num_experts
    specs = [TensorSpec("gate", (e, d)), TensorSpec("e_score_correction_bias", (e,), "f32")]
    if t.routed_expert_hidden_size is not None:
        lat = t.routed_expert_hidden_size
        specs += [TensorSpec("routed_expert_down_proj", (lat, d)), TensorSpec("routed_expert_up_proj", (d, lat))]
        if t.latent_moe_use_norm:
            specs.append(TensorSpec("routed_expert_norm", (lat,)))
    return tuple(specs)


def shared_experts(t: TextConfig) -> tuple[TensorSpec, ...]:
    return _mlp("shared_experts.", t.hidden_size, t.moe_intermediate_size * t.num_shared_experts)


def layer_norms(t: TextConfig) -> tuple[TensorSpec, ...]:
    d = t.hidden_size
    specs = [TensorSpec("input_layernorm", (d,)), TensorSpec("post_attention_layernorm", (d,))]
    if t.attn_res_block_size is not None:
        specs += [TensorSpec(f"{m}_res_{x}", shape) for m in ("self_attention", "mlp")
                  for x, shape in (("norm", (d,)), ("proj", (1, d)))]
    return tuple(specs)


def final_norms(t: TextConfig) -> tuple[TensorSpec, ...]:
    d = t.hidden_size
    specs = [TensorSpec("norm", (d,))]
    if t.attn_res_block_size is not None:
        specs += [TensorSpec("output_attn_res_norm", (d,)), TensorSpec("output_attn_res_proj", (1, d))]
    return tuple(specs)


def vision_block(v: VisionConfig) -> tuple[TensorSpec, ...]:
    d, q = v.hidden_size, v.qkv_hidden_size
    return (TensorSpec("norm0", (d,)), TensorSpec("norm1", (d,)), TensorSpec("wqkv", (3 * q, d)),
            TensorSpec("wo", (d, q)), TensorSpec("mlp.fc0", (v.intermediate_size, d)),
            TensorSpec("mlp.fc1", (d, v.intermediate_size)))


def vision_rest(v: VisionConfig) -> tuple[TensorSpec, ...]:
    """Patch embedding, learned position grid, final norm and the patchmergerv2 projector."""
    d, m = v.hidden_size, v.merged_dim
    return (TensorSpec("patch_embed.proj", (d, 3, v.patch_size, v.patch_size)),
            TensorSpec("patch_embed.pos_emb", (v.pos_emb_height, v.pos_emb_width, d)),
            TensorSpec("encoder.final_layernorm", (d,)),
            TensorSpec("mm_projector.proj.0", (m, m)),
            TensorSpec("mm_projector.proj.2", (v.text_hidden_size, m)),
            TensorSpec("mm_projector.post_norm", (v.text_hidden_size,)))


def components(cfg: ModelConfig) -> tuple[Component, ...]:
    """Every parameter of the model, grouped; ``active`` counts instances used by one text token."""
    t = cfg.text
    kinds = t.layer_kinds
    n_mla, n_kda = kinds.count("mla"), kinds.count("kda")
    n_moe = sum(t.is_moe_layer(i) for i in range(t.num_hidden_layers))
    n_dense = t.num_hidden_layers - n_moe
    vocab = (TensorSpec("embed_tokens", (t.vocab_size, t.hidden_size)),)
    out = [
        Component("mla", mla_layer(t), n_mla, n_mla),
        Component("kda", kda_layer(t), n_kda, n_kda),
        Component("routed_experts", routed_expert(t), n_moe * t.num_experts, n_moe * t.num_experts_per_token),
        Component("moe_fixed", moe_fixed(t), n_moe, n_moe),
        Component("shared_experts", shared_experts(t), n_moe, n_moe),
        Component("dense_mlp", _mlp("mlp.", t.hidden_size, t.intermediate_size), n_dense, n_dense),
        Component("layer_norms", layer_norms(t), t.num_hidden_layers, t.num_hidden_layers),
        Component("final_norms", final_norms(t), 1, 1),
        # a token's input embedding is a row lookup, not a matmul: it is not counted as active
        Component("embed_tokens", vocab, 1, 0),
    ]
    # tied weights own no tensor; either way ParamSummary counts the lm_head matmul as active
    head = () if t.tie_word_embeddings else (TensorSpec("lm_head", (t.vocab_size, t.hidden_size)),)
    out.append(Component("lm_head", head, 1, 0))
    if cfg.vision is not None:
        out.append(Component("vision_blocks", vision_block(cfg.vision), cfg.vision.num_layers, 0))
        out.append(Component("vision_rest", vision_rest(cfg.vision), 1, 0))
    return tuple(out)


@dataclass(frozen=True)
class ParamSummary:
    """Totals over ``components``: parameters, active parameters per text token, bytes per precision."""

    by_component: dict[str, int]
    total: int
    active: int
    active_with_embedding: int
    weight_bytes: dict[str, int]
    expert_params: int
    active_expert_params: int  # routed-expert parameters one token uses, all MoE layers together

    @classmethod
    def of(cls, cfg: ModelConfig) -> ParamSummary:
        comps = components(cfg)
        by = {c.name: c.params for c in comps}
        t = cfg.text
        head = t.vocab_size * t.hidden_size  # the lm_head matmul, whether or not its weight is tied
        active = sum(c.active_params for c in comps) + head
        return cls(
            by_component=by,
            total=sum(by.values()),
            active=active,
            active_with_embedding=active + head,
            weight_bytes={name: sum(c.bytes(p) for c in comps) for name, p in PRECISIONS.items()},
            expert_params=by["routed_experts"],
            active_expert_params=next(c.active_params for c in comps if c.name == "routed_experts"),
        )


def mla_kv_bytes_per_token(t: TextConfig, dtype_bytes: float = 2) -> float:
    """Compressed MLA cache: ``kv_lora_rank + qk_rope_head_dim`` values per token per MLA layer."""
    return t.layer_kinds.count("mla") * (t.kv_lora_rank + t.qk_rope_head_dim) * dtype_bytes


def kda_state_bytes_per_layer(t: TextConfig, state_bytes: int = 4, conv_bytes: int = 2) -> int:
    """One sequence, one KDA layer: recurrent ``[h, K, V]`` state + q/k/v conv windows ``3 x [P, W-1]``."""
    la = t.linear_attn
    recurrent = la.num_heads * la.head_dim * la.head_dim * state_bytes
    conv = 3 * la.proj_size * (la.conv_kernel_size - 1) * conv_bytes
    return recurrent + conv


def kda_state_bytes_per_sequence(t: TextConfig, state_bytes: int = 4, conv_bytes: int = 2) -> int:
    return t.layer_kinds.count("kda") * kda_state_bytes_per_layer(t, state_bytes, conv_bytes)


def kda_flops_per_token(t: TextConfig) -> int:
    """Decode recurrence per token (decay, Sᵀk, rank-1 update, Sᵀq: ~4 passes of 2·K·V per head)."""
    la = t.linear_attn
    return t.layer_kinds.count("kda") * la.num_heads * 8 * la.head_dim * la.head_dim


def mla_decode_flops_per_context_token(t: TextConfig) -> int:
    """Absorbed MLA decode: scores over the 576-wide row plus the 512-wide value sum, per head per layer."""
    width = t.kv_lora_rank + t.qk_rope_head_dim
    return t.layer_kinds.count("mla") * t.num_attention_heads * 2 * (width + t.kv_lora_rank)


def mla_prefill_flops_per_token_pair(t: TextConfig) -> int:
    """Non-absorbed MLA prefill: QKᵀ over ``qk_head_dim`` and PV over ``v_head_dim``, per (query, key)."""
    return t.layer_kinds.count("mla") * t.num_attention_heads * 2 * (t.qk_head_dim + t.v_head_dim)
