"""Naive restatements of the K3-specific pieces, written straight from the spec, against the layers.

AttnRes (block schedule and mix), LatentMoE (router, latent experts, norm, up-projection, shared experts),
SiTU, the K3 KDA decay gate, the MLA output gate, and grouped top-k routing.
"""

from __future__ import annotations

import math

import pytest
import torch

from k3serve.core.config import ModelConfig
from k3serve.core.context import ForwardContext, forward_context
from k3serve.layers.kda import kda_gate
from k3serve.layers.moe import select_experts
from k3serve.models.cache import allocate_caches, cache_spec
from k3serve.models.kimi import build_model
from k3serve.models.registry import packaged_config
from k3serve.models.writer import init_random_
from k3serve.ops.activation import situ_and_mul
from k3serve.ops.attn_res import attn_res_mix
from k3serve.ops.mla import naive_mla_attention
from k3serve.ops.mx import mxfp4_dequantize


@pytest.fixture(scope="module")
def k3():
    cfg = ModelConfig.from_file(packaged_config("k3-tiny"))
    return cfg, init_random_(build_model(cfg), seed=5).eval()


def _ctx(model, n: int) -> ForwardContext:
    caches = allocate_caches(cache_spec(model, torch.float32), num_blocks=8, block_size=16, num_slots=1)
    return ForwardContext(cu_seqlens=torch.tensor([0, n]), cached_lens=[0], state_slots=torch.tensor([0]),
                          block_tables=torch.arange(8)[None], caches=caches)


def naive_mix(sources: list[torch.Tensor], proj_w: torch.Tensor, norm_w: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(sources[0])
    q = [float(a) * float(b) for a, b in zip(norm_w, proj_w.reshape(-1))]
    for t in range(sources[0].shape[0]):
        scores = []
        for s in sources:
            v = s[t].tolist()
            r = math.sqrt(sum(x * x for x in v) / len(v) + eps)
            scores.append(sum(x / r * w for x, w in zip(v, q)))
        m = max(scores)
        p = [math.exp(x - m) for x in scores]
        p = [x / sum(p) for x in p]
        out[t] = sum(pi * s[t] for pi, s in zip(p, sources))
    return out


def test_attn_res_mix_matches_naive():
    g = torch.Generator().manual_seed(0)
    blocks = [torch.randn(5, 16, generator=g) * (i + 1) for i in range(3)]
    partial = torch.randn(5, 16, generator=g)
    pw, nw = torch.randn(1, 16, generator=g), torch.randn(16, generator=g)
    torch.testing.assert_close(attn_res_mix(blocks, partial, pw, nw, 1e-5), naive_mix([*blocks, partial], pw, nw, 1e-5))
    assert attn_res_mix([], partial, pw, nw, 1e-5) is partial


def test_block_attn_res_schedule_matches_naive(k3):
    """Sources of sublayer j: [embedding] + completed block sums + the current block's partial sum (if any)."""
    cfg, model = k3
    lm = model.language_model.model
    S, eps = cfg.text.attn_res_block_size, cfg.text.rms_norm_eps
    ids = torch.tensor([3, 17, 99, 4, 1000, 7, 7])
    with torch.inference_mode():
        ctx = _ctx(model, len(ids))
        with forward_context(ctx):
            got = lm(ids, ctx)
        ctx = _ctx(model, len(ids))
        emb = lm.embed_tokens(ids)
        outputs: list[tuple[int, torch.Tensor]] = []  # (block index, sublayer output)

        def sources(block: int) -> list[torch.Tensor]:
            done = [sum(o for b, o in outputs if b == k) for k in range(block)]
            current = [o for b, o in outputs if b == block]
            return [emb, *done, *([sum(current)] if current else [])]

        with forward_context(ctx):
            for i, layer in enumerate(lm.layers):
                blk = i // S
                h = naive_mix(sources(blk), layer.self_attention_res_proj.weight, layer.self_attention_res_norm.weight, eps)
                outputs.append((blk, layer.self_attn(layer.input_layernorm(h), ctx)))
                h = naive_mix(sources(blk), layer.mlp_res_proj.weight, layer.mlp_res_norm.weight, eps)
                outputs.append((blk, layer.ffn(layer.post_attention_layernorm(h))))
        n_blocks = -(-cfg.text.num_hidden_layers // S)
        srcs = sources(n_blocks - 1)
        assert len(srcs) == n_blocks + 1  # 9 layers, S=4: [emb, B0, B1, partial B2], like K3's 9 sources
        want = lm.norm(naive_mix(srcs, lm.output_attn_res_proj.weight, lm.output_attn_res_norm.weight, eps))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_situ_matches_formula():
    x = torch.linspace(-40, 40, 97)
    u = torch.linspace(60, -60, 97)
    got = situ_and_mul(x, u, beta=4.0, linear_beta=25.0)
    for i in range(97):
        g, v = float(x[i]), float(u[i])
        want = 4 * math.tanh(g / 4) / (1 + math.exp(-g)) * 25 * math.tanh(v / 25)
        assert abs(float(got[i]) - want) < 1e-4 * max(1, abs(want))
    assert got.abs().max() <= 100  # soft caps bound the output by beta * linear_beta


def test_k3_gate_matches_formula():
    g = torch.Generator().manual_seed(1)
    f = torch.randn(3, 2, 4, generator=g) * 5
    dt = torch.randn(8, generator=g)
    a_log = torch.randn(2, generator=g)
    got = kda_gate(f, dt, a_log, -5.0)
    got_kl = kda_gate(f, dt, a_log, None)
    for n in range(3):
        for h in range(2):
            for c in range(4):
                x = float(f[n, h, c]) + float(dt[h * 4 + c])
                rate = math.exp(float(a_log[h]))
                assert abs(float(got[n, h, c]) - (-5.0 / (1 + math.exp(-rate * x)))) < 1e-5
                assert abs(float(got_kl[n, h, c]) - (-rate * math.log1p(math.exp(x)))) < 1e-4
    assert got.min() > -5 and got.max() < 0


def test_mla_output_gate_matches_naive(k3):
    cfg, model = k3
    attn = model.language_model.model.layers[3].self_attn
    assert attn.g_proj is not None
    x = torch.randn(6, cfg.text.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        ctx = _ctx(model, 6)
        with forward_context(ctx):
            got = attn(x, ctx)
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).view(6, attn.num_heads, attn.qk_dim)
        ckv = attn.kv_a_proj_with_mqa(x)
        lat = torch.cat([attn.kv_a_layernorm(ckv[:, : attn.kv_lora_rank]), ckv[:, attn.kv_lora_rank:]], -1)
        o = naive_mla_attention(q, lat, attn.kv_b_proj.weight, nope_dim=attn.nope_dim, v_dim=attn.v_dim)
        want = attn.o_proj(o.reshape(6, -1) * torch.sigmoid(attn.g_proj(x)))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def naive_route(logits, bias, k, groups, topk_groups):
    out = []
    for row_l, row_b in zip(logits.tolist(), bias.tolist()):
        s = [1 / (1 + math.exp(-x)) for x in row_l]
        c = [a + b for a, b in zip(s, row_b if isinstance(row_b, list) else bias.tolist())]
        size = len(s) // groups
        gs = [sum(sorted(c[g * size:(g + 1) * size])[-2:]) for g in range(groups)]
        keep = sorted(range(groups), key=lambda g: -gs[g])[:topk_groups]
        allowed = [e for e in range(len(s)) if e // size in keep]
        ids = sorted(allowed, key=lambda e: -c[e])[:k]
        w = [s[e] for e in ids]
        out.append({e: x / (sum(w) + 1e-20) for e, x in zip(ids, w)})
    return out


def test_grouped_routing_matches_naive():
    g = torch.Generator().manual_seed(3)
    logits, bias = torch.randn(7, 16, generator=g), torch.randn(16, generator=g) * 0.1
    w, ids = select_experts(logits, bias, top_k=4, activation="sigmoid", num_groups=4, topk_groups=2,
                            renormalize=True, scaling=1.0)
    want = naive_route(logits, bias.expand(7, 16), 4, 4, 2)
    for t in range(7):
        got = dict(zip(ids[t].tolist(), w[t].tolist()))
        assert got.keys() == want[t].keys()
        for e in got:
            assert abs(got[e] - want[t][e]) < 1e-6
        assert len({e // 4 for e in got}) <= 2  # only the two kept groups


def test_latent_moe_matches_naive(k3):
    cfg, model = k3
    moe = model.language_model.model.layers[1].block_sparse_moe
    t = cfg.text
    x = torch.randn(5, t.hidden_size, generator=torch.Generator().manual_seed(4))
    ex = moe.experts
    I = ex.inter
    with torch.inference_mode():
        got = moe(x)
        want = torch.empty_like(got)
        w13 = mxfp4_dequantize(ex.w13_packed, ex.w13_scale)
        w2 = mxfp4_dequantize(ex.w2_packed, ex.w2_scale)
        logits = x @ moe.gate.weight.t()
        routes = naive_route(logits, moe.gate.e_score_correction_bias.expand(5, -1), t.num_experts_per_token, 1, 1)
        for n in range(5):
            lat = moe.routed_expert_down_proj.weight @ x[n]
            y = torch.zeros_like(lat)
            for e, wt in routes[n].items():
                h = w13[e] @ lat
                y += wt * t.routed_scaling_factor * (w2[e] @ situ_and_mul(h[:I], h[I:], 4.0, 25.0))
            y = y / torch.sqrt(y.pow(2).mean() + t.rms_norm_eps) * moe.routed_expert_norm.weight
            want[n] = moe.routed_expert_up_proj.weight @ y + moe.shared_experts(x[n:n + 1])[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
