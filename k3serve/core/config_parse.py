"""``config.json`` <-> ``ModelConfig``.

Accepts the published spellings of both families, including the aliases transformers writes
(``num_local_experts``, ``num_experts_per_tok``, ``n_shared_experts``, ``n_group``, ``norm_topk_prob``,
``model_max_length``, ``mlp_layer_types``). Layer kinds always come from ``linear_attn_config`` when it is
present (the transformers default formula for ``layer_types`` disagrees with real checkpoints).
"""

from __future__ import annotations

from typing import Any

from k3serve.core.config import ConfigError, LinearAttnConfig, ModelConfig, TextConfig, VisionConfig

_ALIASES = {
    "num_local_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
    "n_group": "num_expert_group",
    "norm_topk_prob": "moe_renormalize",
    "model_max_length": "max_position_embeddings",
}


def _get(d: dict[str, Any], key: str, default: Any = ..., *, where: str = "") -> Any:
    if key in d and d[key] is not None:
        return d[key]
    for alias, canonical in _ALIASES.items():
        if canonical == key and d.get(alias) is not None:
            return d[alias]
    if default is ...:
        raise ConfigError(f"config field '{where}{key}' is missing")
    return default


def _int_list(v: Any, name: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise ConfigError(f"config field '{name}' must be a list of integers, got {v!r}")
    return v


def _linear_attn(t: dict[str, Any], n_layers: int, where: str) -> LinearAttnConfig:
    la = t.get("linear_attn_config") or {}
    if "kda_layers" in la or "full_attn_layers" in la:
        kda = [i - 1 for i in _int_list(la.get("kda_layers", []), f"{where}linear_attn_config.kda_layers")]
        full = [i - 1 for i in _int_list(la.get("full_attn_layers", []),
                                         f"{where}linear_attn_config.full_attn_layers")]
    elif t.get("layer_types"):
        types = t["layer_types"]
        if len(types) != n_layers:
            raise ConfigError(f"config field '{where}layer_types' has {len(types)} entries, "
                              f"num_hidden_layers is {n_layers}")
        bad = sorted({x for x in types if x not in ("linear_attention", "full_attention")})
        if bad:
            raise ConfigError(f"config field '{where}layer_types' has unknown kinds {bad}")
        kda = [i for i, x in enumerate(types) if x == "linear_attention"]
        full = [i for i, x in enumerate(types) if x == "full_attention"]
    else:
        raise ConfigError(f"config field '{where}linear_attn_config' is missing (needs kda_layers and "
                          "full_attn_layers)")
    return LinearAttnConfig(
        num_heads=int(_get(la, "num_heads", t.get("linear_num_heads", ...), where=f"{where}linear_attn_config.")),
        head_dim=int(_get(la, "head_dim", t.get("linear_head_dim", ...), where=f"{where}linear_attn_config.")),
        conv_kernel_size=int(la.get("short_conv_kernel_size", t.get("linear_conv_kernel_dim", 4))),
        kda_layers=tuple(kda),
        full_attn_layers=tuple(full),
        use_full_rank_gate=bool(la.get("use_full_rank_gate", False)),
        gate_lower_bound=la.get("gate_lower_bound"),
    )


def _first_dense(t: dict[str, Any], where: str) -> int:
    if "first_k_dense_replace" in t:
        return int(t["first_k_dense_replace"])
    types = t.get("mlp_layer_types")
    if types:
        k = 0
        while k < len(types) and types[k] == "dense":
            k += 1
        if any(x != "sparse" for x in types[k:]):
            raise ConfigError(f"config field '{where}mlp_layer_types': dense layers must come first")
        return k
    return 1


def _eos(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    return tuple(v) if isinstance(v, list) else (int(v),)


def parse_text_config(t: dict[str, Any], where: str = "") -> TextConfig:
    if t.get("mla_use_nope") is False:
        raise ConfigError(f"config field '{where}mla_use_nope' is false: only NoPE MLA is supported "
                          "(Kimi checkpoints never rotate the rope slice)")
    act = t.get("hidden_act", "silu")
    n_layers = int(_get(t, "num_hidden_layers", where=where))
    try:
        return TextConfig(
            vocab_size=int(_get(t, "vocab_size", where=where)),
            hidden_size=int(_get(t, "hidden_size", where=where)),
            num_hidden_layers=n_layers,
            linear_attn=_linear_attn(t, n_layers, where),
            intermediate_size=int(_get(t, "intermediate_size", where=where)),
            num_attention_heads=int(_get(t, "num_attention_heads", where=where)),
            kv_lora_rank=int(_get(t, "kv_lora_rank", where=where)),
            qk_nope_head_dim=int(_get(t, "qk_nope_head_dim", where=where)),
            qk_rope_head_dim=int(_get(t, "qk_rope_head_dim", where=where)),
            v_head_dim=int(_get(t, "v_head_dim", where=where)),
            num_experts=int(_get(t, "num_experts", where=where)),
            num_experts_per_token=int(_get(t, "num_experts_per_token", where=where)),
            moe_intermediate_size=int(_get(t, "moe_intermediate_size", where=where)),
            rms_norm_eps=float(_get(t, "rms_norm_eps", 1e-5)),
            q_lora_rank=t.get("q_lora_rank"),
            mla_use_output_gate=bool(t.get("mla_use_output_gate", False)),
            num_shared_experts=int(_get(t, "num_shared_experts", 1)),
            routed_expert_hidden_size=t.get("routed_expert_hidden_size"),
            latent_moe_use_norm=bool(t.get("latent_moe_use_norm", False)),
            first_k_dense_replace=_first_dense(t, where),
            moe_router_activation_func=t.get("moe_router_activation_func", "sigmoid"),
            moe_renormalize=bool(_get(t, "moe_renormalize", True)),
            num_expert_group=int(_get(t, "num_expert_group", 1)),
            topk_group=int(_get(t, "topk_group", 1)),
            routed_scaling_factor=float(_get(t, "routed_scaling_factor", 1.0)),
            hidden_act=act,
            situ_beta=float(t.get("activation_situ_beta") or 1.0),
            situ_linear_beta=t.get("activation_situ_linear_beta"),
            attn_res_block_size=t.get("attn_res_block_size"),
            max_position_embeddings=int(_get(t, "max_position_embeddings", 1048576)),
            tie_word_embeddings=bool(t.get("tie_word_embeddings", False)),
            bos_token_id=t.get("bos_token_id"),
            eos_token_id=_eos(t.get("eos_token_id")),
            pad_token_id=t.get("pad_token_id"),
        )
    except ConfigError as e:
        if where and "config field '" in str(e) and where not in str(e):
            raise ConfigError(str(e).replace("config field '", f"config field '{where}", 1)) from None
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config '{where or 'text'}': {e}") from None


def parse_vision_config(v: dict[str, Any]) -> VisionConfig:
    mk = v.get("merge_kernel_size", [2, 2])
    return VisionConfig(
        patch_size=int(v.get("patch_size", 14)),
        hidden_size=int(v.get("vt_hidden_size", v.get("hidden_size", 1024))),
        num_layers=int(v.get("vt_num_hidden_layers", 27)),
        num_heads=int(v.get("vt_num_attention_heads", 12)),
        qkv_hidden_size=int(v.get("qkv_hidden_size", v.get("vt_hidden_size", 1024))),
        intermediate_size=int(v.get("vt_intermediate_size", 4096)),
        pos_emb_height=int(v.get("init_pos_emb_height", 64)),
        pos_emb_width=int(v.get("init_pos_emb_width", 64)),
        pos_emb_time=int(v.get("init_pos_emb_time", 4)),
        merge_kernel_size=(int(mk[0]), int(mk[1])),
        text_hidden_size=int(v.get("text_hidden_size", 7168)),
        projector_ln_eps=float(v.get("projector_ln_eps", 1e-5)),
    )


def _is_mxfp4(q: dict[str, Any] | None) -> bool:
    if not q:
        return False
    if q.get("quant_method") != "compressed-tensors":
        raise ConfigError(f"config field 'quantization_config.quant_method': {q.get('quant_method')!r} is not "
                          "supported (only compressed-tensors MXFP4 experts)")
    fmt = q.get("format")
    if fmt != "mxfp4-pack-quantized":
        raise ConfigError(f"config field 'quantization_config.format': {fmt!r} is not supported "
                          "(expected 'mxfp4-pack-quantized')")
    return True


def parse_model_config(d: dict[str, Any]) -> ModelConfig:
    if not isinstance(d, dict):
        raise ConfigError("config.json must hold a JSON object")
    model_type = d.get("model_type")
    if model_type == "kimi_k3":
        t = d.get("text_config")
        if not isinstance(t, dict):
            raise ConfigError("config field 'text_config' is missing (kimi_k3 keeps the text model there)")
        text = parse_text_config({**{k: d[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in d},
                                  **t}, "text_config.")
        vision = parse_vision_config(d["vision_config"]) if d.get("vision_config") else None
        quant = d.get("quantization_config") or t.get("quantization_config")
        return ModelConfig("kimi_k3", text, vision, _is_mxfp4(quant), d.get("media_placeholder_token_id"), raw=d)
    if model_type == "kimi_linear":
        return ModelConfig("kimi_linear", parse_text_config(d), None, _is_mxfp4(d.get("quantization_config")),
                           raw=d)
    raise ConfigError(f"config field 'model_type': unknown model_type {model_type!r}; supported: kimi_k3, "
                      "kimi_linear")
