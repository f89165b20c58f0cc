"""The training short conv (hand-written backward) against the serving form and the naive reference: values
and new state bit for bit, gradients to x and the filters as autograd through the reference gives them,
on odd packed lengths (empty, shorter than the filter, long), with and without incoming state."""

from __future__ import annotations

import pytest
import torch

import k3serve.ops.short_conv  # noqa: F401
from k3serve.ops.short_conv import causal_conv1d, naive_causal_conv1d
from training.conv_autograd import packed_conv_train
from training.forward import training_backend
from k3serve.ops import registry

LENS = [0, 1, 2, 3, 5, 17, 64, 0, 9]


def _case(lens, C=10, W=4, with_state=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lens), C, generator=g)
    w = torch.randn(C, W, generator=g)
    state = torch.randn(len(lens), C, W - 1, generator=g) if with_state else None
    return x, w, state, torch.tensor([0, *lens]).cumsum(0)


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("W", [1, 2, 4])
def test_forward_equals_the_serving_form_bit_for_bit(activation, with_state, W):
    x, w, state, cu = _case(LENS, W=W, with_state=with_state)
    y, s = packed_conv_train(x, w, conv_state=state, cu_seqlens=cu, activation=activation)
    y_ref, s_ref = causal_conv1d(x, w, conv_state=state, cu_seqlens=cu, activation=activation)
    assert torch.equal(y, y_ref) and torch.equal(s, s_ref) and s.shape == s_ref.shape


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("lens", [LENS, [130], [2, 1]])
def test_gradients_equal_autograd_through_the_reference(activation, lens):
    x, w, state, cu = _case(lens, seed=len(lens))
    results = []
    for fn in (packed_conv_train, naive_causal_conv1d):
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        y, _ = fn(xl, wl, conv_state=state, cu_seqlens=cu, activation=activation)
        probe = torch.linspace(-1, 1, y.numel()).view_as(y)
        results.append([y, *torch.autograd.grad((y * probe).sum(), [xl, wl])])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_training_selects_it_and_restores_the_serving_form():
    before = registry.active("short_conv")
    with training_backend(torch.device("cpu")):
        assert registry.active("short_conv") == "train"
    assert registry.active("short_conv") == before
