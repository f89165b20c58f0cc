"""Parameter, byte and cache arithmetic against the published K3 figures and hand-counted tiny configs."""

from __future__ import annotations

import dataclasses

import pytest

from k3serve.plan.model_math import (
    PRECISIONS, ParamSummary, TensorSpec, components, kda_layer, kda_state_bytes_per_sequence, mla_kv_bytes_per_token,
    mla_layer,
)


def by_name(cfg):
    return {c.name: c for c in components(cfg)}


def test_k3_published_totals(k3):
    s = ParamSummary.of(k3)
    assert round(s.total / 1e12, 2) == 2.78
    assert s.active == pytest.approx(104.2e9, rel=0.005)
    assert s.active_with_embedding == pytest.approx(105.4e9, rel=0.005)  # model.md §7.1
    assert s.expert_params == pytest.approx(2722.7e9, rel=1e-4)
    assert s.weight_bytes["mxfp4"] == pytest.approx(1560.9e9, rel=0.005)  # the published checkpoint size
    assert s.weight_bytes["bf16"] == pytest.approx(5.56e12, rel=0.005)  # planner_ep_sandbox.md §1.3


def test_k3_layer_sizes_match_design_table(k3):
    c = by_name(k3)
    assert c["mla"].params_each == pytest.approx(232.2e6, rel=1e-3)
    assert c["kda"].params_each == pytest.approx(443.7e6, rel=1e-3)
    assert c["routed_experts"].params_each == 3 * 3584 * 3072
    assert c["moe_fixed"].params_each + c["shared_experts"].params_each == pytest.approx(189.9e6, rel=1e-3)
    assert (c["mla"].count, c["kda"].count, c["routed_experts"].count) == (24, 69, 92 * 896)
    # 17.55 MB per MXFP4 expert on disk (4 bits + one E8M0 byte per 32)
    assert c["routed_experts"].bytes_each(PRECISIONS["mxfp4"]) == 17_547_264


def test_k3_tiny_hand_counts(cfgs):
    """model.md §7.2 table: 80,000 per MLA layer, 92,324 per KDA layer, 8.62M in all."""
    c = by_name(cfgs["k3-tiny"])
    assert c["mla"].params_each == 80_000 and c["mla"].count == 3
    assert c["kda"].params_each == 92_324 and c["kda"].count == 6
    assert c["routed_experts"].params == 6_291_456
    assert c["moe_fixed"].params + c["shared_experts"].params == 590_848
    assert c["dense_mlp"].params == 147_456
    assert c["embed_tokens"].params + c["lm_head"].params == 524_288
    assert c["vision_blocks"].params + c["vision_rest"].params == 267_456
    assert ParamSummary.of(cfgs["k3-tiny"]).total == 8_622_744
    assert ParamSummary.of(cfgs["k3-tiny-grouped"]).total == 8_622_744  # grouping adds no parameters


def test_kimi_linear_flavour_hand_counts(cfgs):
    """Low-rank KDA gate, softplus decay, q without LoRA, no MLA gate, no AttnRes, no LatentMoE."""
    t = cfgs["kimi-linear-tiny"].text  # d=128, h=4, K=32, P=128, MLA 4 heads, kv_lora 64
    kda = {s.name: s.numel for s in kda_layer(t)}
    assert "g_proj" not in kda and kda["g_a_proj"] == 32 * 128 and kda["g_b_proj"] == 128 * 32
    assert sum(kda.values()) == 3 * 128 * 128 + 3 * 128 * 4 + 2 * 32 * 128 + 128 + 4 + 4 * 128 + 2 * 32 * 128 + 32 \
        + 128 * 128
    mla = {s.name: s.numel for s in mla_layer(t)}
    assert set(mla) == {"q_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"}
    assert sum(mla.values()) == 4 * 48 * 128 + 80 * 128 + 64 + 4 * 64 * 64 + 128 * 128
    c = by_name(cfgs["kimi-linear-tiny"])
    assert c["layer_norms"].params_each == 2 * 128  # no AttnRes vectors
    assert c["final_norms"].params_each == 128
    assert c["moe_fixed"].params_each == 16 * 128 + 16  # router + bias only: experts run at full width
    assert c["routed_experts"].params_each == 3 * 128 * 64


def test_kimi_linear_48b_cross_check(cfgs):
    s = ParamSummary.of(cfgs["kimi-linear-48b"])
    assert s.total == pytest.approx(49.1e9, rel=0.005)
    assert s.active_with_embedding == pytest.approx(3.5e9, rel=0.02)


def test_tied_embeddings_drop_lm_head_but_not_its_matmul(k3):
    tied = k3.replace_text(tie_word_embeddings=True)
    a, b = ParamSummary.of(k3), ParamSummary.of(tied)
    assert a.total - b.total == 163840 * 7168
    assert a.active == b.active


def test_counts_follow_the_config(k3):
    half = k3.replace_text(num_experts=448)
    a, b = ParamSummary.of(k3), ParamSummary.of(half)
    assert a.expert_params == 2 * b.expert_params
    # only the router and its selection bias shrink among active params
    assert a.active == b.active + (896 - 448) * (7168 + 1) * 92


def test_precision_bytes():
    t = TensorSpec("w", (10, 64), "expert")
    assert PRECISIONS["mxfp4"].tensor_bytes(t) == 10 * (32 + 2)
    assert PRECISIONS["mxfp8"].tensor_bytes(t) == 10 * (64 + 2)
    assert PRECISIONS["bf16"].tensor_bytes(t) == 10 * 64 * 2
    assert PRECISIONS["mxfp4"].tensor_bytes(TensorSpec("w", (1, 33), "expert")) == 17 + 2  # partial block
    assert PRECISIONS["mxfp4"].tensor_bytes(TensorSpec("a", (96,), "f32")) == 96 * 4
    with pytest.raises(ValueError):
        TensorSpec("bad", (0, 3))


def test_cache_sizes(k3, cfgs):
    assert mla_kv_bytes_per_token(k3.text) == 24 * 576 * 2 == 27 * 1024
    assert mla_kv_bytes_per_token(k3.text, 1) == 13.5 * 1024
    state = kda_state_bytes_per_sequence(k3.text)
    assert state == 69 * (96 * 128 * 128 * 4 + 3 * 12288 * 3 * 2)
    assert state / 2**20 == pytest.approx(428.6, abs=0.05)
    assert kda_state_bytes_per_sequence(cfgs["kimi-linear-48b"].text) / 2**20 == pytest.approx(41.4, abs=0.05)
    wider = dataclasses.replace(k3.text.linear_attn, conv_kernel_size=5)
    assert kda_state_bytes_per_sequence(k3.replace_text(linear_attn=wider).text) - state == 69 * 3 * 12288 * 2
