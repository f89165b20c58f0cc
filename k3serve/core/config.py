"""Model configuration: frozen dataclasses parsed from a checkpoint's ``config.json``.

Two families share one schema:
  * ``kimi_k3``: multimodal; the text model sits under ``text_config`` (itself ``model_type: kimi_linear``)
    beside ``vision_config``; K3 adds the full-rank KDA gate with a lower bound, q-LoRA MLA with an output
    gate, Block AttnRes, LatentMoE and SiTU.
  * ``kimi_linear``: text only, flat.

Layer lists in ``linear_attn_config`` are 1-based in the file and 0-based here. Every inconsistency is a
``ConfigError`` naming the field, raised at construction.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KNOWN_MODEL_TYPES = ("kimi_k3", "kimi_linear")
HIDDEN_ACTS = ("silu", "situ")


class ConfigError(ValueError):
    """A config that is missing a field, has a bad value, or contradicts itself."""


def _require(cond: bool, field_name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"config field '{field_name}': {msg}")


@dataclass(frozen=True)
class LinearAttnConfig:
    """KDA layer geometry. ``kda_layers`` / ``full_attn_layers`` are 0-based here."""

    num_heads: int
    head_dim: int
    conv_kernel_size: int
    kda_layers: tuple[int, ...]
    full_attn_layers: tuple[int, ...]
    use_full_rank_gate: bool = False
    gate_lower_bound: float | None = None

    def __post_init__(self) -> None:
        _require(self.num_heads > 0, "linear_attn_config.num_heads", "must be positive")
        _require(self.head_dim > 0, "linear_attn_config.head_dim", "must be positive")
        _require(self.conv_kernel_size >= 1, "linear_attn_config.short_conv_kernel_size", "must be >= 1")
        if self.gate_lower_bound is not None:
            _require(self.gate_lower_bound < 0, "linear_attn_config.gate_lower_bound", "must be negative")

    @property
    def proj_size(self) -> int:
        return self.num_heads * self.head_dim


@dataclass(frozen=True)
class VisionConfig:
    """MoonViT tower + patch-merger projector (K3 flavour: RMSNorm, no biases)."""

    patch_size: int = 14
    hidden_size: int = 1024
    num_layers: int = 27
    num_heads: int = 12
    qkv_hidden_size: int = 1536
    intermediate_size: int = 4096
    pos_emb_height: int = 64
    pos_emb_width: int = 64
    pos_emb_time: int = 4
    merge_kernel_size: tuple[int, int] = (2, 2)
    text_hidden_size: int = 7168
    projector_ln_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        _require(self.qkv_hidden_size % self.num_heads == 0, "vision_config.qkv_hidden_size",
                 f"{self.qkv_hidden_size} is not divisible by vt_num_attention_heads={self.num_heads}")
        _require(self.head_dim % 4 == 0, "vision_config.qkv_hidden_size",
                 f"per-head dim {self.head_dim} must be divisible by 4 for 2-D RoPE")

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.num_heads

    @property
    def merged_dim(self) -> int:
        return self.hidden_size * self.merge_kernel_size[0] * self.merge_kernel_size[1]


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    linear_attn: LinearAttnConfig
    intermediate_size: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    num_experts: int
    num_experts_per_token: int
    moe_intermediate_size: int
    rms_norm_eps: float = 1e-5
    q_lora_rank: int | None = None
    mla_use_output_gate: bool = False
    num_shared_experts: int = 1
    routed_expert_hidden_size: int | None = None  # LatentMoE latent width; None = experts at full width
    latent_moe_use_norm: bool = False
    first_k_dense_replace: int = 1
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    hidden_act: str = "silu"
    situ_beta: float = 1.0
    situ_linear_beta: float | None = None
    attn_res_block_size: int | None = None  # Block AttnRes; None = plain pre-norm residual
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        _require(n > 0, "num_hidden_layers", "must be positive")
        kinds = [None] * n
        for name, layers in (("kda_layers", self.linear_attn.kda_layers),
                             ("full_attn_layers", self.linear_attn.full_attn_layers)):
            for i in layers:
                _require(0 <= i < n, f"linear_attn_config.{name}", f"layer {i + 1} outside 1..{n}")
                _require(kinds[i] is None, f"linear_attn_config.{name}", f"layer {i + 1} listed twice")
                kinds[i] = name
        missing = [i + 1 for i, k in enumerate(kinds) if k is None]
        _require(not missing, "linear_attn_config", f"layers {missing} are neither kda nor full attention")
        _require(self.hidden_act in HIDDEN_ACTS, "hidden_act", f"{self.hidden_act!r} not in {HIDDEN_ACTS}")
        _require(self.moe_router_activation_func in ("sigmoid", "softmax"), "moe_router_activation_func",
                 f"{self.moe_router_activation_func!r} not in ('sigmoid', 'softmax')")
        _require(0 < self.num_experts_per_token <= self.num_experts, "num_experts_per_token",
                 f"must be in 1..num_experts={self.num_experts}")
        _require(self.num_experts % self.num_expert_group == 0, "num_expert_group",
                 f"num_experts={self.num_experts} is not divisible by {self.num_expert_group}")
        _require(1 <= self.topk_group <= self.num_expert_group, "topk_group",
                 f"must be in 1..num_expert_group={self.num_expert_group}")
        if self.num_expert_group > 1:
            per_group = self.num_experts // self.num_expert_group
            _require(self.topk_group * per_group >= self.num_experts_per_token, "topk_group",
                     "the kept groups hold fewer experts than num_experts_per_token")
        _require(0 <= self.first_k_dense_replace <= n, "first_k_dense_replace", f"must be in 0..{n}")
        _require(self.hidden_size % 1 == 0 and self.hidden_size > 0, "hidden_size", "must be positive")
        _require(0 <= (self.bos_token_id or 0) < self.vocab_size, "bos_token_id", "outside the vocabulary")
        for e in self.eos_token_id:
            _require(0 <= e < self.vocab_size, "eos_token_id", f"{e} outside the vocabulary")
        if self.attn_res_block_size is not None:
            _require(self.attn_res_block_size > 0, "attn_res_block_size", "must be positive")
        if self.latent_moe_use_norm:
            _require(self.routed_expert_hidden_size is not None, "latent_moe_use_norm",
                     "needs routed_expert_hidden_size")

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Per layer ``"kda"`` or ``"mla"``."""
        mla = set(self.linear_attn.full_attn_layers)
        return tuple("mla" if i in mla else "kda" for i in range(self.num_hidden_layers))

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def expert_width(self) -> int:
        """Width the routed experts run at: the latent for LatentMoE, else hidden."""
        return self.routed_expert_hidden_size or self.hidden_size


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    text: TextConfig
    vision: VisionConfig | None = None
    experts_mxfp4: bool = False  # routed experts stored as compressed-tensors MXFP4
    media_placeholder_token_id: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        _require(self.model_type in KNOWN_MODEL_TYPES, "model_type",
                 f"unknown model_type {self.model_type!r}; supported: {', '.join(KNOWN_MODEL_TYPES)}")
        if self.media_placeholder_token_id is not None:
            _require(0 <= self.media_placeholder_token_id < self.text.vocab_size, "media_placeholder_token_id",
                     "outside the vocabulary")

    @property
    def text_prefix(self) -> str:
        """Prefix of text-model keys in the checkpoint."""
        return "language_model." if self.model_type == "kimi_k3" else ""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        from k3serve.core.config_parse import parse_model_config

        return parse_model_config(d)

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"no config.json at {path}")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(d)

    def replace_text(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, text=dataclasses.replace(self.text, **changes))
