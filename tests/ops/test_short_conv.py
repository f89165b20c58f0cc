"""Short causal conv: the packed varlen form and the decode step against the token-by-token reference,
and the reference itself against torch's conv1d on fresh sequences."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3serve.ops import registry
from k3serve.ops.short_conv import causal_conv1d, causal_conv1d_update, naive_causal_conv1d, naive_causal_conv1d_update

C, W = 12, 4
LENS = [0, 1, 2, 3, 5, 17, 64]



def cu_of(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def assert_close(name: str, got: torch.Tensor, ref: torch.Tensor, tol: float = 1e-6) -> None:
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert got.dtype == ref.dtype, f"{name}: dtype {got.dtype} != {ref.dtype}"
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    err = (got.double() - ref.double()).abs().max().item() if got.numel() else 0.0
    assert err <= tol * max(1.0, ref.abs().max().item()), f"{name}: max abs error {err:.3e}"


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("conv1d_layout", [False, True])
def test_packed_matches_naive(activation: str | None, with_state: bool, conv1d_layout: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(LENS), C, generator=gen)
    weight = torch.randn(C, 1, W, generator=gen) if conv1d_layout else torch.randn(C, W, generator=gen)
    state = torch.randn(len(LENS), C, W - 1, generator=gen) if with_state else None
    cu = cu_of(LENS)
    y_ref, s_ref = naive_causal_conv1d(x, weight, conv_state=state, cu_seqlens=cu, activation=activation)
    y, s = causal_conv1d(x, weight, conv_state=state, cu_seqlens=cu, activation=activation)
    assert_close("y", y, y_ref)
    assert_close("state", s, s_ref)
    per_seq = [
        naive_causal_conv1d(
            x[a:b], weight, conv_state=None if state is None else state[n : n + 1], activation=activation
        )
        for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist()))
    ]
    assert_close("y per sequence", y, torch.cat([p[0] for p in per_seq]))
    assert_close("state per sequence", s, torch.cat([p[1] for p in per_seq]))


def test_reference_matches_torch_conv1d() -> None:
    x, weight = torch.randn(23, C), torch.randn(C, 1, W)
    expected = F.silu(F.conv1d(F.pad(x.T[None], (W - 1, 0)), weight, groups=C)[0].T)
    y, s = naive_causal_conv1d(x, weight)
    assert_close("y", y, expected)
    assert torch.equal(s, x[-(W - 1) :].T[None])


def test_short_sequences_shift_in_old_state() -> None:
    state = torch.arange(2 * C * (W - 1), dtype=torch.float32).view(2, C, W - 1)
    x = torch.randn(3, C)
    _, s = causal_conv1d(x, torch.randn(C, W), conv_state=state, cu_seqlens=cu_of([1, 2]))
    assert torch.equal(s[0], torch.cat([state[0, :, 1:], x[0, :, None]], 1))
    assert torch.equal(s[1], torch.cat([state[1, :, 2:], x[1:].T], 1))


@pytest.mark.parametrize("in_place", [False, True])
def test_decode_steps_match_prefill(in_place: bool) -> None:
    N, T = 3, 9
    x, weight, state0 = torch.randn(N, T, C), torch.randn(C, 1, W), torch.randn(N, C, W - 1)
    y_ref, s_ref = causal_conv1d(x.reshape(N * T, C), weight, conv_state=state0, cu_seqlens=cu_of([T] * N))
    state, ys = state0.clone(), []
    for t in range(T):
        y, new = causal_conv1d_update(x[:, t], weight, state, out_state=state if in_place else None)
        assert (new is state) == in_place
        state = new
        ys.append(y)
    assert_close("y", torch.stack(ys, 1).reshape(N * T, C), y_ref)
    assert_close("state", state, s_ref)


@pytest.mark.parametrize("split", [1, 2, 10])
def test_state_handoff(split: int) -> None:
    x, weight = torch.randn(20, C), torch.randn(C, W)
    y_full, s_full = causal_conv1d(x, weight)
    y1, s1 = causal_conv1d(x[:split], weight)
    y2, s2 = causal_conv1d(x[split:], weight, conv_state=s1)
    assert_close("y", torch.cat([y1, y2]), y_full)
    assert_close("state", s2, s_full)


def test_dtypes() -> None:
    x, weight = torch.randn(10, C).bfloat16(), torch.randn(C, 1, W)
    y, s = causal_conv1d(x, weight)
    assert y.dtype == torch.bfloat16 and s.dtype == torch.bfloat16
    y, s = causal_conv1d(x, weight, conv_state=torch.zeros(1, C, W - 1))
    assert s.dtype == torch.float32
    y_ref, _ = naive_causal_conv1d(x, weight)
    assert_close("bf16 y", y, y_ref, tol=1e-2)


def test_bad_inputs_raise_value_error() -> None:
    x, weight = torch.randn(10, C), torch.randn(C, W)
    with pytest.raises(ValueError, match="^weight "):
        causal_conv1d(x, torch.randn(C + 1, W))
    with pytest.raises(ValueError, match="^conv_state "):
        causal_conv1d(x, weight, conv_state=torch.zeros(1, C, W))
    with pytest.raises(ValueError, match="^cu_seqlens "):
        causal_conv1d(x, weight, cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="^activation "):
        causal_conv1d(x, weight, activation="gelu")
    with pytest.raises(ValueError, match="^x "):
        causal_conv1d(x[None], weight)
    with pytest.raises(ValueError, match="^conv_state "):
        causal_conv1d_update(x[:2], weight, torch.zeros(3, C, W - 1))


def test_registered_backends() -> None:
    assert registry.get("short_conv", "torch") is causal_conv1d
    assert registry.get("short_conv_update", "torch") is causal_conv1d_update
    assert registry.get("short_conv", "naive") is naive_causal_conv1d
    assert registry.get("short_conv_update", "naive") is naive_causal_conv1d_update


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("in_place", [False, True])
def test_update_matches_naive(activation: str | None, in_place: bool) -> None:
    gen = torch.Generator().manual_seed(5)
    x, weight = torch.randn(5, C, generator=gen), torch.randn(C, W, generator=gen)
    state0 = torch.randn(5, C, W - 1, generator=gen)
    want_state = state0.clone()
    y_ref, s_ref = naive_causal_conv1d_update(x, weight, want_state, activation=activation,
                                              out_state=want_state if in_place else None)
    assert (s_ref is want_state) == in_place
    y, s = causal_conv1d_update(x, weight, state0.clone(), activation=activation)
    assert_close("y", y, y_ref)
    assert_close("state", s, s_ref, tol=0)
