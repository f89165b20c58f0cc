"""The differentiable training KDA equals the recurrence in values and gradients (odd, packed lengths)."""

import pytest
import torch
import torch.nn.functional as F

import k3serve.ops.kda  # noqa: F401
from k3serve.ops import registry
from k3serve.ops.kda import naive_recurrent_kda
from training.forward import training_backend
from training import kda_autograd
from training.kda_autograd import _intra, chunk_kda_train


def _inputs(lens, H=2, K=8, V=6, g_scale=5.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q = F.normalize(torch.randn(1, T, H, K, generator=g), dim=-1)
    k = F.normalize(torch.randn(1, T, H, K, generator=g), dim=-1)
    v = torch.randn(1, T, H, V, generator=g)
    gate = -g_scale * torch.rand(1, T, H, K, generator=g)
    beta = torch.rand(1, T, H, generator=g)
    s0 = torch.randn(len(lens), H, K, V, generator=g)
    return q, k, v, gate, beta, s0, torch.tensor([0, *lens]).cumsum(0)


def _loop(q, k, v, g, beta, s0, cu):
    """Out-of-place token recurrence (autograd-friendly twin of naive_recurrent_kda)."""
    outs, finals = [], []
    scale = q.shape[-1] ** -0.5
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        S = s0[n]
        for t in range(a, b):
            S = S * g[0, t].exp()[..., None]
            u = (S * k[0, t][..., None]).sum(-2)
            S = S + k[0, t][..., None] * (beta[0, t][..., None] * (v[0, t] - u))[..., None, :]
            outs.append((S * (scale * q[0, t])[..., None]).sum(-2))
        finals.append(S)
    return torch.stack(outs)[None], torch.stack(finals)


@pytest.mark.parametrize("lens,g_scale", [([5, 37, 16, 70], 5.0), ([1, 33], 5.0), ([29, 3, 17], 20.0),
                                          ([70, 129], 2.0)])
def test_values_match_recurrence(lens, g_scale):
    q, k, v, g, beta, s0, cu = _inputs(lens, g_scale=g_scale)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=s0, cu_seqlens=cu)
    o, s = chunk_kda_train(q, k, v, g, beta, initial_state=s0, cu_seqlens=cu)
    assert torch.allclose(o, o_ref, atol=2e-5) and torch.allclose(s, s_ref, atol=2e-5)


# the in-chunk forms of _intra at CHUNK = 32 (below): two matmuls; sub-blocks of two matmuls; pairwise sub-blocks
@pytest.mark.parametrize("g_scale", [2.0, 8.0, 20.0])
def test_gradients_match_loop(g_scale):
    lens = [19, 7]
    base = _inputs(lens, g_scale=g_scale, seed=1)
    grads = []
    for fn in (chunk_kda_train, None):
        leaves = [t.clone().requires_grad_(True) for t in base[:6]]
        if fn is None:
            o, s = _loop(*leaves, base[6])
        else:
            o, s = fn(*leaves[:5], initial_state=leaves[5], cu_seqlens=base[6])
        w = torch.linspace(-1, 1, o.numel()).view_as(o)
        ((o * w).sum() + s.square().sum()).backward()
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-3)


def test_backend_is_restored():
    before = registry.get("kda_chunk")
    with training_backend(torch.device("cpu")):
        assert registry.get("kda_chunk") is chunk_kda_train
    assert registry.get("kda_chunk") is before


def test_gpu_training_takes_the_fewest_op_forms():
    ops = ("kda_chunk", "mla_prefill_packed", "expert_combine")
    before = {op: registry.active(op) for op in ops}
    with training_backend(torch.device("cpu")):
        assert registry.active("expert_combine") == before["expert_combine"]
    with training_backend(torch.device("meta")):  # any non-CPU device
        assert [registry.active(op) for op in ops] == ["train", "bucketed", "grouped"]
    assert {op: registry.active(op) for op in ops} == before


@pytest.mark.parametrize("C,g_scale,blocked", [(64, 2.0, False), (64, 5.0, True), (64, 20.0, True), (48, 5.0, True),
                                               (40, 5.0, False), (16, 20.0, False)])
def test_in_chunk_terms_match_the_pairwise_definition(C, g_scale, blocked, monkeypatch):
    """Every form _intra picks (one midpoint, sub-blocks with midpoint or pairwise diagonals, or pairwise
    for a chunk that is not a multiple of SUB) equals exp(Gamma_r - Gamma_j) built pairwise in float64."""
    gen = torch.Generator().manual_seed(C)
    M, H, K = 3, 2, 8
    q, k = (F.normalize(torch.randn(M, H, C, K, generator=gen), dim=-1) for _ in range(2))
    g = -g_scale * torch.rand(M, H, C, K, generator=gen)
    g[0, 0, 5] = -g_scale  # the bound itself occurs
    gamma = g.cumsum(2)
    calls = []
    real = kda_autograd._intra_blocked
    monkeypatch.setattr(kda_autograd, "_intra_blocked", lambda *a: calls.append(1) or real(*a))
    a_qk, a_kk = _intra(q, k, gamma, float(g.min()))
    assert bool(calls) == blocked  # the form the case is meant to cover is the one that ran
    d = (gamma.double().unsqueeze(3) - gamma.double().unsqueeze(2)).clamp(max=0).exp()  # [M, H, r, j, K]
    causal = torch.ones(C, C, dtype=torch.bool).tril()
    ref_qk = torch.einsum("...rc,...jc,...rjc->...rj", q.double(), k.double(), d) * causal
    ref_kk = torch.einsum("...rc,...jc,...rjc->...rj", k.double(), k.double(), d).tril(-1)
    assert torch.isfinite(a_qk).all() and torch.isfinite(a_kk).all()
    assert torch.allclose(a_qk.double(), ref_qk, atol=1e-5) and torch.allclose(a_kk.double(), ref_kk, atol=1e-5)
