"""The training forms of ``training/fused.py`` against the ops' torch forms: values and gradients, odd shapes."""

import pytest
import torch

import k3serve.ops  # noqa: F401  (registers the torch forms)
import training.fused  # noqa: F401
from k3serve.ops import registry


def _grads(fn, inputs, seed=0):
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*inputs)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    out.backward(g)
    return out.detach(), [t.grad for t in inputs]


def _compare(op, make_args, inputs, atol=1e-5, rtol=1e-4):
    ref, ref_g = _grads(lambda *t: registry.get(op, "torch")(*make_args(*t)), inputs)
    got, got_g = _grads(lambda *t: registry.get(op, "train")(*make_args(*t)), inputs)
    torch.testing.assert_close(got, ref, atol=atol, rtol=rtol)
    for a, b in zip(got_g, ref_g):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


@pytest.mark.parametrize("shape", [(7, 5), (3, 11, 64), (1, 1)])
def test_rms_norm(shape):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=gen) * 3
    w = torch.randn(shape[-1], generator=gen)
    _compare("rms_norm", lambda x, w: (x, w, 1e-5), [x, w])


@pytest.mark.parametrize("shape", [(9, 4, 16), (5, 33)])
def test_gated_rms_norm(shape):
    gen = torch.Generator().manual_seed(2)
    x, z = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen) * 2
    w = torch.randn(shape[-1], generator=gen)
    _compare("gated_rms_norm", lambda x, z, w: (x, z, w, 1e-6), [x, z, w])


@pytest.mark.parametrize("sources", [2, 3, 5])
@pytest.mark.parametrize("n,d", [(13, 8), (1, 64)])
def test_attn_res_mix(sources, n, d):
    gen = torch.Generator().manual_seed(sources + n)
    vs = [torch.randn(n, d, generator=gen) * (1 + i) for i in range(sources)]
    pw, nw = torch.randn(1, d, generator=gen), torch.randn(d, generator=gen)
    _compare("attn_res_mix", lambda pw, nw, *v: (list(v[:-1]), v[-1], pw, nw, 1e-5), [pw, nw, *vs])


def test_attn_res_mix_without_blocks_is_the_partial():
    partial = torch.randn(4, 8)
    assert registry.get("attn_res_mix", "train")([], partial, torch.ones(1, 8), torch.ones(8), 1e-5) is partial


@pytest.mark.parametrize("linear_beta", [None, 25.0])
def test_situ_and_mul(linear_beta):
    gen = torch.Generator().manual_seed(3)
    gate, up = torch.randn(17, 6, generator=gen) * 8, torch.randn(17, 6, generator=gen) * 40
    _compare("situ_and_mul", lambda g, u: (g, u, 4.0, linear_beta), [gate, up], atol=2e-5)


def test_fused_grads_in_float64():
    """The hand-written backwards are the exact derivatives (gradcheck falls back to the torch form for
    non-fp32 inputs, so check the autograd Functions directly)."""
    from training.fused import _AttnResMix, _GatedRMSNorm, _RMSNorm
    gen = torch.Generator().manual_seed(4)
    dd = dict(dtype=torch.float64, requires_grad=True)
    x, z = (torch.randn(3, 5, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(2))
    w1 = torch.randn(5, generator=gen, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: _RMSNorm.apply(x, w, 1e-5), (x, w1))
    assert torch.autograd.gradcheck(lambda x, z, w: _GatedRMSNorm.apply(x, z, w, 1e-5), (x, z, w1))
    vs = [torch.randn(4, 5, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(3)]
    pw, nw = torch.randn(1, 5, **dd), torch.randn(5, **dd)
    assert torch.autograd.gradcheck(lambda pw, nw, *v: _AttnResMix.apply(pw, nw, 1e-5, *v), (pw, nw, *vs))
