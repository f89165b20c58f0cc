"""The KDA decode step (conv, norms, gate, beta, delta rule as one op): the torch form and the native CPU
kernel against the naive references (naive conv + naive recurrence), on odd head sizes (vector tails), both
gate forms, strided q|k|v rows, several steps in a row, packed vs per-sequence, and the fallbacks."""

from __future__ import annotations

import pytest
import torch

from k3serve.ops import native, registry
from k3serve.ops.kda import kda_decode_step, kda_decode_step_cpu, kda_gate, l2_normalize, naive_recurrent_kda
from k3serve.ops.kda import cpu as kda_cpu
from k3serve.ops.short_conv import naive_causal_conv1d

needs_native = pytest.mark.skipif(not native.available(), reason="native CPU kernels not built")


def make(N: int, H: int, K: int, V: int, W: int, seed: int):
    """Step inputs; q|k|v and b are column slices of wider rows, as the fused projection returns them."""
    g = torch.Generator().manual_seed(seed)
    ch = 2 * H * K + H * V
    wide = torch.randn(N, ch + H + 5, generator=g)
    qkv, b = wide[:, 2:2 + ch], wide[:, 2 + ch:2 + ch + H]
    conv_w = torch.randn(ch, W, generator=g) * 0.5
    conv_state = torch.randn(N, ch, W - 1, generator=g)
    f = torch.randn(N, H, K, generator=g) * 6  # past softplus' threshold and deep into its left tail
    dt_bias, a_log = torch.randn(H * K, generator=g), torch.randn(H, generator=g)
    state = torch.randn(N, H, K, V, generator=g)
    return qkv, conv_w, conv_state, f, dt_bias, a_log, b, state


def naive_step(qkv, conv_w, conv_state, f, dt_bias, a_log, b, state, lower_bound):
    """The spec: naive conv, then the naive recurrence for one token; returns o and the new states."""
    N, H, K = f.shape
    y, new_conv = naive_causal_conv1d(qkv, conv_w, conv_state=conv_state, cu_seqlens=torch.arange(N + 1))
    qk = l2_normalize(y[:, :2 * H * K].reshape(N, 2 * H, K))
    v = y[:, 2 * H * K:].reshape(N, 1, H, -1)
    g = kda_gate(f, dt_bias, a_log, lower_bound)
    o, new_state = naive_recurrent_kda(qk[:, None, :H], qk[:, None, H:], v, g[:, None], torch.sigmoid(b)[:, None],
                                       initial_state=state)
    return o[:, 0], new_conv, new_state


@pytest.mark.parametrize("impl", ["torch", "naive", pytest.param("cpu", marks=needs_native)])
@pytest.mark.parametrize("N,H,K,V,W", [(5, 3, 5, 7, 4), (4, 2, 24, 16, 2), (3, 4, 32, 32, 4), (1, 1, 8, 9, 3)])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_steps_match_naive(impl, N, H, K, V, W, lower_bound) -> None:
    step = registry.get("kda_decode_step", impl)
    qkv, conv_w, conv_state, f, dt_bias, a_log, b, state = make(N, H, K, V, W, seed=N * 10 + K)
    want_conv, want_state = conv_state.clone(), state.clone()
    for t in range(3):  # the states carried over three steps
        x = qkv * (t + 1)
        o = step(x, conv_w, conv_state, f, dt_bias, a_log, b, state, lower_bound=lower_bound)
        want_o, want_conv, want_state = naive_step(x, conv_w, want_conv, f, dt_bias, a_log, b, want_state,
                                                   lower_bound)
        torch.testing.assert_close(o, want_o, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(conv_state, want_conv, rtol=0, atol=0)


@needs_native
def test_cpu_matches_torch_form_and_is_per_sequence() -> None:
    """The kernel against the torch form, and its packed call equal (bit for bit) to per-sequence calls."""
    args = make(6, 4, 32, 32, 4, seed=1)
    qkv, conv_w, conv_state, f, dt_bias, a_log, b, state = args
    cs_t, st_t = conv_state.clone(), state.clone()
    want = kda_decode_step(qkv, conv_w, cs_t, f, dt_bias, a_log, b, st_t, lower_bound=None)
    cs_c, st_c = conv_state.clone(), state.clone()
    got = kda_decode_step_cpu(qkv, conv_w, cs_c, f, dt_bias, a_log, b, st_c, lower_bound=None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st_c, st_t, rtol=1e-5, atol=1e-5)
    for i in range(6):
        cs_i, st_i = conv_state[i:i + 1].clone(), state[i:i + 1].clone()
        one = kda_decode_step_cpu(qkv[i:i + 1], conv_w, cs_i, f[i:i + 1], dt_bias, a_log, b[i:i + 1], st_i,
                                  lower_bound=None)
        assert torch.equal(one, got[i:i + 1]) and torch.equal(st_i, st_c[i:i + 1])
        assert torch.equal(cs_i, cs_c[i:i + 1])


@needs_native
def test_cpu_falls_back(monkeypatch) -> None:
    """Non-fp32 states, a non-contiguous state or recorded gradients go to the torch form."""
    monkeypatch.setattr(kda_cpu, "kda_decode_step", lambda *a, **k: "torch")
    qkv, conv_w, conv_state, f, dt_bias, a_log, b, state = make(2, 2, 8, 8, 4, seed=2)
    step = kda_decode_step_cpu
    assert step(qkv, conv_w, conv_state.bfloat16(), f, dt_bias, a_log, b, state, lower_bound=None) == "torch"
    strided = state.transpose(2, 3)
    assert step(qkv, conv_w, conv_state, f, dt_bias, a_log, b, strided, lower_bound=None) == "torch"
    assert step(qkv.requires_grad_(), conv_w, conv_state, f, dt_bias, a_log, b, state, lower_bound=None) == "torch"
    with torch.no_grad():
        assert isinstance(step(qkv, conv_w, conv_state, f, dt_bias, a_log, b, state, lower_bound=None), torch.Tensor)


def test_registered_and_active() -> None:
    assert registry.get("kda_decode_step", "torch") is kda_decode_step
    assert registry.get("kda_decode_step", "cpu") is kda_decode_step_cpu
    assert registry.active("kda_decode_step") == ("cpu" if native.available() else "torch")
